"""AutoDP glue: shadow ranks, process groups and state transfer for the elastic strategy.

Lightning starts one process per device. With pipe length K only G/K processes per node drive a
pipeline replica ("active"); the others are *shadow ranks*: they stay in Lightning's fit loop in
lock-step with the active ones (same number of batches, same ``global_step``, same callback
decisions) but do no model work and load no data. When the pipeline shrinks, shadow ranks become
replicas: they receive the model, optimizer, scheduler and AutoFreeze state from global rank 0.

Which collective runs on which group (a collective that some ranks skip hangs the others):

* control (plan broadcast, ``barrier``, ``reduce_boolean_decision``, ``new_group``): all ranks,
  the static WORLD group (gloo on CPU, else a gloo group made once);
* data (DDP gradients, ``self.log(sync_dist=True)``, torchmetrics, state for new replicas):
  the active group, rebuilt at every change of the active set; shadow ranks skip it.

This module holds the pieces; :meth:`PipeTransformerStrategy._transition` reads top to bottom.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn

__all__: list[str] = []


class IdleBatch:
    """What a shadow rank's loaders yield: a placeholder that is never moved, read or stepped on.

    Not ``None``: Lightning's training loop treats a ``None`` batch as a user error.
    """

    def __repr__(self) -> str:
        return "IdleBatch()"


IDLE_BATCH = IdleBatch()


class IdleLoader:
    """Stands in for a DataLoader on a shadow rank: the same length, no data loaded.

    The length is that of the real loader over an active replica's share (``len`` of a
    DataLoader only asks its sampler), so every rank runs the same number of batches.
    """

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[IdleBatch]:
        return (IDLE_BATCH for _ in range(self.length))


def is_idle_batch(batch: Any) -> bool:
    return isinstance(batch, IdleBatch)


def idle_loss(device: torch.device) -> torch.Tensor:
    """A shadow rank's training-step output: Lightning (world size > 1) wants a loss that requires grad."""
    return torch.zeros((), device=device, requires_grad=True)


class PhaseClock:
    """Seconds spent in each named phase, in order (a transition's breakdown)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self._last
        self._last = now


# ---------------------------------------------------------------------------------- groups


def control_group(backend: str, timeout: timedelta) -> Any:
    """The static group over all ranks for control messages: WORLD when it is gloo, else a gloo copy.

    Must be called by every rank (``new_group`` is collective).
    """
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo", timeout=timeout)


def active_group(ranks: Sequence[int], backend: str, timeout: timedelta) -> Any:
    """A new group over the active ranks (every rank calls this, in the same order).

    Non-members get ``GroupMember.NON_GROUP_MEMBER`` back and must not use it.
    """
    return dist.new_group(ranks=list(ranks), backend=backend, timeout=timeout)


def broadcast_object(obj: Any, src: int, group: Any) -> Any:
    """``obj`` from global rank ``src`` to every member of ``group`` (pickled; keep it small and on CPU)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


# ---------------------------------------------------------------------------------- state transfer


def broadcast_module_state(module: nn.Module, src: int, group: Any) -> None:
    """Every parameter and buffer of ``module`` from global rank ``src`` to all of ``group``, in place.

    Tensors are packed into one flat buffer per (device, dtype), so the cost is a handful of
    collectives rather than one per tensor.
    """
    tensors = [t.data for t in module.parameters()] + [b for b in module.buffers()]
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    seen: set[int] = set()
    for t in tensors:
        if id(t) in seen or t.numel() == 0:
            continue  # tied weights are sent once
        seen.add(id(t))
        buckets.setdefault((t.device, t.dtype), []).append(t)
    sending = dist.get_rank() == src
    for (device, dtype), bucket in buckets.items():
        if sending:
            flat = torch.cat([t.reshape(-1) for t in bucket])
        else:
            flat = torch.empty(sum(t.numel() for t in bucket), dtype=dtype, device=device)
        dist.broadcast(flat, src=src, group=group)
        if sending:
            continue
        offset = 0
        for t in bucket:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


def broadcast_state(state: Any, src: int, group: Any) -> Any:
    """A nested state (optimizer and scheduler state dicts) from global rank ``src`` to all of ``group``.

    The structure goes as a small pickled skeleton, the tensors as flat buffers per dtype (no
    pickling of hundreds of MB of momentum). Received tensors are on the CPU;
    ``Optimizer.load_state_dict`` moves them to each parameter's device. Returns the state
    (on ``src``: as given).
    """
    tensors: list[torch.Tensor] = []
    skeleton = _skeleton(state, tensors) if dist.get_rank() == src else None
    skeleton, specs = broadcast_object(
        (skeleton, [(tuple(t.shape), t.dtype) for t in tensors]) if dist.get_rank() == src else None, src, group
    )
    if dist.get_rank() != src:
        tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(index)
    for dtype, indices in sorted(by_dtype.items(), key=lambda item: str(item[0])):
        flat = torch.cat([tensors[i].detach().reshape(-1).cpu() for i in indices]) if dist.get_rank() == src else None
        if flat is None:
            flat = torch.empty(sum(tensors[i].numel() for i in indices), dtype=dtype)
        dist.broadcast(flat, src=src, group=group)
        if dist.get_rank() != src:
            offset = 0
            for i in indices:
                n = tensors[i].numel()
                tensors[i] = flat[offset : offset + n].view(tensors[i].shape)
                offset += n
    return state if dist.get_rank() == src else _fill(skeleton, tensors)


class _TensorSlot:
    def __init__(self, index: int) -> None:
        self.index = index


def _skeleton(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _TensorSlot(len(tensors) - 1)
    if isinstance(value, dict):
        return {k: _skeleton(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_skeleton(v, tensors) for v in value)
    return value


def _fill(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, _TensorSlot):
        return tensors[value.index]
    if isinstance(value, dict):
        return {k: _fill(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_fill(v, tensors) for v in value)
    return value


def point_metrics_at(module: nn.Module, group: Any) -> None:
    """torchmetrics ``Metric`` objects sync over their own ``process_group`` (default WORLD): shadow
    ranks never update or compute them, so they must sync over the active group."""
    for child in module.modules():
        if hasattr(child, "process_group") and hasattr(child, "_reductions"):  # a torchmetrics Metric
            child.process_group = group


# ---------------------------------------------------------------------------------- Lightning internals


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
    from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs, _reinstantiate_wrapped_cls

    # Lightning's own re-instantiation (as for sampler injection) keeps a DataLoader subclass's
    # arguments; only the batch size changes.
    args, kwargs = _get_dataloader_init_args_and_kwargs(dataloader, dataloader.sampler, mode=RunningStage.TRAINING)
    kwargs["batch_size"] = batch_size
    return _reinstantiate_wrapped_cls(dataloader, *args, **kwargs)


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
        self.strategy._transition(trainer)
