"""What the strategy tells the loggers: the plan in force, and whether the pipeline and cache engaged.

Never silent: a runner installed but never called by the model's forward (``layers=`` names the
wrong container) warns once and shows in the metrics; the cache's counters go out every epoch.
Data in (the stack, the trainer's step, the cache's stats), metrics out; the strategy logs them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from lightning_pipetransformer.plan import Plan
from lightning_pipetransformer.stack.discovery import BlockStack
from lightning_pipetransformer.stack.interception import InterceptionStats, installed_pipeline, interception_stats

__all__ = ["EngagementReport", "cache_metrics", "plan_metrics", "plan_text", "progress_values"]


def plan_text(plan: Plan) -> str:
    return (
        f"PipeTransformer: {plan.num_frozen} frozen, pipe length {plan.pipe_len}, {plan.chunks} micro-batch(es), "
        f"partition {plan.partition}, {plan.num_replicas} replica(s)."
    )


def plan_metrics(plan: Plan) -> dict[str, float]:
    return {
        "pipetransformer/num_frozen": float(plan.num_frozen),
        "pipetransformer/pipe_len": float(plan.pipe_len),
        "pipetransformer/chunks": float(plan.chunks),
        "pipetransformer/replicas": float(plan.num_replicas),
    }


def progress_values(plan: Plan, config: Any, world_size: int, cache: Any) -> dict[str, float]:
    """What changes during a run, for the progress bar: frozen blocks, pipe length, replicas, hit rate."""
    shown: dict[str, float] = {"pt/frozen": float(plan.num_frozen)}
    if config.pipe_len > 1 or config.chunks != 1:
        shown["pt/pipe"] = float(plan.pipe_len)
    if world_size > 1:
        shown["pt/replicas"] = float(plan.num_replicas)
    if cache is not None and cache.store is not None:
        shown["pt/cache_hits"] = round(cache.store.stats().hit_rate, 3)
    return shown


class EngagementReport:
    """Once per epoch: the share of the model's passes over the stack that the installed runner ran.

    ``pipetransformer/engaged`` is that share, ``pipetransformer/microbatches`` the micro-batches
    per such pass, ``pipetransformer/observed`` the share of them that hooks observed (run as one
    micro-batch, without the cache: :mod:`~lightning_pipetransformer.stack.observers`). A runner that saw no pass in a period with training steps warns once.
    """

    def __init__(self, stack: BlockStack, warn: Callable[[str], None]) -> None:
        self.stack = stack
        self.warn = warn
        self._seen = InterceptionStats()
        self._step = 0
        self._installed = False
        self._warned = False

    def start(self, global_step: int) -> None:
        """At train start: count from here."""
        stats = interception_stats(self.stack.container)
        self._seen = copy.copy(stats) if stats is not None else InterceptionStats()
        self._step = global_step
        self._installed = installed_pipeline(self.stack.container) is not None

    def metrics(self, global_step: int, active: bool) -> dict[str, float]:
        """The counters since the last call (empty on a shadow rank, or when nothing was installed)."""
        stats = interception_stats(self.stack.container)
        if stats is None or not active:
            return {}
        since = stats.since(self._seen)
        self._seen = copy.copy(stats)
        steps, self._step = global_step - self._step, global_step
        # Plans change at epoch starts, before this report: what was installed after the last
        # report is what ran in the period reported now.
        ran, self._installed = self._installed, installed_pipeline(self.stack.container) is not None
        if not ((ran and steps > 0) or since.deferred):
            return {}
        if steps > 0 and since.deferred == 0 and not self._warned:
            self._warned = True
            self.warn(
                f"PipeTransformer: {steps} training steps ran but the model never called the last block of "
                f"'{self.stack.path}', so the pipeline / cache did not run at all. Check that this is the "
                "block stack the model's forward loops over (layers=, configure_block_stack)."
            )
        return since.as_metrics("pipetransformer/")


def cache_metrics(cache: Any) -> dict[str, float]:
    """AutoCache's counters and the hit rate of the period since the last call."""
    if cache is None:
        return {}
    metrics = dict(cache.stats())
    rate = cache.period_hit_rate()
    if rate is not None:
        metrics["autocache/period_hit_rate"] = rate
    return metrics
