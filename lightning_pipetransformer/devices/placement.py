"""Placement: where modules, parameters and optimizer state go, and the checks a multi-GPU run would make.

Every move of a module or of optimizer state, DDP's wrap and unwrap, and a collective's buffer go
through these hooks. In production each is a plain ``Module.to`` / ``Tensor.to`` or nothing; in the
test mode (:class:`~.virtual.VirtualDevices`) they tag what moved where and raise
:class:`~.virtual.VirtualDeviceError` where the GPU run would fail.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_pipetransformer.devices.virtual import active_virtual_devices, virtual_mode

__all__ = [
    "Device", "after_unwrap", "as_device", "before_wrap", "bind_process_device", "check_collective", "check_optimizer",
    "device_of", "devices_left", "module_devices", "move_state", "optimizer_state_to_param_devices", "place_module",
    "place_outside", "tag_as",
]  # fmt: skip

Device = torch.device | str | int


def as_device(device: Device) -> torch.device:
    """``torch.device`` with an explicit index for CUDA (``"cuda"`` -> ``cuda:<current>``).

    An index-less CUDA device compares unequal to the ``cuda:0`` a tensor reports, which would
    make every call look like a cross-device copy.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_of(tensor: Tensor) -> torch.device:
    """Where ``tensor`` is: its device, or in the test mode the virtual device it was placed on."""
    virtual = active_virtual_devices()
    return virtual.device_of(tensor) if virtual is not None else tensor.device


def module_devices(modules: Sequence[torch.nn.Module]) -> list[frozenset[torch.device]]:
    """Where each module's parameters and buffers are now (in the test mode, their virtual devices).

    Read before and after a plan is applied, it says which devices blocks left
    (:func:`devices_left`): the placement itself, not what the plans say, which differ where a
    runner places blocks its own way (the cache's frozen prefix on the first stage's device).
    """
    return [frozenset(device_of(t) for t in [*m.parameters(), *m.buffers()]) for m in modules]


def devices_left(before: Sequence[frozenset[torch.device]], after: Sequence[frozenset[torch.device]]) -> tuple[torch.device, ...]:
    """The devices some module had a tensor on ``before`` and has none on ``after`` (by name): the
    devices whose memory a move freed, where the allocator's cache is worth emptying."""
    left = {d for was, now in zip(before, after, strict=True) for d in was - now}
    return tuple(sorted(left, key=str))


def tag_as(tensor: Tensor, device: torch.device) -> None:
    """Test mode: ``tensor`` was made on ``device`` (a buffer for a collective)."""
    virtual = active_virtual_devices()
    if virtual is not None:
        virtual.tag(tensor, device)


def place_module(module: torch.nn.Module, device: torch.device) -> None:
    """Move ``module`` to ``device`` (``Module.to``: its parameters keep their identity)."""
    virtual = active_virtual_devices()
    module.to(device)
    if virtual is not None:
        virtual.placed(module, device)


def place_outside(root: torch.nn.Module, blocks: list[torch.nn.Module], device: torch.device) -> None:
    """Move everything in ``root`` but ``blocks`` to ``device``, each module by its own ``_apply``.

    A subtree without a block moves as ``Module.to`` moves it (overrides of ``_apply`` included:
    torchmetrics' states, a module that caches its device); an ancestor of the blocks moves only
    its own parameters and buffers (``_apply(recurse=False)``), so the blocks stay where they are.
    """
    virtual = active_virtual_devices()
    inside = {id(m) for block in blocks for m in block.modules()}
    above = {id(m) for m in root.modules() if id(m) not in inside and any(id(c) in inside for c in m.modules())}

    def move(module: torch.nn.Module) -> None:
        if id(module) in inside:
            return
        if id(module) not in above:
            place_module(module, device)
            return
        _apply_own(module, lambda t: t.to(device))
        if virtual is not None:
            for tensor in [*module._parameters.values(), *module._buffers.values()]:
                if tensor is not None:
                    virtual.tag(tensor, device)
        for child in module.children():
            move(child)

    move(root)


def _apply_own(module: torch.nn.Module, fn: Any) -> None:
    """``module._apply(fn, recurse=False)``; an override without ``recurse`` gets the base version."""
    import inspect

    if "recurse" in inspect.signature(module._apply).parameters:
        module._apply(fn, recurse=False)
    else:
        torch.nn.Module._apply(module, fn, recurse=False)


def move_state(value: Tensor, param: Tensor) -> Tensor:
    """An optimizer-state tensor moved to its parameter's device."""
    virtual = active_virtual_devices()
    moved = value.to(param.device)
    if virtual is not None:
        virtual.tag(moved, virtual.device_of(param))
    return moved


def before_wrap(params: list[Tensor], root: torch.device) -> None:
    """DDP is about to wrap ``params`` on ``root``: they must all be there, and stay there."""
    virtual = active_virtual_devices()
    if virtual is not None:
        virtual.wrapping(params, root)


def after_unwrap() -> None:
    """The DDP wrapper was dropped: its parameters may move again."""
    virtual = active_virtual_devices()
    if virtual is not None:
        virtual.wrapped.clear()


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Before a step: every state tensor is on its parameter's device (test mode only)."""
    virtual = active_virtual_devices()
    if virtual is not None:
        virtual.check_optimizer(optimizer)


def bind_process_device(device: torch.device) -> None:
    """The process's own device: its process groups are bound to it (Lightning's ``device_id``)."""
    virtual = active_virtual_devices()
    if virtual is not None:
        virtual.process_device = device


def check_collective(tensor: Tensor, what: str) -> None:
    """Before a collective: the tensor is on the process's own device (test mode only)."""
    virtual = active_virtual_devices()
    if virtual is not None:
        virtual.check_collective(tensor, what)


def optimizer_state_to_param_devices(optimizers: list[torch.optim.Optimizer]) -> None:
    """Each optimizer-state tensor to its parameter's device (after a checkpoint load, a state
    transfer, or a plan that moved blocks between devices)."""
    for optimizer in optimizers:
        on_device_step = {
            id(p) for group in optimizer.param_groups if group.get("capturable") or group.get("fused") for p in group["params"]
        }
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                # 'step' stays on the CPU unless the optimizer runs it on the device (capturable, fused).
                if key == "step" and id(param) not in on_device_step:
                    continue
                if value.device != param.device or virtual_mode():
                    state[key] = move_state(value, param)
