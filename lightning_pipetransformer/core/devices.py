"""Devices, streams and events: the only place the pipeline executor touches CUDA.

On CUDA every pipeline stage computes on a stream of its own, so stages overlap; a tensor
handed from one stream to another goes through :func:`hop`, which makes the receiving stream
wait on an event recorded on the sending stream and tells the caching allocator
(``record_stream``) that the tensor is now also read there, so its memory is not reused too
early. On CPU a "stream" is ``None``: every helper here is then a no-op (and :func:`hop` a plain
``Tensor.to``), so the executor runs the same code in the same order without any of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Optional, Union

import torch
from torch import Tensor

__all__: list[str] = []

#: A CUDA stream, or ``None`` for a CPU device (ops run in program order: nothing to order).
Stream = Optional[torch.cuda.Stream]
Device = Union[torch.device, str, int]


def as_device(device: Device) -> torch.device:
    """``torch.device`` with an explicit index for CUDA (``"cuda"`` -> ``cuda:<current>``).

    An index-less CUDA device compares unequal to the ``cuda:0`` a tensor reports, which would
    make every call look like a cross-device copy.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def new_stream(device: torch.device) -> Stream:
    """A fresh stream on ``device`` for one pipeline stage; ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device=device)


def current_stream(device: torch.device) -> Stream:
    """The caller's current stream on ``device``; ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device)


def use_stream(stream: Stream) -> Any:
    """Context that makes ``stream`` current on its device; does nothing for ``None``."""
    if stream is None:
        return nullcontext()
    return torch.cuda.stream(stream)


@contextmanager
def use_streams(first: Stream, second: Stream) -> Iterator[None]:
    """Make both streams current at once (a cross-device copy orders against both devices)."""
    with use_stream(first), use_stream(second):
        yield


def wait(waiter: Stream, producer: Stream) -> None:
    """Work queued on ``waiter`` from now on starts after everything queued on ``producer``."""
    if waiter is None or producer is None or waiter == producer:
        return
    event = torch.cuda.Event()
    event.record(producer)
    waiter.wait_event(event)


def record(tensor: Tensor, *streams: Stream) -> None:
    """Tell the caching allocator that ``tensor`` is also read on ``streams``.

    Without it, freeing ``tensor`` on the Python side lets the allocator hand its memory to
    new work on the stream that allocated it while another stream still reads it. Only
    streams of the tensor's own device are recorded: the allocator tracks uses per device.
    """
    if not tensor.is_cuda:
        return
    for stream in streams:
        if stream is not None and stream.device == tensor.device:
            tensor.record_stream(stream)


def _move(x: Tensor, src: Stream, dst: Stream, device: torch.device) -> Tensor:
    """Make ``x`` (ready on ``src``) usable on ``dst`` on ``device``; no autograd involved."""
    with use_streams(src, dst):
        # 'x' may still be being written on 'src': nothing on 'dst' may read it before that.
        wait(dst, src)
        # Same device: no copy, 'y' is 'x'. Across devices torch's copy kernel runs with
        # both current streams set above, so it is ordered against both sides.
        y = x.to(device)
        # 'x' is read on 'dst' (same device) or by the copy on 'src': keep its memory alive.
        record(x, src, dst)
    return y


class _Hop(torch.autograd.Function):
    """Hand a tensor from one stream (and device) to another; gradients take the way back."""

    @staticmethod
    def forward(ctx: Any, src: Stream, dst: Stream, device: torch.device, x: Tensor) -> Tensor:
        ctx.src, ctx.dst, ctx.src_device = src, dst, x.device
        return _move(x, src, dst, device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None, Tensor]:
        # The gradient is produced on 'dst' (autograd runs each backward op on the stream of
        # its forward op) and consumed by ops that ran on 'src' in the forward.
        return None, None, None, _move(grad, ctx.dst, ctx.src, ctx.src_device)


def hop(x: Tensor, src: Stream, dst: Stream, device: torch.device) -> Tensor:
    """``x`` (produced on stream ``src``) made ready for stream ``dst`` on ``device``.

    CPU to CPU this is ``x.to(device)``, i.e. ``x`` itself: no copy and no autograd node.
    """
    if src is None and dst is None:
        return x.to(device)
    if x.requires_grad and torch.is_grad_enabled():
        # Called with 'dst' current so autograd records 'dst' as this node's stream.
        with use_stream(dst):
            return _Hop.apply(src, dst, device, x)
    return _move(x, src, dst, device)
