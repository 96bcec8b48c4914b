"""What an activation store counts: lookups, hits by tier, refusals, disk failures, entries and bytes held.

One :class:`CacheStats` per store, shared by its memory tier (:mod:`~lightning_pipetransformer.cache.store`)
and its disk tier (:mod:`~lightning_pipetransformer.cache.disk_tier`), each counting what happens on
its side; :meth:`ActivationStore.stats <lightning_pipetransformer.cache.store.ActivationStore.stats>`
hands out a snapshot.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["CacheStats"]


@dataclass
class CacheStats:
    """Counters since construction, all kept in memory: reading them walks no folder (the progress bar reads
    them every step).

    ``files_on_disk``/``bytes_on_disk``: the entry files of this prefix's directory that this process
    knows of: those in it when the store opened it, then each file it wrote, read, found written by
    another process, or found gone. Alone in the directory, that is all of them; with several
    processes of a node sharing it, another's files count once this process meets them.
    """

    hits: int = 0
    misses: int = 0
    memory_hits: int = 0
    disk_hits: int = 0
    rejected: int = 0
    #: Files whose bytes did not match their checksum: a miss, recomputed and rewritten.
    corrupt: int = 0
    stored: int = 0
    #: Samples whose activation held NaN or inf: never stored, recomputed every time.
    nonfinite: int = 0
    #: Entries that should have gone to disk but did not (disk full, write refused): recomputed when needed.
    unwritten: int = 0
    #: Times this store's directory had been removed from outside and was made again.
    recreated: int = 0
    #: Times the disk failed this store (full, read-only, permission, I/O error): disk writes stopped.
    disk_failures: int = 0
    entries_in_memory: int = 0
    bytes_in_memory: int = 0
    files_on_disk: int = 0
    bytes_on_disk: int = 0

    @property
    def hit_rate(self) -> float:
        looked = self.hits + self.misses
        return self.hits / looked if looked else 0.0

    def as_metrics(self, prefix: str = "autocache/") -> dict[str, float]:
        """Flat float metrics for ``logger.log_metrics``."""
        out = {f"{prefix}{k}": float(v) for k, v in asdict(self).items()}
        out[f"{prefix}hit_rate"] = self.hit_rate
        return out
