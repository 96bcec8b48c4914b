"""What the strategy reads of the Trainer beyond what Lightning hands a Strategy, each in one place.

The AutoFreeze among the callbacks (the seam the strategy plans from), whether the module's batches reach
the device as the loader made them (index keys read the loader's host copy then), and metrics logged to
every logger, as Lightning logs its own. Plain reads of public Lightning API, kept out of the strategy so
that its class holds Lightning's hooks only.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_pipetransformer import lightning_internals
from lightning_pipetransformer.freeze.callback import AutoFreeze
from lightning_pipetransformer.freeze.seam import FreezeSource

__all__ = ["autofreeze_of", "log_metrics", "moves_batches_as_is"]

_BATCH_TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def autofreeze_of(trainer: pl.Trainer) -> FreezeSource | None:
    """The trainer's AutoFreeze callback, if it has one."""
    return next((c for c in trainer.callbacks if isinstance(c, AutoFreeze)), None)


def moves_batches_as_is(module: pl.LightningModule | None) -> bool:
    """Whether the device batch's tensors are the loader's, only copied: no transfer hook of the module or
    its datamodule overridden (one could reorder the rows, or make new indices, after the loader's)."""
    if module is None:
        return False
    trainer = lightning_internals.attached_trainer(module)
    owners = [module, trainer.datamodule if trainer is not None else None]
    return not any(is_overridden(hook, owner) for owner in owners if owner is not None for hook in _BATCH_TRANSFER_HOOKS)


def log_metrics(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """To every logger at the current step, as Lightning logs its own (the callers log on global rank 0 only)."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
