"""AutoCache's boundary advance across processes, held against SIGTERM like the transition.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.callbacks import Callback

from lightning_pipetransformer.cache.autocache import AutoCache


class BoundarySync(Callback):
    """Several processes: after each AutoDP transition, every rank runs :meth:`AutoCache.sync_boundary`.

    Placed after the strategy's transition callback (so replicas added by it already hold their
    weights), it runs at every train-epoch start on every rank, shadow ranks included, and
    syncs whenever the agreed plan's boundary differs from the last one synced: every rank
    sees the same plan, so every rank calls the same collectives in the same order.
    """

    def __init__(self, cache: AutoCache, boundary: Callable[[], int | None], group: Callable[[], Any], node: int = 0) -> None:
        self.cache = cache
        self._boundary = boundary
        self._group = group
        self._node = node
        self._synced: int | None = None

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        boundary = self._boundary()
        group = self._group()
        if boundary is None or group is None or boundary == self._synced:
            return
        self._synced = boundary
        from lightning_pipetransformer.dp.faults import signals_held

        with signals_held():  # every rank is in the advance's collectives: a SIGTERM waits for their end
            self.cache.sync_boundary(group, self._node)
