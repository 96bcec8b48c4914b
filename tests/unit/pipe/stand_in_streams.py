"""An event-driven stand-in for CUDA streams and events, to replay the executor's timeline on CPU.

Plugged in with :func:`lightning_pipetransformer.devices.stand_in_streams`, it makes the executor
take its CUDA path (streams, events, the ``hop`` autograd function) on CPU tensors. What it models:

- a stream is a queue with a *tail*, the time at which everything queued on it so far is done;
- a kernel of duration ``d`` launched on the current stream starts at its tail (and no earlier
  than the host has launched it, see ``launch_cost``) and moves the tail to ``start + d``;
- ``Event.record(stream)`` captures the stream's tail; ``stream.wait_event(event)`` makes the
  stream's next work start no earlier than that time;
- ``launch_cost``: host time one launch takes. One Python thread launches everything, so the
  host clock only moves forward; a kernel cannot start before its launch has been issued.

- ``copy_cost``: a copy between devices (``devices.handover._move_across``) is a kernel of that duration
  on the source device's current stream, after both devices' current streams' earlier work, and
  the destination's current stream waits for it: torch's two-way barrier around a peer copy.
  Kept in ``copies``, apart from the blocks' ``kernels``. Free by default.

What it does not model: the caching allocator, the GPU running several streams' kernels at less than full speed when they share
its SMs, and the CUDA autograd engine's own per-device threads (on CPU the engine runs every
backward node on this thread, in the order the one-GPU engine uses; see docs/executor.md).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch


class Stream:
    def __init__(self, timeline: Timeline, device: torch.device, name: str) -> None:
        self.timeline, self.device, self.name = timeline, device, name
        self.tail = 0.0

    def wait_event(self, event: Event) -> None:
        self.timeline.log.append(("wait", self, event.stream))
        self.tail = max(self.tail, event.time)

    def __repr__(self) -> str:
        return self.name


class Event:
    def __init__(self) -> None:
        self.time, self.stream = 0.0, None

    def record(self, stream: Stream) -> None:
        self.time, self.stream = stream.tail, stream


@dataclass
class Kernel:
    label: Any
    stream: Stream
    start: float
    end: float


class Timeline:
    """The backend :func:`~lightning_pipetransformer.devices.stand_in_streams` takes."""

    def __init__(self, launch_cost: float = 0.0, copy_cost: float = 0.0) -> None:
        self.copy_cost = copy_cost
        self.copies: list[Kernel] = []
        self.made: list[Stream] = []  # streams made by new_stream (callers' streams are not counted)
        self.current: dict[torch.device, Stream] = {}
        self.kernels: list[Kernel] = []
        self.launch_cost = launch_cost
        self.host = 0.0
        #: ("wait", waiter, producer), ("record", stream) and ("kernel", label, stream), in call order.
        self.log: list[tuple[Any, ...]] = []

    # -- the backend ------------------------------------------------------------------------

    def new_stream(self, device: torch.device) -> Stream:
        self.made.append(Stream(self, device, f"s{len(self.made)}"))
        return self.made[-1]

    def current_stream(self, device: torch.device) -> Stream:
        device = torch.device(device)
        if device not in self.current:
            self.current[device] = Stream(self, device, f"caller:{device}")
        return self.current[device]

    @contextlib.contextmanager
    def use_stream(self, stream: Stream):
        before = self.current_stream(stream.device)
        self.current[stream.device] = stream
        try:
            yield stream
        finally:
            self.current[stream.device] = before

    def new_event(self) -> Event:
        return Event()

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        self.log.append(("record", stream))

    def copy(self, src_device: torch.device, dst_device: torch.device) -> None:
        src, dst = self.current_stream(src_device), self.current_stream(dst_device)
        start = max(src.tail, dst.tail, self.host)
        src.tail = dst.tail = start + self.copy_cost
        self.copies.append(Kernel(("copy", str(src_device), str(dst_device)), src, start, src.tail))
        self.log.append(("copy", src, dst))

    # -- what the test's blocks do ------------------------------------------------------------

    def launch(self, device: torch.device, label: Any, duration: float = 1.0) -> Stream:
        """A kernel of ``duration`` on ``device``'s current stream; returns that stream."""
        stream = self.current_stream(device)
        self.host += self.launch_cost
        start = max(stream.tail, self.host)
        stream.tail = start + duration
        self.kernels.append(Kernel(label, stream, start, stream.tail))
        self.log.append(("kernel", label, stream))
        return stream

    def span(self, since: float = 0.0) -> float:
        """From ``since`` to the end of the last kernel."""
        return max(k.end for k in self.kernels) - since


class UnitKernel(torch.autograd.Function):
    """A block's work: a kernel on the current stream; its backward one on the same stream, as
    CUDA autograd runs each backward op on the stream its forward op ran on."""

    @staticmethod
    def forward(ctx: Any, timeline: Timeline, device: torch.device, label: Any, duration: float, x: torch.Tensor):
        ctx.timeline, ctx.label, ctx.duration = timeline, label, duration
        ctx.stream = timeline.launch(device, ("forward", *label), duration)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        with ctx.timeline.use_stream(ctx.stream):
            ctx.timeline.launch(ctx.stream.device, ("backward", *ctx.label), ctx.duration)
        return None, None, None, None, grad


class TimedBlock(torch.nn.Module):
    """A block whose forward is ``kernels`` kernels of ``duration`` each, labelled (block, micro-batch).

    The micro-batch index is read from the hidden state, which the tests fill with it.
    """

    def __init__(
        self, timeline: Timeline, index: int, kernels: int = 1, duration: float = 1.0, device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.timeline, self.index, self.kernels, self.duration = timeline, index, kernels, duration
        #: The (virtual) device its kernels run on: on CPU every tensor says "cpu".
        self.device = device
        self.weight = torch.nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        micro_batch = int(x[0, 0].item())
        for _ in range(self.kernels):
            x = UnitKernel.apply(self.timeline, self.device or x.device, (self.index, micro_batch), self.duration, x)
        return x * self.weight


def numbered_batch(chunks: int, per_chunk: int = 2) -> torch.Tensor:
    """A hidden state whose micro-batch ``i`` (of ``per_chunk`` rows) holds the value ``i``."""
    rows = torch.arange(chunks, dtype=torch.float).repeat_interleave(per_chunk)
    return rows[:, None].clone().requires_grad_(True)
