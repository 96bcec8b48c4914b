"""The test-only virtual devices: CPU "devices" that remember which tensor is where.

On CPU every device is the same memory, so the placement mistakes a multi-GPU run fails on pass
silently. :class:`VirtualDevices` makes them fail on CPU too: the placement hooks
(:mod:`~.placement`) report to it while it is in force (:func:`active_virtual_devices`), and do
nothing more than ``Module.to`` / ``Tensor.to`` otherwise.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

__all__ = ["VirtualDeviceError", "VirtualDevices", "active_virtual_devices", "virtual_mode"]

#: Test mode (see :class:`VirtualDevices`); ``None`` in production, where every placement hook
#: (:mod:`~.placement`) is a plain ``Module.to`` / ``Tensor.to`` or nothing.
_virtual: VirtualDevices | None = None


class VirtualDeviceError(RuntimeError):
    """What a real multi-device run would have failed with, caught on CPU by :class:`VirtualDevices`."""


def virtual_mode() -> bool:
    """Whether the :class:`VirtualDevices` test mode is on."""
    return _virtual is not None


def active_virtual_devices() -> VirtualDevices | None:
    """The :class:`VirtualDevices` in force (``None`` in production)."""
    return _virtual


class VirtualDevices:
    """Test mode: CPU "devices" ``cpu:0``, ``cpu:1`` ... that remember which tensor is where.

    On CPU every device is the same memory, so the mistakes a multi-GPU run fails on pass
    silently: DDP bound to parameters that are moved afterwards, optimizer state left on a device
    its parameter left, a collective on a tensor that is not on the process's own device (NCCL
    groups are bound to it). In this mode each parameter, buffer and moved optimizer-state
    tensor carries the virtual device it was placed on (``torch.device("cpu", i)``, which
    compares unequal to ``cpu:j`` although the memory is the same), and the placement hooks raise
    :class:`VirtualDeviceError` where the GPU run would fail. Used by tests only::

        with VirtualDevices():
            trainer = Trainer(strategy=PipeTransformerStrategy(parallel_devices=[torch.device("cpu", i) ...]))
    """

    def __init__(self) -> None:
        # id(tensor) -> (tensor ref, device). An id is reused once its tensor dies, so every lookup
        # checks the reference: a stale entry must never speak for a new tensor at the same address.
        self._where: dict[int, tuple[Any, torch.device]] = {}
        self.wrapped: dict[int, tuple[Any, torch.device]] = {}  # id(param) -> (param ref, the device DDP saw it on)
        self.process_device: torch.device | None = None  # set by the strategy (bind_process_device)

    def __enter__(self) -> VirtualDevices:
        global _virtual
        self._previous, _virtual = _virtual, self
        return self

    def __exit__(self, *exc: Any) -> None:
        global _virtual
        _virtual = self._previous

    def tag(self, tensor: Tensor, device: torch.device) -> None:
        self._where[id(tensor)] = (weakref.ref(tensor), device)

    @staticmethod
    def _live(table: dict[int, tuple[Any, torch.device]], tensor: Tensor) -> torch.device | None:
        found = table.get(id(tensor))
        return found[1] if found is not None and found[0]() is tensor else None

    def tagged(self, tensor: Tensor) -> bool:
        return self._live(self._where, tensor) is not None

    def device_of(self, tensor: Tensor) -> torch.device:
        where = self._live(self._where, tensor)
        return tensor.device if where is None else where  # never placed: where torch says it is

    def live_bytes(self, device: torch.device) -> int:
        """Bytes of the memory held by tensors tagged on ``device`` that are still alive (staging
        buffers, for a test's bound): each storage once, however many views of it are tagged."""
        storages: dict[int, int] = {}
        for ref, where in list(self._where.values()):
            tensor = ref()
            if tensor is not None and where == device:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def placed(self, module: torch.nn.Module, device: torch.device) -> None:
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            seen = self._live(self.wrapped, tensor)
            if seen is not None and seen != device:
                raise VirtualDeviceError(
                    f"{name} moved from {seen} to {device} after DDP wrapped it: DDP's hooks and buckets stay on the "
                    "old storage (on GPU: 'Expected to have finished reduction', or silently unsynchronised gradients)."
                )
            self.tag(tensor, device)

    def wrapping(self, params: list[Tensor], root: torch.device) -> None:
        for param in params:
            where = self.device_of(param)
            if where != root:
                raise VirtualDeviceError(f"DDP wraps a parameter on {where}, not on the process's device {root}.")
            self.wrapped[id(param)] = (weakref.ref(param), where)

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        for param, state in optimizer.state.items():
            home = self.device_of(param)
            for key, value in state.items():
                if not isinstance(value, Tensor) or (key == "step" and value.dim() == 0 and not self.tagged(value)):
                    continue
                if not self.tagged(value):  # made by the optimizer next to its parameter
                    self.tag(value, home)
                elif self.device_of(value) != home:
                    raise VirtualDeviceError(
                        f"Optimizer state '{key}' is on {self.device_of(value)} but its parameter on {home}: the first "
                        "step after the move fails on GPU (and the state occupies a device this process left)."
                    )

    def check_collective(self, tensor: Tensor, what: str) -> None:
        root = self.process_device
        where = self.device_of(tensor)
        if root is not None and where != root:
            raise VirtualDeviceError(
                f"{what}: a collective on a tensor on {where}, but this process's groups are bound to {root} "
                "(NCCL refuses tensors on other devices)."
            )

