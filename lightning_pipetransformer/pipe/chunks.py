"""``chunks="auto"``: choose the micro-batch count M for a pipe length K by timing real batches.

The paper profiled M over K..6K for every K. The best M depends on the device, the batch shape
and the partition, so it is measured rather than guessed: at the first forward through a pipeline
of a new length, every candidate M (up to the batch size) runs a forward and backward of the
stack on that very batch, and the fastest one wins. Gradients of the timing runs go through
``torch.autograd.grad`` and are thrown away, so ``.grad`` stays untouched; the hidden state is
detached, so nothing before the stack is run backward. The choice is cached per K (and saved in
checkpoints by the strategy), so each K pays once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_pipetransformer.pipe.pipeline import Pipeline
from lightning_pipetransformer.stack.interception import uncounted
from lightning_pipetransformer.stack.stack_call import StackCall, hidden_of
from lightning_pipetransformer.warn_once import WarnOnce

__all__ = ["ChunkTuner"]

_REPEATS = 2


def chunk_candidates(pipe_len: int) -> range:
    """The micro-batch counts the paper enumerated for a pipe length K: ``K .. 6K``."""
    return range(pipe_len, 6 * pipe_len + 1)


def fastest_chunks(timings: Mapping[int, float]) -> int:
    """The M with the lowest time; on ties the smaller M (fewer, larger micro-batches)."""
    best = min(sorted(timings), key=timings.__getitem__)
    if timings[best] == float("inf"):
        raise ValueError(f"No workable micro-batch count among {sorted(timings)}.")
    return best


class ChunkTuner:
    """Measures the fastest M for a pipeline on its first call, then behaves like that pipeline.

    ``on_choice(pipe_len, chunks)`` is called once with the winner, so the owner can record it.
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        balance: Sequence[int],
        devices: Sequence[torch.device],
        num_frozen: int,
        on_choice: Callable[[int, int], None],
    ) -> None:
        self.blocks = tuple(blocks)
        self.balance = tuple(balance)
        self.devices = tuple(devices)
        self.num_frozen = num_frozen
        self.on_choice = on_choice
        self.pipeline: Pipeline | None = None
        self._say = WarnOnce()  # shared by every pipeline it builds: a reason said once, not once per candidate M

    def run(self, call: StackCall) -> Any:
        if self.pipeline is None:
            if call.observed or not (torch.is_grad_enabled() and any(b.training for b in self.blocks)):
                # A sanity-check or validation batch: forward only, not what training costs. Or hooks
                # observe the blocks: timing runs would fire them, and the pass runs as one micro-batch.
                return self._pipeline(1).run(call)
            self.pipeline = self._tune(call)
        return self.pipeline.run(call)

    def _pipeline(self, chunks: int) -> Pipeline:
        return Pipeline(self.blocks, self.balance, self.devices, chunks=chunks, num_frozen=self.num_frozen, say=self._say)

    def _tune(self, call: StackCall) -> Pipeline:
        k = len(self.balance)
        # Micro-batches of one sample are never faster and break batch statistics: M <= B/2.
        candidates = [m for m in chunk_candidates(k) if m <= max(1, call.hidden.shape[0] // 2)] or [1]
        # The timing runs must leave no trace: same random stream (dropout) and same buffers
        # (BatchNorm running statistics) as a run with the chosen M fixed.
        buffers = [(b, b.detach().clone()) for block in self.blocks for b in block.buffers()]
        devices = [d for d in {*self.devices} if d.type == "cuda"]
        with torch.random.fork_rng(devices=devices), uncounted():
            chosen = self._time(candidates, call)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        self.on_choice(k, chosen)
        return self._pipeline(chosen)

    def _time(self, candidates: list[int], call: StackCall) -> int:
        params = [p for b in self.blocks for p in b.parameters() if p.requires_grad]
        timings: dict[int, float] = {}
        probe = StackCall(call.hidden.detach(), call.calls)  # no observer: the timing runs are not the pass
        for m in candidates:
            pipeline = self._pipeline(m)
            best = float("inf")
            for _ in range(_REPEATS):
                start = time.perf_counter()
                out = hidden_of(pipeline.run(probe))
                if torch.is_grad_enabled() and params and out.requires_grad:
                    torch.autograd.grad(out.float().sum(), params, allow_unused=True)
                _synchronize(self.devices)
                best = min(best, time.perf_counter() - start)
            timings[m] = best
        return fastest_chunks(timings)


def _synchronize(devices: Sequence[torch.device]) -> None:
    for device in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(device)
