"""Gradient averaging over the active replicas: a DDP wrapper, or an average by hand after backward.

Why two ways. A replica of one stage is wrapped in ``DistributedDataParallel`` (gradients
all-reduced while backward runs). A replica whose stages span several devices is not: DDP would
all-reduce buckets on every device, but the process's groups are bound to its own device (NCCL
refuses the others), so its gradients are averaged after backward through buffers on that device
(:func:`~lightning_pipetransformer.dp.averaging.average_gradients`). One process, or a shadow
rank, averages nothing (a wrapper would only add a reducer that breaks when AutoFreeze turns
``requires_grad`` off).

:class:`GradientSync` takes data (the module, the group, the devices) and returns the model to
train; it never sees the strategy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_pipetransformer import devices as dev
from lightning_pipetransformer.dp import averaging

__all__ = ["UNUSED_PARAMETER_ERROR", "UNUSED_PARAMETER_HINT", "GradientSync", "ddp_device_ids"]

#: DDP's error when a parameter that requires grad got no gradient on a replica, and what to do about it here.
UNUSED_PARAMETER_ERROR = ".*Expected to have finished reduction in the prior iteration.*"
UNUSED_PARAMETER_HINT = (
    "A parameter that requires grad did not take part in producing the loss on one replica. "
    "strategy='pipetransformer' builds DDP without find_unused_parameters: freeze such parameters "
    "(requires_grad=False) or use them in every step."
)


def ddp_device_ids(root_device: torch.device, stage_devices: Sequence[torch.device]) -> list[int] | None:
    """DDP's ``device_ids``: None on the CPU and for a module over several devices (a replica of several stages)."""
    if root_device.type == "cpu" or len(set(stage_devices)) > 1:
        return None
    return [root_device.index]


class GradientSync:
    """How this process's gradients meet the other replicas' under the current plan."""

    def __init__(self, ddp_kwargs: dict[str, Any] | None = None) -> None:
        self.ddp_kwargs = dict(ddp_kwargs or {})
        #: Replicas of several stages: gradients averaged after backward over :attr:`group`.
        self.by_hand = False
        #: The group averaged over by hand (None when nothing is averaged by hand).
        self.group: Any = None
        #: Its gloo twin (the group itself under gloo): which parameters a replica used, agreed on the host.
        self.host_group: Any = None

    def unwrap(self, model: nn.Module, module: nn.Module) -> nn.Module:
        """The plain module, DDP's wrapper dropped: its reducer holds the old group and frozen set."""
        if isinstance(model, DistributedDataParallel):
            dev.after_unwrap()
        self.by_hand, self.group, self.host_group = False, None, None
        return module

    def wrap(
        self,
        module: nn.Module,
        *,
        group: Any,
        host_group: Any,
        world_size: int,
        active: bool,
        pipe_len: int,
        num_replicas: int,
        root_device: torch.device,
        stage_devices: Sequence[torch.device],
        init_sync: bool,
    ) -> nn.Module:
        """The model to train for this plan: ``module`` itself, or DDP over ``group``.

        ``init_sync``: the first wrapper of a fit copies rank 0's weights to the replicas; at a
        transition the joining ranks received them already, so the copy is skipped. ``host_group``:
        ``group``'s gloo twin (:func:`~lightning_pipetransformer.dp.groups.host_twin`), for an average by hand.
        """
        self.by_hand, self.group, self.host_group = False, None, None
        if world_size == 1 or not active:
            return module
        if pipe_len > 1:
            self.by_hand = num_replicas > 1
            self.group = group if self.by_hand else None
            self.host_group = host_group if self.by_hand else None
            return module
        dev.before_wrap([p for p in module.parameters() if p.requires_grad], root_device)
        return DistributedDataParallel(
            module=module,
            device_ids=ddp_device_ids(root_device, stage_devices),
            process_group=group,
            init_sync=init_sync,
            **self.ddp_kwargs,
        )

    def average(self, params: Iterable[torch.Tensor], device: torch.device) -> None:
        """After the last backward of a step: the replicas' mean gradient, when averaged by hand."""
        if self.by_hand:
            averaging.average_gradients([p for p in params if p.requires_grad], self.group, device, self.host_group)

    def gradient_group(self, model: nn.Module) -> Any:
        """The group this replica's gradients are averaged over, or None when nothing is."""
        if isinstance(model, DistributedDataParallel):
            return model.process_group
        return self.group
