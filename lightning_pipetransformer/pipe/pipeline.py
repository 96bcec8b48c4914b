"""The pipeline executor: one process drives a block stack cut into stages on K devices.

GPipe fill-drain in the style of torchgpipe. :meth:`Pipeline.run` takes one pass of the model's
loop over its blocks (:class:`~lightning_pipetransformer.stack.stack_call.StackCall`: the hidden
state and every block's own arguments), cuts it into ``chunks`` micro-batches
(:mod:`~lightning_pipetransformer.pipe.microbatch`), runs micro-batch ``i`` on
stage ``j`` at clock cycle ``i + j`` (:func:`clock_cycles`), and joins the last block's outputs on
the last stage's device. Autograd does the backward. ``pipeline(hidden, *args, **kwargs)`` is the
pass where every block gets the same arguments (``for block in blocks: hidden = block(hidden,
*args, **kwargs)``).

On CUDA each stage computes on its own stream and hands its output to the next stage through
events (:mod:`~lightning_pipetransformer.devices`), so stages work on different micro-batches at the same time; on CPU the
same code runs the same order with no streams, hence no overlap: micro-batching then only costs.

The executor is not an ``nn.Module``: it holds references to the blocks and never registers
them, so the user's module tree and state-dict keys stay as they are.
:func:`~lightning_pipetransformer.stack.interception.install_pipeline` makes a model's own loop
hand its passes to it.

Micro-batching changes nothing mathematically except for layers that look across the batch
(BatchNorm statistics are per micro-batch) and random ones (dropout draws differ from the
full-batch draws, so results match the plain module in distribution only; use dropout 0 to
compare). Floating-point sums may differ in the last bits (different matmul shapes). Two things
cannot be micro-batched and are handled loudly: a mutable object the blocks update per call (a
key-value cache: the pass runs as one micro-batch, with a warning), and a tensor passed whole that
a block modifies in place (it would be modified once per micro-batch: an error).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipetransformer import devices as dev
from lightning_pipetransformer import tree
from lightning_pipetransformer.devices import Device, Stream
from lightning_pipetransformer.pipe.microbatch import Scatter, batch_size, gather, scatter
from lightning_pipetransformer.plan import boundaries
from lightning_pipetransformer.stack.input_grad import as_marked_input, needs_no_gradient
from lightning_pipetransformer.stack.interception import call_block
from lightning_pipetransformer.stack.placeholders import refuse_placeholder
from lightning_pipetransformer.stack.stack_call import BlockArgs, InterceptionError, StackCall, hidden_of
from lightning_pipetransformer.warn_once import WarnOnce

__all__ = ["Pipeline", "PipelineStats", "clock_cycles"]

Blocks = tuple[nn.Module, ...]
Schedule = list[tuple[int, int]]


def clock_cycles(chunks: int, stages: int) -> Iterator[Schedule]:
    """The GPipe fill-drain schedule: the ``(micro-batch, stage)`` pairs of each clock cycle, in launch order.

    Micro-batch ``i`` runs on stage ``j`` at cycle ``i + j``, e.g. 3 micro-batches, 3 stages::

        cycle | stage 2 | stage 1 | stage 0
          0   |         |         | (0, 0)
          1   |         | (0, 1)  | (1, 0)
          2   | (0, 2)  | (1, 1)  | (2, 0)
          3   | (1, 2)  | (2, 1)  |
          4   | (2, 2)  |         |

    Pairs within a cycle are independent; on CUDA they run at the same time. They are launched
    last stage first: when stage ``j`` takes micro-batch ``i`` from stage ``j - 1``, the event it
    waits on is recorded on stage ``j - 1``'s stream at that moment, and a copy to another device
    is queued on that stream too (torch runs it on the source device's current stream). Stage
    ``j - 1`` must not have been given micro-batch ``i + 1`` yet, or stage ``j`` would wait for
    that as well: the forward would take ``M + 2(K - 1)`` stage-times instead of ``M + K - 1``.
    """
    for k in range(chunks + stages - 1):
        yield [(k - j, j) for j in reversed(range(max(0, k - chunks + 1), min(k + 1, stages)))]


@dataclass
class PipelineStats:
    """What the executor did (engagement, for the user's logger)."""

    #: Passes run.
    passes: int = 0
    #: Micro-batches run, over all passes (``micro_batches / passes`` is M when engaged).
    micro_batches: int = 0
    #: Passes run as one micro-batch although ``chunks`` > 1, because the blocks update a mutable object.
    stateful_fallbacks: int = 0


class Pipeline:
    """Run ``blocks`` as a pipeline of ``len(balance)`` stages over ``chunks`` micro-batches.

    Args:
        blocks: the stack, in order; stage ``j`` holds the next ``balance[j]`` of them.
        balance: blocks per stage, e.g. ``(4, 4, 4)``.
        devices: one device per stage (stages may share a device; on CUDA each still gets a
            stream of its own, from a pool shared with other pipelines: see
            :func:`~lightning_pipetransformer.devices.streams.stage_streams`). The blocks must already be
            there: see :meth:`place`.
        chunks: the number of micro-batches ``M`` (fewer for a batch of fewer samples).
        num_frozen: the leading blocks that are frozen (their parameters must not require
            grad). They run under ``torch.no_grad()`` unless something upstream needs gradients
            (a trainable embedding feeding the hidden state, a trainable tensor among their
            arguments), in which case they must stay in the graph so the gradient reaches it.
        say: the warn-once state to share with other pipelines of one owner (the chunk tuner's
            candidates), so that a reason is said once for them all; default: one of its own.

    Which arguments are batch-shaped follows :mod:`~lightning_pipetransformer.pipe.microbatch`, and
    the hidden state in a block's output follows
    :func:`~lightning_pipetransformer.stack.stack_call.hidden_of`: the interception learns the
    blocks' outputs by that same rule, so the two must never disagree.

    With one stage and one micro-batch a call is the plain loop: no split, no copy, no extra
    autograd node.
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        balance: Sequence[int],
        devices: Sequence[Device],
        chunks: int = 1,
        num_frozen: int = 0,
        *,
        say: WarnOnce | None = None,
    ) -> None:
        blocks, balance = tuple(blocks), tuple(balance)
        if any(b < 1 for b in balance) or not balance:
            raise ValueError(f"Every stage needs at least one block; the balance {balance} has an empty stage.")
        if sum(balance) != len(blocks):
            raise ValueError(
                f"The balance {balance} covers {sum(balance)} blocks, but the stack has {len(blocks)}."
            )
        if len(devices) != len(balance):
            raise ValueError(
                f"Got {len(devices)} devices for {len(balance)} stages (balance {balance}): give one device per stage."
            )
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"The number of micro-batches (chunks) must be a positive integer, got {chunks!r}.")
        if not 0 <= num_frozen <= len(blocks):
            raise ValueError(f"num_frozen must be in 0..{len(blocks)}, got {num_frozen}.")
        for index, block in enumerate(blocks[:num_frozen]):
            trainable = [name for name, p in block.named_parameters() if p.requires_grad]
            if trainable:
                raise ValueError(
                    f"Block {index} is declared frozen (num_frozen={num_frozen}) but its parameter "
                    f"{trainable[0]!r} requires grad: freeze it (requires_grad_(False)) first."
                )

        self.blocks: Blocks = blocks
        self.balance: tuple[int, ...] = balance
        self.devices: tuple[torch.device, ...] = tuple(dev.as_device(d) for d in devices)
        self.chunks = chunks
        self.num_frozen = num_frozen
        self.stats = PipelineStats()
        self._say = say if say is not None else WarnOnce()
        #: Per stage: the first block's index in the stack.
        self._edges = boundaries(balance)
        self._streams: list[Stream] | None = None  # taken from the pool on the first pipelined call
        # Paths of the last block's output tensors, and of those broadcast over the batch, as seen
        # on the last micro-batch of two or more samples (see _join); None until then.
        self._leaves: frozenset[tree.Path] | None = None
        self._broadcast: frozenset[tree.Path] = frozenset()
        self._largest_batch = 0  # the largest batch seen: a smaller one is an epoch's last

    def __repr__(self) -> str:
        devices = ", ".join(str(d) for d in self.devices)
        return (
            f"Pipeline(balance={self.balance}, devices=[{devices}], chunks={self.chunks}, "
            f"num_frozen={self.num_frozen})"
        )

    def place(self) -> Pipeline:
        """Move each block to its stage's device (in place, as ``Module.to`` does); returns self."""
        for j, device in enumerate(self.devices):
            for block in self.blocks[self._edges[j] : self._edges[j + 1]]:
                dev.place_module(block, device)
        return self

    def __call__(self, hidden: Tensor, *args: Any, **kwargs: Any) -> Any:
        """The pass in which every block gets ``(hidden, *args, **kwargs)``'s extra arguments."""
        return self.run(StackCall.uniform(hidden, args, kwargs, len(self.blocks)))

    def run(self, call: StackCall) -> Any:
        """Run one pass (every block with its own arguments); returns the last block's output."""
        if len(call.calls) != len(self.blocks):
            raise ValueError(f"The pass has arguments for {len(call.calls)} blocks; this pipeline runs {len(self.blocks)}.")
        batch_size(call.hidden)  # a clear TypeError for a hidden state that is not a batched tensor
        refuse_placeholder(call.hidden, "The pipeline's first block")
        # A hook (Hugging Face's enable_input_require_grads, under gradient checkpointing or PEFT) may
        # mark the input as requiring grad with no parameter behind it: the frozen blocks then need no
        # graph, and the first active block gets its input marked again, as the hook meant.
        mark = torch.is_grad_enabled() and needs_no_gradient(call.hidden)
        if mark:
            call = dataclasses.replace(call, hidden=call.hidden.detach())
        self.stats.passes += 1
        # Hooks observe the blocks (stack/observers.py): each block runs once, on the whole batch.
        chunks = 1 if call.observed else self.chunks
        if len(self.balance) == 1 and chunks == 1:
            self.stats.micro_batches += 1
            return self._run_plain(call, mark)
        if chunks > 1:
            self._check_chunks_fit(call.hidden.shape[0])
        split = scatter(call.hidden, call.calls, chunks)
        if split.stateful and len(split.sizes) > 1:
            self.stats.stateful_fallbacks += 1
            self._say(
                "stateful",
                f"The blocks update a mutable object ({split.stateful[0]}, e.g. a key-value cache with use_cache=True): "
                f"running these passes as one micro-batch instead of {self.chunks}, so that it is updated once per "
                "block as in the model's own loop. Results are exact; only the micro-batch overlap is lost. "
                "Pass use_cache=False while training to keep the micro-batches."
            )
            split = scatter(call.hidden, call.calls, 1)
        if self._leaves is None and len(split.sizes) > 1 and max(split.sizes) == 1:
            # Micro-batches of one sample (a batch no larger than chunks), and no output seen on
            # more: a (1, ...) output could be per-sample or broadcast. One micro-batch is exact,
            # and teaches which (see _join).
            split = scatter(call.hidden, call.calls, 1)
        self.stats.micro_batches += len(split.sizes)
        return self._run_pipelined(split, call, mark)

    def _check_chunks_fit(self, batch: int) -> None:
        """Warn once when the loader's batches are smaller than ``chunks`` (an epoch's smaller last batch is expected)."""
        largest, self._largest_batch = self._largest_batch, max(self._largest_batch, batch)
        if batch < self.chunks and batch >= largest:
            self._say(
                "chunks-capped",
                f"chunks={self.chunks} but the batches have {batch} samples: they run as at most {batch} micro-batches "
                f"(one sample each), not {self.chunks}. Use chunks <= the batch size (or chunks='auto'), or a larger batch.",
            )

    # -- one stage, one micro-batch: the plain loop ------------------------------------------

    def _run_plain(self, call: StackCall, mark: bool) -> Any:
        device = self.devices[0]
        hidden, calls = call.hidden, call.calls
        if any(t.device != device for t in (hidden, *tree.tensors(calls))):
            move = lambda v: v.to(device)  # noqa: E731
            hidden, calls = move(hidden), tree.map_tensors(move, calls)
        return self._run_stage(0, hidden, calls, call.observe, mark)

    # -- the general case ----------------------------------------------------------------------

    def _run_pipelined(self, split: Scatter, call: StackCall, mark: bool) -> Any:
        stages, chunks, devices = len(self.balance), len(split.sizes), self.devices
        streams = self._stage_streams()
        for stream, device in zip(streams, devices):
            # A stage must see what the caller queued before this call on its device:
            # the optimizer's parameter updates, the inputs.
            dev.wait(stream, dev.current_stream(device))
        # A tensor passed whole (the same object in every micro-batch) goes to each stage once.
        hopped: list[dict[int, Tensor]] = [{} for _ in range(stages)]

        versions = [(name, t, t._version) for name, t in split.whole if chunks > 1 and not t.is_inference()]
        leaves = _leaf_versions(split) if torch.is_grad_enabled() else []
        # hiddens[i]: micro-batch i's hidden state, and the stream it was produced on.
        hiddens: list[tuple[Tensor, Stream] | None] = [(h, dev.current_stream(h.device)) for h in split.hidden]
        outputs: list[Any] = [None] * chunks
        for schedule in clock_cycles(chunks, stages):
            for i, j in schedule:
                x, src = hiddens[i]  # type: ignore[misc]
                # Hold no reference past its use: under no_grad that frees activations early.
                hiddens[i] = None
                x = dev.hop(x, src, streams[j], devices[j])
                first, stop = self._edges[j], self._edges[j + 1]
                stage_calls = tree.map_tensors(lambda t: _hop_in(t, streams[j], devices[j]), split.calls[i][first:stop], memo=hopped[j])
                with dev.use_stream(streams[j]):
                    try:
                        out = self._run_stage(j, x, stage_calls, call.observe if i == 0 else None, mark)
                    except InterceptionError:
                        raise
                    except Exception as err:
                        _explain_failure(err, split, i, j)
                        raise
                if j == stages - 1:
                    outputs[i] = out
                else:
                    hiddens[i] = (hidden_of(out), streams[j])
        for name, tensor, version in versions:
            if tensor._version != version:
                raise InterceptionError(
                    f"A block modified {name} in place, a tensor passed whole to each of {chunks} micro-batches: it was "
                    f"modified {chunks} times where the model's own loop modifies it once. Use chunks=1, or pass a copy."
                )
        for name, pieces, before in leaves:
            if [p._version for p in pieces] != before:
                # The plain loop's in-place op raises this itself; a stage's input here is a copy
                # (several micro-batches) or a detached alias (a stream hand-over), which let it through.
                raise RuntimeError(
                    f"a leaf Variable that requires grad is being used in an in-place operation: a block modified "
                    f"{name} in place, which the model's own loop refuses as well. Pass a non-leaf (e.g. x * 1) or "
                    "use an out-of-place op."
                )

        last, last_stream = devices[-1], streams[-1]
        caller_stream = dev.current_stream(last)
        if last_stream is not None or caller_stream is not None:
            # Back to the caller's stream before joining: it is where the result is used.
            outputs = [tree.map_tensors(lambda t: dev.hop(t, last_stream, caller_stream, last), o) for o in outputs]
        return self._join(outputs, split.sizes)

    def _join(self, outputs: list[Any], sizes: tuple[int, ...]) -> Any:
        """The micro-batches' outputs joined as the plain loop would have returned them.

        A tensor whose first dimension is its micro-batch's size is joined, except where every
        micro-batch is one sample: a broadcastable ``(1, ...)`` tensor looks per-sample then. An
        output on two or more samples tells them apart (a ``(1, ...)`` tensor there is not
        per-sample), so each such pass records where the broadcast tensors are.
        """
        largest = max(range(len(sizes)), key=sizes.__getitem__)
        if sizes[largest] >= 2:
            seen = tree.tensor_paths(outputs[largest])
            self._leaves = frozenset(seen)
            self._broadcast = frozenset(p for p, t in seen.items() if t.dim() > 0 and t.shape[0] == 1)
        elif len(sizes) > 1:
            seen = tree.tensor_paths(outputs[0])
            unknown = [p for p, t in seen.items() if t.dim() > 0 and t.shape[0] == 1 and p not in (self._leaves or ())]
            if unknown:
                self._say(
                    ("unseen-output", unknown[0]),
                    f"On micro-batches of one sample the last block returned a tensor at output path {tree.path_str(unknown[0])} that it "
                    "did not return on larger ones: it is joined as per-sample. If it is broadcast over the batch "
                    "(first dimension 1), the plain loop returns it unjoined."
                )
        return gather(outputs, sizes, self._broadcast)

    def _stage_streams(self) -> list[Stream]:
        if self._streams is None:
            # From the per-process pool: the pipelines chunks="auto" times and every re-plan reuse them.
            self._streams = dev.stage_streams(self.devices)
        return self._streams

    def _run_stage(
        self, j: int, hidden: Tensor, calls: Sequence[BlockArgs], observe: Callable[[int, Any], None] | None,
        mark: bool = False,
    ) -> Any:
        """Stage ``j``'s blocks on one micro-batch, each with its own arguments; returns the last block's output.

        ``mark``: the pass's input required grad with no parameter behind it (see :meth:`run`): the
        first active block's input is marked as requiring grad again.
        """
        first, stop = self._edges[j], self._edges[j + 1]
        frozen_stop = min(stop, max(first, self.num_frozen))
        output: Any = hidden
        if frozen_stop > first:
            # No graph for frozen blocks unless a gradient must flow through them to something
            # trainable: their input, or a tensor among their arguments (nested ones too).
            skip_graph = torch.is_grad_enabled() and not _needs_grad(hidden, calls[: frozen_stop - first])
            with torch.no_grad() if skip_graph else nullcontext():
                for index in range(first, frozen_stop):
                    args, kwargs = calls[index - first]
                    output = call_block(self.blocks[index], hidden, *args, **kwargs)
                    if observe is not None:
                        observe(index, output)
                    hidden = hidden_of(output)
        if mark and first <= self.num_frozen < stop:
            hidden = as_marked_input(hidden)
        for index in range(frozen_stop, stop):
            args, kwargs = calls[index - first]
            output = call_block(self.blocks[index], hidden, *args, **kwargs)
            if observe is not None:
                observe(index, output)
            hidden = hidden_of(output)
        return output


def _explain_failure(err: Exception, split: Scatter, i: int, j: int) -> None:
    """A block failed on a micro-batch: if a tensor passed whole may hold the batch folded into
    another axis (``[batch * k, ...]``), raise an error that names it and the way out."""
    if len(split.sizes) < 2:
        return
    batch = sum(split.sizes)
    suspects = [
        f"{name} {tuple(t.shape)}" for name, t in split.whole if t.dim() > 0 and t.shape[0] > batch and t.shape[0] % batch == 0
    ]
    if suspects:
        raise InterceptionError(
            f"Stage {j} failed on micro-batch {i} ({split.sizes[i]} of {batch} samples): {type(err).__name__}: {err}. "
            f"These arguments were passed whole to every micro-batch although their first dimension is a multiple of "
            f"the batch: {', '.join(suspects)}. If one holds the batch folded into another axis, it cannot be "
            "micro-batched: use chunks=1."
        ) from err


def _leaf_versions(split: Scatter) -> list[tuple[str, tuple[Tensor, ...], list[int]]]:
    """``(name, pieces, their versions)`` of every input that is a leaf requiring grad (cut or whole)."""
    inputs = [*split.cut, *((name, t, (t,)) for name, t in split.whole)]
    return [
        (name, pieces, [p._version for p in pieces])
        for name, tensor, pieces in inputs
        if tensor.is_leaf and tensor.requires_grad and not tensor.is_inference()
    ]


def _hop_in(value: Tensor, stream: Stream, device: torch.device) -> Tensor:
    """An argument from the caller (on its current stream) made ready for a stage."""
    return dev.hop(value, dev.current_stream(value.device), stream, device)


def _needs_grad(hidden: Tensor, calls: Any) -> bool:
    return hidden.requires_grad or any(t.requires_grad for t in tree.tensors(calls))
