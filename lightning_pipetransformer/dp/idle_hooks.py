"""What the user's code sees on an idle (shadow) rank: batch hooks skipped, rank 0's metrics.

An idle rank stays in Lightning's loop in lock-step with the replicas (see
:mod:`~lightning_pipetransformer.dp`) but has no data and no model work. Two things would
otherwise go wrong in code the user did not write for that:

* **The LightningModule's batch and epoch-end hooks** would see placeholder batches, gradients
  that are all ``None`` and torchmetrics objects that were never updated (whose ``compute()``
  syncs over WORLD and hangs the replicas). On an idle rank they do not run: the module's
  instance gets wrappers (:func:`skip_module_hooks_when_idle`) that call the real hook only while
  the rank is active. Callbacks still run everywhere: their collectives (ModelCheckpoint's
  broadcasts, EarlyStopping's vote) must be issued by every rank.
* **Monitoring callbacks** (EarlyStopping, ModelCheckpoint with ``monitor``, ReduceLROnPlateau)
  would find no metric, raise, or take a decision of their own. Global rank 0 (always a replica)
  sends its ``callback_metrics`` to every idle rank over the control group right before they
  are read: at validation end from :class:`ShareMetrics` (placed first among the callbacks),
  at train-epoch end from the wrapped ``on_train_epoch_end`` (Lightning runs the monitoring
  callbacks right after the module's hook), and after every training batch when a checkpoint
  monitors a metric every N steps.

Active ranks keep their own metrics, exactly as under DDP: a metric logged without
``sync_dist=True`` is rank-local there too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_pipetransformer import lightning_internals
from lightning_pipetransformer.dp import groups

__all__: list[str] = []

#: LightningModule hooks that see a batch, gradients or epoch-level model state; idle ranks skip them.
SKIPPED_WHEN_IDLE = (
    "on_before_batch_transfer",
    "on_after_batch_transfer",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_epoch_end",
    "on_validation_epoch_end",
    "on_test_epoch_end",
    "on_predict_epoch_end",
)

_WRAPPED = "_pipetransformer_idle_wrapped"


def skip_module_hooks_when_idle(
    module: pl.LightningModule, is_active: Callable[[], bool], after: Mapping[str, Callable[[], None]]
) -> None:
    """Wrap ``module``'s hooks (on the instance) so that they run only while ``is_active()``.

    ``after[name]`` runs on every rank after hook ``name`` (metric ordering and hand-over).
    Idempotent; :func:`restore_module_hooks` undoes it.
    """
    if getattr(module, _WRAPPED, False):
        return
    for name in SKIPPED_WHEN_IDLE:
        original = getattr(module, name)
        passes_batch = name in ("on_before_batch_transfer", "on_after_batch_transfer")
        wrapper = _when_active(original, is_active, passes_batch)
        if name in after:
            wrapper = _then(wrapper, after[name])
        object.__setattr__(module, name, wrapper)
    object.__setattr__(module, _WRAPPED, True)


def restore_module_hooks(module: pl.LightningModule) -> None:
    """Remove the wrappers (at teardown): the module is the user's again."""
    if not getattr(module, _WRAPPED, False):
        return
    for name in SKIPPED_WHEN_IDLE:
        module.__dict__.pop(name, None)
    module.__dict__.pop(_WRAPPED, None)


def _when_active(hook: Callable[..., Any], is_active: Callable[[], bool], passes_batch: bool) -> Callable[..., Any]:
    @functools.wraps(hook)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if is_active():
            return hook(*args, **kwargs)
        # The transfer hooks must hand the (placeholder) batch on; the others return nothing.
        return (args[0] if args else kwargs["batch"]) if passes_batch else None

    return wrapper


def _then(hook: Callable[..., Any], after: Callable[[], None]) -> Callable[..., Any]:
    @functools.wraps(hook)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = hook(*args, **kwargs)
        after()
        return result

    return wrapper


def restart_metric_order(trainer: pl.Trainer) -> None:
    """Forget the fit loops' logged keys (not their values this epoch), on every rank, when replicas join.

    Epoch metrics logged with ``sync_dist=True`` are reduced one by one, in the order of the
    loop's results dictionary: the order in which each key was first logged on that rank. A rank
    that was idle first logged only what callbacks log (callbacks run everywhere), so after it
    joins, its order would differ from rank 0's and the reductions would pair different metrics:
    silently wrong values, or a hang. Called on every rank at the epoch start where the active set
    changes, this makes all ranks rebuild the order from the same code path in the same epoch.
    Keys already logged in this epoch (by earlier ``on_train_epoch_start`` hooks, on every rank
    alike) keep their place.
    """
    lightning_internals.forget_logged_key_order(trainer)


def share_callback_metrics(trainer: pl.Trainer, is_active: bool, control_group: Any) -> None:
    """Global rank 0's ``callback_metrics`` to the idle ranks (every rank calls this together).

    Active ranks read ``trainer.callback_metrics`` first, all at the same point: that computes
    (and syncs over the active group, for ``sync_dist=True``) any epoch metric not computed yet,
    in the same order on every replica, so no rank waits on a sync the others skip.
    """
    metrics = trainer.callback_metrics if is_active else None
    message = None
    if trainer.global_rank == 0:
        assert metrics is not None
        message = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
    message = groups.broadcast_object(message, src=0, group=control_group)
    if not is_active:
        lightning_internals.set_callback_metrics(trainer, message)  # what monitoring callbacks read here


def monitors_every_n_steps(trainer: pl.Trainer) -> bool:
    """Whether a ModelCheckpoint reads a monitored metric after training batches."""
    return any(
        isinstance(c, ModelCheckpoint) and c.monitor is not None and (c._every_n_train_steps or c._train_time_interval)
        for c in trainer.callbacks
    )


class ShareMetrics(Callback):
    """Hands rank 0's metrics to the idle ranks before any monitoring callback reads them.

    Placed first in ``trainer.callbacks`` (after Lightning ordered them), so its
    ``on_validation_end`` runs before ModelCheckpoint's and EarlyStopping's.
    """

    def __init__(self, is_active: Callable[[], bool], control_group: Any, every_train_batch: bool) -> None:
        self.is_active = is_active
        self.control_group = control_group
        self.every_train_batch = every_train_batch

    def _share(self, trainer: pl.Trainer) -> None:
        share_callback_metrics(trainer, self.is_active(), self.control_group)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._share(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.every_train_batch:
            self._share(trainer)


def prepare_idle_ranks(trainer: pl.Trainer, module: pl.LightningModule, is_active: Callable[[], bool], control_group: Any) -> None:
    """Idle ranks skip the module's batch and epoch-end hooks and get rank 0's metrics.

    :class:`ShareMetrics` goes first of all callbacks (its ``on_validation_end`` runs before the
    monitoring ones read metrics); an earlier fit's copy is replaced.
    """
    skip_module_hooks_when_idle(
        module,
        is_active,
        after={"on_train_epoch_end": lambda: share_callback_metrics(trainer, is_active(), control_group)},
    )
    trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, ShareMetrics)]
    trainer.callbacks.insert(0, ShareMetrics(is_active, control_group, monitors_every_n_steps(trainer)))
