"""When the transition runs: a callback at every train-epoch start, and a clock for its phases.

The transition itself is :meth:`lightning_pipetransformer.dp.replicas.Elastic.transition`; this module holds what
triggers and times it.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_pipetransformer.dp.faults import signals_held


class PhaseClock:
    """Seconds spent in each named phase, in order (a transition's breakdown)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self._last
        self._last = now


class TransitionCallback(Callback):
    """Runs the strategy's transition at every train-epoch start, on every rank, right after AutoFreeze.

    AutoFreeze only tells the strategy on ranks where the frozen count changed, and a shadow
    rank's rule may see nothing (no gradients); the transition must run everywhere, with rank 0's
    decision. Placed right after AutoFreeze so that later callbacks (the progress bar) already
    see the new loader length.
    """

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with signals_held():
            self.strategy._transition(trainer)
