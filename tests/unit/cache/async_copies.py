"""A stand-in GPU whose device-to-host copies run late, as CUDA's ``non_blocking`` copies do.

Plugged in with :func:`lightning_pipetransformer.devices.stand_in_streams` and entered as a
``TorchFunctionMode``, it makes :mod:`lightning_pipetransformer.cache.host_copy` take its CUDA path on
CPU tensors, and:

- hands out "pinned" host buffers (:meth:`AsyncCopies.host_buffer`), filled with NaN: what an early
  read of a buffer would see (whatever the memory held);
- queues every ``copy_(..., non_blocking=True)`` instead of running it: the copy reads its source
  when the stand-in GPU runs it (:meth:`AsyncCopies.run`), not when the host issued it, so a later
  in-place write to the source is seen, as on a device;
- runs the copies queued before an event when the host synchronises it; ``query`` answers whether
  they have run;
- logs every step in call order (:attr:`AsyncCopies.log`): ``("wait", waiter, producer)``,
  ``("copy", stream, pinned, non_blocking, dtype)``, ``("record_stream", stream)``,
  ``("event", stream)``, ``("synchronize", stream)``, ``("done", stream)`` and ``("host read",)`` (a
  :class:`~lightning_pipetransformer.cache.host_copy.HostCopy` handing its buffers out).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from lightning_pipetransformer.cache import host_copy
from lightning_pipetransformer.devices import stand_in_streams


class Stream:
    def __init__(self, gpu: AsyncCopies, device: torch.device, name: str) -> None:
        self.gpu, self.device, self.name = gpu, device, name

    def wait_event(self, event: Event) -> None:
        self.gpu.log.append(("wait", self.name, event.stream.name))

    def __repr__(self) -> str:
        return self.name


class Event:
    def __init__(self, gpu: AsyncCopies) -> None:
        self.gpu, self.stream, self.upto = gpu, None, 0

    def record(self, stream: Stream) -> None:
        self.stream, self.upto = stream, len(self.gpu.queued)
        self.gpu.log.append(("event", stream.name))

    def query(self) -> bool:
        done = self.gpu.ran >= self.upto
        if done:
            self.gpu.log.append(("done", self.stream.name))
        return done

    def synchronize(self) -> None:
        self.gpu.log.append(("synchronize", self.stream.name))
        self.gpu.run(self.upto)


class AsyncCopies(TorchFunctionMode):
    """The backend :func:`stand_in_streams` takes, and the mode that queues non-blocking copies."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[Any, ...]] = []
        self.made = 0
        self.compute: dict[torch.device, Stream] = {}
        self.current: dict[torch.device, Stream] = {}
        self.pinned: set[int] = set()
        self.queued: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.ran = 0
        self._running = False

    # -- the stream backend ----------------------------------------------------------------------

    def new_stream(self, device: torch.device) -> Stream:
        self.made += 1
        return Stream(self, device, f"copy{self.made}")

    def current_stream(self, device: torch.device) -> Stream:
        device = torch.device(device)
        if device not in self.compute:
            self.compute[device] = Stream(self, device, f"compute:{device}")
        return self.current.get(device, self.compute[device])

    @contextlib.contextmanager
    def use_stream(self, stream: Stream) -> Iterator[Stream]:
        before = self.current.get(stream.device)
        self.current[stream.device] = stream
        try:
            yield stream
        finally:
            if before is None:
                del self.current[stream.device]
            else:
                self.current[stream.device] = before

    def new_event(self) -> Event:
        return Event(self)

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        self.log.append(("record_stream", stream.name))

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.full(shape, float("nan"), dtype=dtype) if dtype.is_floating_point else torch.full(shape, -7, dtype=dtype)
        self.pinned.add(buffer.data_ptr())
        return buffer

    # -- the stand-in GPU --------------------------------------------------------------------------

    def run(self, upto: int | None = None) -> None:
        """The GPU runs the queued copies (up to the ``upto``-th), in order."""
        upto = len(self.queued) if upto is None else upto
        self._running = True
        try:
            while self.ran < upto:
                dst, src = self.queued[self.ran]
                dst.copy_(src)
                self.ran += 1
        finally:
            self._running = False

    def copies(self) -> list[tuple[Any, ...]]:
        return [entry for entry in self.log if entry[0] == "copy"]

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and not self._running:
            dst, src = args[0], args[1]
            non_blocking = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
            stream = self.current_stream(src.device)
            self.log.append(("copy", stream.name, dst.data_ptr() in self.pinned, non_blocking, src.dtype))
            if non_blocking:
                self.queued.append((dst, src))
                return dst
        return func(*args, **kwargs)


@pytest.fixture
def async_gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[AsyncCopies]:
    """Stand-in streams whose copies run late, with every host read of a copy's buffers logged."""
    gpu = AsyncCopies()
    real_host = host_copy.HostCopy.host

    def logged_host(self: host_copy.HostCopy) -> Any:
        out = real_host(self)
        gpu.log.append(("host read",))
        return out

    monkeypatch.setattr(host_copy.HostCopy, "host", logged_host)
    with stand_in_streams(gpu), gpu:
        yield gpu
