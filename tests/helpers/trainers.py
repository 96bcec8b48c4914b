"""The one-device CPU Trainer the integration tests fit with."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback


def cpu_trainer(strategy: Any = "auto", callbacks: Iterable[Callback] = (), *, max_epochs: int, **kwargs: Any) -> pl.Trainer:
    """A Trainer on one CPU device with nothing beside the fit that could hide or add work: no progress
    bar, no model summary, and (unless a test passes its own) no logger, no checkpoints, no sanity validation.

    ``max_epochs`` has no default: how long a test trains is part of what its expected numbers mean.
    """
    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_checkpointing", False)
    kwargs.setdefault("num_sanity_val_steps", 0)
    return pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=max_epochs, callbacks=list(callbacks),
        enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip
