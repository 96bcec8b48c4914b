"""What the strategy installs in place of the block stack for one plan.

The model's own loop over its block stack calls one runner (see
:func:`~lightning_pipetransformer.stack.interception.install_pipeline`). For a plan that runner is

- nothing at all: one stage and one micro-batch, the model's loop runs as written;
- a :class:`~lightning_pipetransformer.pipe.pipeline.Pipeline` over the stages' devices;
- a :class:`~lightning_pipetransformer.pipe.chunks.ChunkTuner` (``chunks="auto"``: measures M
  on the first training batch of a new pipe length, then behaves like that pipeline);
- AutoCache's :class:`~lightning_pipetransformer.cache.cached_stack.CachedStack`: the frozen prefix from the
  cache, the active blocks as a pipeline of their own.

Each pipeline's output is handed back to the first stage's device (:class:`ReturnTo`), where
everything outside the stack (embeddings, head, loss) lives, so ``training_step`` needs no change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_pipetransformer import devices as dev
from lightning_pipetransformer import tree
from lightning_pipetransformer.cache.autocache import AutoCache
from lightning_pipetransformer.cache.cached_stack import CachedStack
from lightning_pipetransformer.devices import place_module
from lightning_pipetransformer.pipe.chunks import ChunkTuner
from lightning_pipetransformer.pipe.partition import active_balance
from lightning_pipetransformer.pipe.pipeline import Pipeline
from lightning_pipetransformer.pipe.planner import Plan
from lightning_pipetransformer.stack.stack_call import StackCall

__all__ = ["ReturnTo", "cached_runner", "pipeline_runner"]


class ReturnTo:
    """Runs a pass through a pipeline and hands its output back to the first stage's device."""

    def __init__(self, pipeline: Any, device: torch.device) -> None:
        self.pipeline = pipeline
        self.device = device
        # install_pipeline checks these against the container's children.
        self.blocks = pipeline.blocks

    def run(self, call: StackCall) -> Any:
        return to_device(self.pipeline.run(call), self.device)


def pipeline_runner(
    blocks: Sequence[nn.Module],
    plan: Plan,
    devices: Sequence[torch.device],
    tune_chunks: Callable[[int, int], None] | None = None,
) -> ReturnTo | None:
    """The runner for ``plan`` without a cache; ``None`` when the model's own loop is the plan.

    The blocks are moved to their stages' devices now. ``tune_chunks(pipe_len, chunks)``: measure
    M on the first training batch (``chunks="auto"``) and report it there.
    """
    pipeline = Pipeline(blocks, plan.partition, devices, chunks=plan.chunks, num_frozen=plan.num_frozen).place()
    if tune_chunks is not None:
        tuner = ChunkTuner(blocks, plan.partition, devices, plan.num_frozen, tune_chunks)
        return ReturnTo(tuner, devices[0])
    if plan.pipe_len > 1 or plan.chunks > 1:
        return ReturnTo(pipeline, devices[0])
    return None


def cached_runner(
    cache: AutoCache,
    blocks: Sequence[nn.Module],
    plan: Plan,
    devices: Sequence[torch.device],
    chunks_for: Callable[[int], int],
) -> CachedStack:
    """AutoCache's runner for ``plan``: misses run the frozen prefix on the first stage's device,
    the active blocks a pipeline over the stages that hold them, of ``chunks_for(its length)`` micro-batches."""
    for block in blocks[: plan.num_frozen]:
        place_module(block, devices[0])  # the misses run the frozen prefix where the hidden state is
    balance, stages = active_balance(plan.partition, plan.num_frozen)
    run_active: Callable[[StackCall], Any]
    if balance:
        chunks = chunks_for(len(balance))
        active = Pipeline(blocks[plan.num_frozen :], balance, [devices[i] for i in stages], chunks=chunks).place()
        run_active = ReturnTo(active, devices[0]).run
    else:  # every block frozen (min_active=0): the head reads the boundary directly
        run_active = _boundary_only
    return CachedStack(cache, blocks, plan.num_frozen, run_active)


def _boundary_only(call: StackCall) -> Any:
    return call.as_output(call.hidden)


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it on ``device``; containers keep their types
    (:mod:`~lightning_pipetransformer.tree`: named tuples, dicts, ``OrderedDict``, transformers'
    ``ModelOutput``), other values stay as they are.

    Containers matter: a last block (or a pipeline's join) that returns a dict or a ``ModelOutput``
    would otherwise leave its tensors on the last stage's device and the head would fail with
    "tensors on different devices".
    """

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if dev.device_of(tensor) == device:
            return tensor
        moved = tensor.to(device)
        dev.tag_as(moved, device)
        return moved

    return tree.map_tensors(move, value)
