"""Every private Lightning attribute or function the project touches, in one place.

Lightning is pinned (pyproject); an upgrade has this one module to check. Each function
says which private names it relies on and which test exercises it.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl


def rebuild_train_loader(trainer: pl.Trainer) -> None:
    """Rebuild the train loader (new sampler split, batch size, stand-ins) at an epoch start.

    Lightning 2.6 has no public way to re-shard between epochs, and ``FitLoop.setup_data`` has
    already run for this epoch before ``on_train_epoch_start``. These private attributes are
    pinned with Lightning (pyproject) and exercised by tests/test_autodp.py:

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
