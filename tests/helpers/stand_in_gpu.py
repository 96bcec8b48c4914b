"""A one-stream stand-in GPU whose kernels take device time the host clock does not see.

Plugged in with :func:`lightning_pipetransformer.devices.stand_in_streams`, it is the current
stream of every device, so code that times with events (devices/timing.py) takes its CUDA path
on CPU tensors. What it models, as CUDA does:

- ``kernel(seconds)``: launched at the host's time, it starts when the stream is free and the host
  has launched it, and moves the stream's tail; the host does not wait (a launch costs it nothing);
- ``host_work(seconds)``: the host is busy (really sleeps, so ``time.perf_counter`` sees it too);
- ``Event.record(stream)``: the event is reached when the stream has done what was queued before it
  and the host has recorded it; ``synchronize`` brings the host to that time; ``elapsed_time`` is
  in milliseconds.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch


class StandInEvent:
    def __init__(self, gpu: StandInGpu) -> None:
        self.gpu = gpu
        self.at: float | None = None
        self.stream: Any = None

    def record(self, stream: Any) -> None:
        self.stream, self.at = stream, max(self.gpu.tail, self.gpu.host)
        self.gpu.recorded.append(self)

    def synchronize(self) -> None:
        assert self.at is not None, "synchronize() on an event never recorded"
        self.gpu.waits += 1
        self.gpu.waited.append(self)
        self.gpu.host = max(self.gpu.host, self.at)

    def query(self) -> bool:
        """Reached already, by the host's clock (never waits)."""
        assert self.at is not None, "query() on an event never recorded"
        return self.gpu.host >= self.at

    def elapsed_time(self, end: StandInEvent) -> float:
        assert self.at is not None and end.at is not None
        return (end.at - self.at) * 1e3


class StandInGpu:
    """The backend :func:`~lightning_pipetransformer.devices.stand_in_streams` takes; itself the one stream."""

    def __init__(self) -> None:
        self.host = 0.0  # the host's clock, seconds
        self.tail = 0.0  # when the stream has done everything queued on it
        self.recorded: list[StandInEvent] = []
        self.waits = 0  # host synchronisations on an event
        self.waited: list[StandInEvent] = []  # the events they waited for, in order

    # -- the backend ---------------------------------------------------------------------------
    def new_stream(self, device: torch.device) -> StandInGpu:
        return self

    def current_stream(self, device: torch.device) -> StandInGpu:
        return self

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext(stream)

    def new_event(self) -> StandInEvent:
        return StandInEvent(self)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        pass

    def wait_event(self, event: StandInEvent) -> None:
        """One stream: what it waits for was queued on it before."""

    # -- what the test's code does ---------------------------------------------------------------
    def kernel(self, seconds: float) -> None:
        self.tail = max(self.tail, self.host) + seconds

    def host_work(self, seconds: float) -> None:
        time.sleep(seconds)
        self.host += seconds
