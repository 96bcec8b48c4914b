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
from lightning_pipetransformer.warn_once import WarnOnce

__all__ = [
    "CACHE_DIAGNOSTICS", "CACHE_METRICS", "CacheStatsByCall", "EngagementReport", "cache_metrics", "plan_metrics", "plan_text",
    "progress_values",
]  # fmt: skip


def plan_text(plan: Plan) -> str:
    return (
        f"PipeTransformer: {plan.num_frozen} frozen, pipe length {plan.pipe_len}, {plan.chunks} micro-batch(es), "
        f"blocks per stage {plan.partition}, {plan.num_replicas} replica(s)."
    )


def plan_metrics(plan: Plan) -> dict[str, float]:
    return {
        "pipetransformer/num_frozen": float(plan.num_frozen),
        "pipetransformer/pipe_len": float(plan.pipe_len),
        "pipetransformer/chunks": float(plan.chunks),
        "pipetransformer/replicas": float(plan.num_replicas),
    }


def progress_values(plan: Plan, config: Any, world_size: int, cache: Any) -> dict[str, int | float]:
    """What changes during a run, for the progress bar: counts as ints, the cache's hit rate as a rate.

    ``pt/frozen`` always; ``pt/pipe`` only when a pipeline or micro-batches were asked for
    (``pipe_len > 1`` or ``chunks != 1``), ``pt/replicas`` only with several processes, and
    ``pt/cache_hit_rate`` (hits / lookups at the current boundary, 0 to 1) only once a cache store is open.
    """
    shown: dict[str, int | float] = {"pt/frozen": int(plan.num_frozen)}
    if config.pipe_len > 1 or config.chunks != 1:
        shown["pt/pipe"] = int(plan.pipe_len)
    if world_size > 1:
        shown["pt/replicas"] = int(plan.num_replicas)
    if cache is not None and cache.store is not None:
        shown["pt/cache_hit_rate"] = round(cache.store.stats().hit_rate, 2)
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
        self._say = WarnOnce(lambda message, _: self.warn(message))  # the "never called" warning, once

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
        if steps > 0 and since.deferred == 0:
            self._say(
                "never-called",
                f"PipeTransformer: {steps} training steps ran but the model never called the last block of "
                f"'{self.stack.path}', so the pipeline / cache did not run at all. Check that this is the "
                "block stack the model's forward loops over (layers=, configure_block_stack)."
            )
        return since.as_metrics("pipetransformer/")


#: AutoCache's metrics logged under ``autocache/`` once per epoch: the few that say whether the cache pays.
CACHE_METRICS = {
    "hit_rate": "hits / lookups at the current boundary (training and validation; 0 to 1)",
    "period_hit_rate": "hits / lookups since the previous report (about one epoch), from the second report at a boundary on: the one to watch",
    "hits": "lookups the cache answered at the current boundary (its own entries, or an earlier boundary's advanced on read)",
    "misses": "lookups it could not answer (the first epoch at a boundary stores them)",
    "bytes_in_memory": "bytes of the current boundary's entries in host memory (this process)",
    "bytes_on_disk": "bytes of its files on disk that this process knows of (in the folder when the boundary opened it, "
    "then written, read or found by this process): counted, never scanned",
}

#: The rest of AutoCache's counters, logged under ``autocache_diagnostics/`` for diagnosis.
CACHE_DIAGNOSTICS = {
    "boundary": "frozen blocks whose output the current store holds",
    "enabled": "1 while the cache serves; 0 once cache='auto' measured it slower than the frozen blocks, or before a store opens",
    "memory_hits": "hits answered from host memory",
    "disk_hits": "hits answered from disk",
    "stored": "entries written at this boundary",
    "entries_in_memory": "entries held in host memory",
    "files_on_disk": "entry files on disk that this process knows of (as bytes_on_disk)",
    "advanced": "entries of an earlier boundary carried through the newly frozen blocks (at the move, or on read)",
    "embeddings_skipped": "forwards that skipped the embeddings because the cache answered the whole batch",
    "batches_served": "batches the cache answered in full at this boundary (every row a hit)",
    "served_fraction": "batches_served over the batches looked up at this boundary: 1.0 when every batch is served",
    "batches_bypassed": "batches since the fit began that ran without the cache, for a reason warned once",
    "prefix_changes": "times the frozen prefix was found changed since its entries were computed (unfrozen, edited, swapped, "
    "hooked, put in train mode): never served stale, warned once per kind, the boundary re-opened in training",
    "rejected": "entries found with another shape than the lookup's (a miss, recomputed)",
    "corrupt": "files whose checksum did not match (recomputed and rewritten)",
    "nonfinite": "samples whose activation held NaN or inf (never stored)",
    "unwritten": "entries that could not go to disk (disk full, write refused)",
    "can_engage": "0 when nothing in the run can freeze a block (no AutoFreeze, nothing frozen before fit): the cache can never serve",
    "disk_failures": "times the disk refused a boundary's directory or an entry (read-only, permission, I/O error): disk writes stopped at that boundary",
    "recreated": "times the store's directory was removed from outside and made again",
}


def cache_metrics(cache: Any) -> dict[str, float]:
    """AutoCache's counters for the loggers: :data:`CACHE_METRICS` under ``autocache/``, the rest
    (:data:`CACHE_DIAGNOSTICS`) under ``autocache_diagnostics/``. A counter named in neither is logged
    as a diagnostic too (never dropped)."""
    if cache is None:
        return {}
    metrics = {str(k).rsplit("/", 1)[-1]: v for k, v in cache.stats().items()}
    rate = cache.period_hit_rate()
    if rate is not None:
        metrics["period_hit_rate"] = rate
    return {(f"autocache/{k}" if k in CACHE_METRICS else f"autocache_diagnostics/{k}"): float(v) for k, v in metrics.items()}


#: AutoCache's counters that are sizes or states at a moment, not counts: kept as they are in :func:`stats_since`.
_GAUGES = ("enabled", "boundary", "can_engage", "entries_in_memory", "bytes_in_memory", "files_on_disk", "bytes_on_disk")


class CacheStatsByCall:
    """AutoCache's counters per trainer call of one strategy: ``"fit"`` as at the fit's end, and ``"validate"``, ``"test"``,
    ``"predict"`` as what each such call after it counted alone (sizes and the boundary as at its end); the last of each."""

    def __init__(self) -> None:
        self.by_call: dict[str, dict[str, float]] = {}
        self._at_start: dict[str, float] = {}

    def begin(self, now: dict[str, float], reused: bool) -> None:
        """A trainer call set up its cache: the fit's, reused (count from ``now``), or a new one (earlier calls forgotten)."""
        if reused:
            self._at_start = now
        else:
            self.by_call, self._at_start = {}, {}

    def end(self, call: str, now: dict[str, float]) -> None:
        """The call ``call`` (``"fit"``, ``"validate"`` ...) ends with the counters ``now``."""
        self.by_call[call] = stats_since(now, self._at_start) if call != "fit" else now


def stats_since(now: dict[str, float], start: dict[str, float]) -> dict[str, float]:
    """What AutoCache counted between two :meth:`~lightning_pipetransformer.cache.autocache.AutoCache.stats` readings
    (counts as differences, sizes and states as ``now``; the rates over the difference)."""
    out = {k: v if k.rsplit("/", 1)[-1] in _GAUGES else v - start.get(k, 0.0) for k, v in now.items()}
    hits, misses = out.get("autocache/hits", 0.0), out.get("autocache/misses", 0.0)
    if "autocache/hit_rate" in out:
        out["autocache/hit_rate"] = hits / (hits + misses) if hits + misses else 0.0
    out.pop("autocache/served_fraction", None)  # over the boundary's batches looked up, which are not in the readings
    return out
