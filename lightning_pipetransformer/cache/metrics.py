"""What the cache reports: batch counters, the hit rate of a period, and the metrics the logger gets.

The store counts its own lookups (:class:`~lightning_pipetransformer.cache.store_stats.CacheStats`); this
module counts whole batches (served in full, looked up, run without the cache) and turns both into
the flat ``autocache/...`` metrics :mod:`lightning_pipetransformer.report` sorts for the loggers.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_pipetransformer.cache.store import ActivationStore

__all__ = ["BatchCounters", "PeriodHits", "cache_metrics"]


@dataclass
class BatchCounters:
    """Batches looked up in the current boundary's store and those the cache answered in full (this
    store's entries or an earlier boundary's, advanced on read), counted per boundary like the store's
    hits; the batches that ran without the cache and the forwards that got a placeholder instead of
    the embeddings' output, since the fit began."""

    looked_up: int = 0
    served: int = 0
    skipped: int = 0
    embeddings_skipped: int = 0
    #: Times the frozen prefix was found changed since the current store's entries were computed (cache/watch.py).
    prefix_changes: int = 0

    def count_lookup(self, hits: int, batch: int) -> None:
        self.looked_up += 1
        self.served += int(hits == batch)

    def new_boundary(self) -> None:
        self.looked_up = self.served = 0


class PeriodHits:
    """The share of lookups that hit in a period (an epoch), from the store's counters at each call."""

    def __init__(self) -> None:
        # The store, its (hits, misses) and the periods counted at the last call.
        self._last: tuple[ActivationStore, int, int, int] | None = None

    def rate(self, store: ActivationStore | None) -> tuple[float, int] | None:
        """``(rate, lookups)`` since the last call, when it says something: ``None`` unless the same
        store served the whole period and one period before it (when its entries were stored)."""
        if store is None:
            self._last = None
            return None
        stats = store.stats()
        before = self._last
        periods = before[3] + 1 if before is not None and before[0] is store else 0
        self._last = (store, stats.hits, stats.misses, periods)
        if before is None or periods < 2:
            return None
        lookups = stats.hits + stats.misses - before[1] - before[2]
        if lookups == 0:
            return None
        return (stats.hits - before[1]) / lookups, lookups


def cache_metrics(
    store: ActivationStore | None, counters: BatchCounters, *, enabled: bool, advanced: int, can_engage: bool,
) -> dict[str, float]:
    """Hits, misses and bytes of the current store and the batch counters, for the logger."""
    if store is None:
        return {
            "autocache/enabled": 0.0, "autocache/batches_bypassed": float(counters.skipped), "autocache/can_engage": float(can_engage),
            "autocache/prefix_changes": float(counters.prefix_changes),
        }
    metrics = store.stats().as_metrics("autocache/")
    metrics["autocache/can_engage"] = float(can_engage)
    metrics["autocache/enabled"] = float(enabled)
    metrics["autocache/boundary"] = float(store.boundary)
    metrics["autocache/advanced"] = float(advanced)
    metrics["autocache/embeddings_skipped"] = float(counters.embeddings_skipped)
    metrics["autocache/batches_served"] = float(counters.served)
    metrics["autocache/batches_bypassed"] = float(counters.skipped)
    metrics["autocache/prefix_changes"] = float(counters.prefix_changes)
    looked = counters.looked_up
    metrics["autocache/served_fraction"] = counters.served / looked if looked else 0.0
    return metrics
