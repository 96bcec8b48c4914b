"""Every private Lightning attribute or function the project touches, in one place.

Lightning is pinned (pyproject); an upgrade has this one module to check. Each function
says which private names it relies on and which test exercises it.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

# Private functions the strategy calls as Lightning's own DDPStrategy does (same arguments, same
# moment), so that a PipeTransformer run sets up, syncs and reports errors exactly like DDP.
from lightning.fabric.utilities.distributed import _distributed_is_initialized as distributed_is_initialized
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device as default_process_group_backend,
)
from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp_if_available
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher as SubprocessScriptLauncher
from lightning.pytorch.utilities.exceptions import _augment_message as augment_message

__all__ = [
    "attached_trainer",
    "augment_message",
    "default_process_group_backend",
    "distributed_is_initialized",
    "exclude_from_eval_mode_warning",
    "forget_logged_key_order",
    "init_dist_connection",
    "loader_with_batch_size",
    "mark_sigterm_received",
    "replace_sigterm_broadcast",
    "replace_sigterm_notifier",
    "rebuild_train_loader",
    "set_callback_metrics",
    "SubprocessScriptLauncher",
    "stop_child_process_observer",
    "sync_ddp_if_available",
]


def attached_trainer(module: pl.LightningModule | None) -> pl.Trainer | None:
    """The trainer ``module`` is attached to, or None where there is none.

    ``LightningModule.trainer`` raises without one, which teardown and the exception hooks must not
    (they also run after a failed set-up). Private: ``LightningModule._trainer``. Exercised by every
    teardown (tests/integration/test_strategy.py).
    """
    return module._trainer if module is not None else None


def rebuild_train_loader(trainer: pl.Trainer) -> None:
    """Rebuild the train loader (new sampler split, batch size, stand-ins) at an epoch start.

    Lightning 2.6 has no public way to re-shard between epochs, and ``FitLoop.setup_data`` has
    already run for this epoch before ``on_train_epoch_start``. These private attributes are
    pinned with Lightning (pyproject) and exercised by tests/integration/distributed/test_autodp.py:

    * ``fit_loop._combined_loader = None`` makes ``setup_data`` request and process the loader
      again (it calls ``barrier`` and ``has_len_all_ranks``: every rank must run this together);
    * the sampler epoch is re-applied as ``on_advance_start`` did before (shuffling by epoch);
    * the val loop's ``_combined_loader = None`` makes it rebuild lazily with the new split.
    """
    from lightning.fabric.utilities.data import _set_sampler_epoch

    fit_loop = trainer.fit_loop
    fit_loop._combined_loader = None
    fit_loop.setup_data()
    assert fit_loop._combined_loader is not None
    for loader in fit_loop._combined_loader.flattened:
        _set_sampler_epoch(loader, fit_loop.epoch_progress.current.processed)
    fit_loop.epoch_loop.val_loop._combined_loader = None


def loader_with_batch_size(dataloader: Any, batch_size: int) -> Any:
    """The same DataLoader (sampler, workers, collate) re-made with another ``batch_size``."""
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import (
        _get_dataloader_init_args_and_kwargs,
        _reinstantiate_wrapped_cls,
    )

    # Lightning's own re-instantiation (as for sampler injection) keeps a DataLoader subclass's
    # arguments; only the batch size changes.
    args, kwargs = _get_dataloader_init_args_and_kwargs(dataloader, dataloader.sampler, mode=RunningStage.TRAINING)
    kwargs["batch_size"] = batch_size
    return _reinstantiate_wrapped_cls(dataloader, *args, **kwargs)


def forget_logged_key_order(trainer: pl.Trainer) -> None:
    """Drop the fit loops' logged keys that were reset (not logged yet this epoch) from their results.

    Private: ``fit_loop.epoch_loop._results`` and ``epoch_loop.val_loop._results`` (a
    ``_ResultCollection``, ordered by first log). Used by
    :func:`lightning_pipetransformer.dp.idle_hooks.restart_metric_order`; exercised by the AutoDP
    tests that log with ``sync_dist=True`` across a transition (tests/integration/distributed/test_autodp_features.py).
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    for results in (epoch_loop._results, epoch_loop.val_loop._results):
        for key in [key for key, value in results.items() if value.has_reset]:
            del results[key]


def set_callback_metrics(trainer: pl.Trainer, metrics: dict[str, Any]) -> None:
    """Make ``trainer.callback_metrics`` show ``metrics`` on this rank (an idle rank: rank 0's values).

    Private: ``trainer._logger_connector._callback_metrics``, what ``callback_metrics`` returns
    and what ModelCheckpoint and EarlyStopping read. Exercised by the idle-rank checkpoint tests.
    """
    trainer._logger_connector._callback_metrics.update(metrics)


def show_in_progress_bar(trainer: pl.Trainer, values: dict[str, int | float]) -> None:
    """Show ``values`` in the progress bar as they are (an ``int`` without decimals), not sent to any logger.

    ``LightningModule.log(prog_bar=True)`` turns every value into a float tensor, so a count of
    frozen blocks would read ``5.000``. Private: ``trainer._logger_connector._progress_bar_metrics``,
    which ``trainer.progress_bar_metrics`` returns (updated with the logged values, so these stay).
    The two bars format differently: the TQDM bar shows an ``int`` as is (and pads a numeric string
    to ``5.000``), the Rich bar formats every non-string with ``.3f``: it gets counts as strings.
    Exercised by tests/integration/test_lightning_native.py.
    """
    from lightning.pytorch.callbacks import RichProgressBar

    rich = isinstance(trainer.progress_bar_callback, RichProgressBar)
    shown = {k: str(v) if rich and isinstance(v, int) else v for k, v in values.items()}
    trainer._logger_connector._progress_bar_metrics.update(shown)


def replace_sigterm_notifier(trainer: pl.Trainer, notifier: Any) -> None:
    """Make ``notifier(signum, frame)`` the SIGTERM handler Lightning registers for this trainer.

    Lightning 2.6's ``_SignalConnector._sigterm_notifier_fn`` forwards the signal to the launcher's
    children and broadcasts over the world group inside the handler; the strategy replaces it (see
    docs/autodp.md, "Operations"). ``register_signal_handlers`` reads the bound method when the trainer
    runs, after ``strategy.setup``: an attribute on the instance wins. Exercised by
    tests/integration/distributed/test_faults.py.
    """
    trainer._signal_connector._sigterm_notifier_fn = notifier  # type: ignore[method-assign]


def mark_sigterm_received(trainer: pl.Trainer) -> None:
    """Set what ``trainer.received_sigterm`` reads, so Lightning's loops stop at their own checks
    (``SIGTERMException`` after the current batch). Exercised by test_faults.py."""
    trainer._signal_connector.received_sigterm = True


def replace_sigterm_broadcast(trainer: pl.Trainer) -> None:
    """Lightning's check of ``received_sigterm`` before each training batch, without its collective.

    Lightning 2.6's ``_TrainingEpochLoop._broadcast_sigterm_tensor`` runs before every training batch
    with several processes: a broadcast of rank 0's flag over the world group, on the root device,
    then ``.item()``. Under NCCL that is a collective and a host synchronisation per step. The strategy
    needs neither: its step agreement (``dp/faults.agree_at_step``, over the gloo control group, at
    every step and after each transition) sets ``received_sigterm`` on every rank at the same point
    (:func:`mark_sigterm_received`), so the flag is already the same everywhere. This one reads it
    locally and raises ``SIGTERMException`` as Lightning's does (its barrier, there so that every
    rank has the flag, is not needed): every rank stops before the same batch. Replaced on this
    trainer's epoch loop instance. Exercised by tests/integration/distributed/test_step_syncs.py
    (no such broadcast per step) and test_faults.py (a SIGTERM inside the transition).
    """
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    def stop_if_agreed() -> None:
        if trainer.received_sigterm:
            raise SIGTERMException()

    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = stop_if_agreed  # type: ignore[method-assign]


def stop_child_process_observer() -> bool:
    """Stop Lightning's ``_ChildProcessObserver`` thread in this process (rank 0 of the subprocess launcher).

    Once a rank handles an exception, the observer would SIGKILL rank 0 as soon as a child exits
    with a non-zero code, also while rank 0 still writes its checkpoint or names the cause; the
    strategy ends the children itself then. The observer calls ``_run`` once more after its sleep:
    replaced on the instance. Returns whether one was found. Exercised by test_faults.py.
    """
    import threading

    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    found = False
    for thread in threading.enumerate():
        if isinstance(thread, _ChildProcessObserver):
            thread._finished = True
            thread._run = lambda: True  # type: ignore[method-assign]
            found = True
    return found


def exclude_from_eval_mode_warning(trainer: pl.Trainer, expected: Any) -> None:
    """Lightning's "Found N module(s) in eval mode at the start of training" without the modules ``expected(module)`` accepts.

    Frozen blocks run in eval mode on purpose; restored from a checkpoint they are in eval mode when
    ``FitLoop.on_run_start`` calls ``_warn_if_modules_in_eval_mode``, and the warning read like a bug.
    The check is replaced on this trainer's fit loop with the same one over the other modules (the
    same text, the same category): a user's own module left in eval mode is still reported.
    Exercised by tests/integration/test_resume_eval_mode.py.
    """
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn
    from lightning.pytorch.utilities.warnings import PossibleUserWarning

    def warn_if_modules_in_eval_mode() -> None:
        model = trainer.lightning_module
        eval_modules = [name for name, module in model.named_modules() if not module.training and not expected(module)]
        if eval_modules:
            rank_zero_warn(
                f"Found {len(eval_modules)} module(s) in eval mode at the start of training."
                " This may lead to unexpected behavior during training. If this is intentional,"
                " you can ignore this warning.",
                category=PossibleUserWarning,
            )

    trainer.fit_loop._warn_if_modules_in_eval_mode = warn_if_modules_in_eval_mode  # type: ignore[method-assign]
