"""The engine: the one owner of the plan in force, and of what runs the block stack under it.

Why one owner. A plan used to be made by the planner, broadcast by AutoDP, localized, given its
measured chunks in two other places and read by the cache through a lambda; the order of those
writes was the order of callbacks in ``trainer.callbacks``. Here the :class:`Engine` alone writes
the plan: :meth:`Engine.propose` asks the planner, :meth:`Engine.apply` installs the runner and
makes a plan the one in force, :meth:`Engine.chunks_measured` records ``chunks="auto"``'s
measurement. The strategy's ``plan``, the sampler, ``is_active`` and checkpoints read
:attr:`Engine.plan`.

It takes data (the stack, the plan, the devices, the cache) and never sees the strategy, the
trainer or the process groups.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_pipetransformer.cache.autocache import AutoCache
from lightning_pipetransformer.config import PipeTransformerConfig
from lightning_pipetransformer.pipe.costs import parameter_costs, parameter_count
from lightning_pipetransformer.pipe.planner import AutoPipe
from lightning_pipetransformer.plan import Plan
from lightning_pipetransformer.runners import cached_runner, pipeline_runner
from lightning_pipetransformer.stack.discovery import BlockStack
from lightning_pipetransformer.stack.interception import install_pipeline

__all__ = ["Engine", "make_planner"]


def make_planner(
    stack: BlockStack,
    config: PipeTransformerConfig,
    *,
    num_processes: int,
    num_nodes: int,
    root_device: torch.device,
    parallel_devices: Sequence[torch.device],
) -> AutoPipe:
    """AutoPipe over ``stack``'s blocks for this process layout (refuses a pipe longer than the stack).

    With one process the K stages are virtual (all on its device), so it plans as if the node had
    K devices; with several processes each one is a pipeline stage of its own.
    """
    costs = parameter_costs(stack.blocks)
    if config.pipe_len > len(costs):
        raise ValueError(
            f"pipe_len={config.pipe_len} is more stages than the {len(costs)} blocks of '{stack.path}': "
            f"use pipe_len <= {len(costs)}."
        )
    per_node = config.pipe_len if num_processes == 1 else num_processes
    return AutoPipe(
        costs,
        devices_per_node=per_node,
        num_nodes=num_nodes,
        pipe_len=config.pipe_len,
        frozen_cost=config.frozen_cost,
        # "auto" is measured on the first real batch of each K (see ChunkTuner); plan with 1.
        chunks=1 if config.chunks == "auto" else config.chunks,
        pre_cost=float(sum(parameter_count(m) for _, m in stack.pre)),
        post_cost=float(sum(parameter_count(m) for _, m in stack.post)),
        node_devices=[str(root_device)] * per_node if num_processes == 1 else [str(d) for d in parallel_devices],
    )


class Engine:
    """The stack, the planner, the plan in force and ``chunks="auto"``'s measurements.

    Args:
        stack: the block stack the plans are over.
        planner: AutoPipe for this process layout (:func:`make_planner`).
        chunks: the strategy's ``chunks`` (an int, or ``"auto"``: measured once per pipe length).
        cache: AutoCache, or None; ``include_pre``: the cache keys on the embeddings' inputs.
        announce: where news goes (the strategy passes rank-zero info).
    """

    def __init__(
        self,
        stack: BlockStack,
        planner: AutoPipe,
        chunks: int | str,
        cache: AutoCache | None = None,
        include_pre: bool = True,
        announce: Callable[[str], None] | None = None,
    ) -> None:
        self.stack = stack
        self.planner = planner
        self.chunks = chunks
        self.cache = cache
        self.include_pre = include_pre
        self.announce = announce or (lambda message: None)
        #: chunks="auto": the measured M per pipe length.
        self.auto_chunks: dict[int, int] = {}
        self._plan: Plan | None = None

    @property
    def plan(self) -> Plan | None:
        """The plan in force (None before the first :meth:`apply`)."""
        return self._plan

    def propose(self, num_frozen: int) -> Plan:
        """The planner's plan for ``num_frozen`` frozen blocks (not yet in force)."""
        return self.planner.plan(num_frozen)

    def most_replicas(self, most_frozen: int) -> int:
        """The replicas the planner reaches at ``most_frozen`` frozen blocks (the planner itself untouched)."""
        return copy.deepcopy(self.planner).plan(most_frozen).num_replicas

    def apply(self, plan: Plan, *, active: bool, devices: Sequence[torch.device], defer_boundary: bool = False) -> Plan:
        """Make ``plan`` (already this process's view: :meth:`~.dp.replicas.Elastic.localize`) the one in force and
        route the stack through its runner; returns the plan in force (its chunks may be measured ones).

        ``active``: this process drives a replica (a shadow rank installs nothing). ``devices``: its
        stages' devices. ``defer_boundary``: several processes open a new cache boundary together
        later (the strategy's transition), one process opens it now and advances entries lazily.
        """
        tune = self.chunks == "auto" and plan.pipe_len not in self.auto_chunks
        if self.chunks == "auto" and not tune:
            plan = dataclasses.replace(plan, chunks=self.auto_chunks[plan.pipe_len])
        self._plan = plan
        if not active:
            install_pipeline(self.stack.container, None)  # a shadow rank runs no model work
            return plan
        if self.cache is None or not self._install_cached_runner(plan, devices, defer_boundary):
            runner = pipeline_runner(self.stack.blocks, plan, devices, self.chunks_measured if tune else None)
            install_pipeline(self.stack.container, runner)  # None: the model's loop runs as written
        return plan

    def _install_cached_runner(self, plan: Plan, devices: Sequence[torch.device], defer_boundary: bool) -> bool:
        """Install the AutoCache runner for ``plan``; False when nothing is cached at this boundary."""
        cache, stack = self.cache, self.stack
        assert cache is not None
        if not cache.serves(plan.num_frozen):
            if defer_boundary:
                # A new replica gets its weights after the plan is applied (the store's name is their
                # fingerprint): the store opens in the transition's boundary step, on every rank together.
                cache.defer_boundary(stack, plan.num_frozen, self.include_pre, devices[0])
            else:
                # One process: open the new store now; the previous entries advance as they are read.
                cache.move_boundary(stack, plan.num_frozen, self.include_pre, devices[0], shard=(0, 1), lazy=True)
        if not cache.serves(plan.num_frozen):
            return False

        def chunks_for(pipe_len: int) -> int:  # chunks="auto": the M measured for the active blocks' pipe length
            return plan.chunks if self.chunks != "auto" else self.auto_chunks.get(pipe_len, 1)

        install_pipeline(stack.container, cached_runner(cache, stack.blocks, plan, devices, chunks_for))
        return True

    def chunks_measured(self, pipe_len: int, chunks: int) -> None:
        """``chunks="auto"`` measured M for ``pipe_len`` (ChunkTuner, at the first training batch)."""
        self.auto_chunks[pipe_len] = chunks
        if self._plan is not None and self._plan.pipe_len == pipe_len:
            self._plan = dataclasses.replace(self._plan, chunks=chunks)
        self.announce(f"PipeTransformer: chunks='auto' measured M={chunks} for pipe length {pipe_len}.")

    def state_dict(self) -> dict[str, Any]:
        """For checkpoints: the measured chunks and the plan in force."""
        return {
            "auto_chunks": {str(k): m for k, m in self.auto_chunks.items()},
            "plan": self._plan.to_dict() if self._plan is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The measured chunks of a checkpoint (the plan is made anew from the frozen count at set-up)."""
        self.auto_chunks = {int(k): int(m) for k, m in state.get("auto_chunks", {}).items()}
