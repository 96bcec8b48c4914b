"""Device time of a region of work: CUDA events on the device's current stream, the host clock off CUDA.

Why not ``time.perf_counter`` around the region: on a GPU the host returns from a kernel launch,
and from a ``non_blocking`` host-to-device copy, long before the device has done the work, so the
host clock measures launches. A decision that compares two regions (``cache="auto"``: a lookup
against the frozen prefix) must compare what the device spends on them.

A :class:`DeviceSpan` records an event on the current stream at its start and at its end, and reads
them once (:meth:`DeviceSpan.seconds`: the end event is synchronised, then ``elapsed_time``), so a
span costs two event records on the step path and one wait when its time is read. Off CUDA the
"events" read the host clock, where the work is done when the call returns: one code path. Under
:func:`~lightning_pipetransformer.devices.streams.stand_in_streams` the stand-in's events are
used, so a test replays on CPU what a GPU's timeline would give.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any

import torch

from lightning_pipetransformer.devices.streams import Stream, current_stream, new_event

__all__ = ["DeviceSpan", "HostEvent"]


class HostEvent:
    """The host clock in the shape of a CUDA event (a CPU device: the work is done when its call returns)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def record(self, stream: Any = None) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        """Nothing to wait for: on the CPU recorded work is already done."""

    def elapsed_time(self, end: HostEvent) -> float:
        """Milliseconds from this event to ``end``, as ``torch.cuda.Event.elapsed_time``."""
        assert self.at is not None and end.at is not None, "elapsed_time between events not both recorded"
        return (end.at - self.at) * 1e3


def _timing_event(stream: Stream) -> Any:
    """An event that can time: the stand-in's (tests), CUDA's with timing on, else the host clock."""
    if stream is None:  # off CUDA (a stand-in backend gives every device a stream)
        return HostEvent()
    return new_event(timing=True)


class DeviceSpan:
    """The device time of the work queued in a ``with`` block on ``device``'s current stream.

    Read with :meth:`seconds`, once the decision that needs it is taken: it waits for the end event
    (the only synchronisation), so a span read later than its step costs no wait at all. The region's
    work must be queued on ``device``'s current stream (the frozen prefix runs in stage 0 on the
    cache's device; a lookup copies to it): time spent on other streams that the current one does
    not wait for is not seen.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = current_stream(device)
        self._start = _timing_event(self._stream)
        self._end = _timing_event(self._stream)
        self._closed = False

    def __enter__(self) -> DeviceSpan:
        self._start.record(self._stream)
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None) -> None:
        self._end.record(self._stream)
        self._closed = True

    def seconds(self) -> float:
        """Seconds between the start and the end on the device: waits for the end event (read it once)."""
        if not self._closed:
            raise RuntimeError("DeviceSpan.seconds() before the span ended")
        self._end.synchronize()
        return float(self._start.elapsed_time(self._end)) / 1e3
