"""Process groups of AutoDP and which collective runs on which.

Which collective runs on which group (a collective that some ranks skip hangs the others):

* control (plan broadcast, ``barrier``, ``reduce_boolean_decision``, ``new_group``): all ranks,
  the static WORLD group (gloo on CPU, else a gloo group made once);
* data (gradients, ``self.log(sync_dist=True)``, torchmetrics, state for new replicas):
  the active group, rebuilt at every change of the active set; shadow ranks skip it;
* the active ranks' host flags (which gradients a replica of several stages left ``None``):
  the active group's gloo twin (:func:`host_twin`; the active group itself under gloo).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import nn

from lightning_pipetransformer import devices as dev


def control_group(backend: str, timeout: timedelta) -> Any:
    """The static group over all ranks for control messages: WORLD when it is gloo, else a gloo copy.

    Must be called by every rank (``new_group`` is collective). Under
    :class:`~lightning_pipetransformer.devices.VirtualDevices` a gloo WORLD stands for NCCL's, so the
    control group is a copy there too: a test can then tell control messages from data.
    """
    if dist.get_backend() == "gloo" and not dev.virtual_mode():
        return dist.group.WORLD
    return dist.new_group(backend="gloo", timeout=timeout)


def active_group(ranks: Sequence[int], backend: str, timeout: timedelta) -> Any:
    """A new group over the active ranks (every rank calls this, in the same order).

    Non-members get ``GroupMember.NON_GROUP_MEMBER`` back and must not use it.
    """
    return dist.new_group(ranks=list(ranks), backend=backend, timeout=timeout)


def host_twin(group: Any, ranks: Sequence[int], backend: str, timeout: timedelta) -> Any:
    """A gloo group over the same ranks as ``group`` (``group`` itself when it is gloo), for data the hosts hold.

    Why: which gradients a replica left ``None`` is known on its host; all-reduced on the device (NCCL)
    and read back, it would make the host wait for the whole backward queued before it, at every step
    (:func:`~lightning_pipetransformer.dp.averaging.used_anywhere`). Every rank calls this, in the same
    order (``new_group`` is collective). Under :class:`~lightning_pipetransformer.devices.VirtualDevices`
    a gloo ``group`` stands for NCCL's, so the twin is a group of its own there too (a test tells them apart).
    """
    if backend == "gloo" and not dev.virtual_mode():
        return group
    return dist.new_group(ranks=list(ranks), backend="gloo", timeout=timeout)


def broadcast_object(obj: Any, src: int, group: Any) -> Any:
    """``obj`` from global rank ``src`` to every member of ``group`` (pickled; keep it small and on CPU)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(group: Any) -> None:
    """Every member of ``group`` has reached this point (the gloo control group: no device involved)."""
    dist.barrier(group=group)


def destroy_group(group: Any) -> None:
    """Release a group no longer used (its communicators would otherwise live as long as the process)."""
    if group is None or group is dist.group.WORLD or group == dist.GroupMember.NON_GROUP_MEMBER:
        return
    dist.destroy_process_group(group)


def point_metrics_at(module: nn.Module, group: Any) -> None:
    """torchmetrics ``Metric`` objects sync over their own ``process_group`` (default WORLD): shadow
    ranks never update or compute them, so they must sync over the active group."""
    for child in module.modules():
        if hasattr(child, "process_group") and hasattr(child, "_reductions"):  # a torchmetrics Metric
            child.process_group = group
