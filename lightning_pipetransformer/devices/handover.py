"""The cross-device hop: a tensor handed from one stage's stream (and device) to the next, gradients the way back.

:func:`hop` makes the receiving stream wait on the sending one (an event) and records the tensor
on it for the caching allocator (:mod:`~.streams`); across devices the copy runs on the two
devices' copy streams, so it overlaps the producer's next micro-batch. CPU to CPU it is a plain
``Tensor.to``: no copy and no autograd node.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_pipetransformer.devices.streams import Stream, copy_between_devices, copy_streams, record, use_stream, use_streams, wait

__all__ = ["hop"]


def _same_device(a: Any, b: Any) -> bool:
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def _move(x: Tensor, src: Stream, dst: Stream, device: torch.device) -> Tensor:
    """Make ``x`` (ready on ``src``) usable on ``dst`` on ``device``; no autograd involved."""
    if src is not None and dst is not None and not _same_device(src.device, dst.device):
        return _move_across(x, src, dst, device)
    with use_streams(src, dst):
        # 'x' may still be being written on 'src': nothing on 'dst' may read it before that.
        wait(dst, src)
        # Same device: no copy, 'y' is 'x'. Across devices torch's copy kernel runs with
        # both current streams set above, so it is ordered against both sides.
        y = x.to(device)
        # 'x' is read on 'dst' (same device) or by the copy on 'src': keep its memory alive.
        record(x, src, dst)
    return y


def _move_across(x: Tensor, src: Stream, dst: Stream, device: torch.device) -> Tensor:
    """A hand-over between devices, on the two devices' copy streams.

    torch runs a copy between GPUs on the source device's current stream, after both devices'
    current streams' earlier work, and makes the destination's current stream wait for it. With
    the copy streams current, that is: the copy waits for ``x``'s producer (``src``) and earlier
    copies only, and ``dst`` waits for the copy; the producer's next micro-batch does not.
    """
    src_copy, dst_copy = copy_streams(src.device, device)
    with use_streams(src_copy, dst_copy):
        wait(src_copy, src)  # the copy reads 'x' once its producer wrote it
        y = copy_between_devices(x, src.device, device)
        record(x, src_copy)  # read by the copy: not reused on 'src' before it is done
    wait(dst, dst_copy)  # the consumer reads 'y' once copied
    record(y, dst)  # made on the copy stream, read on 'dst'
    return y


class _Hop(torch.autograd.Function):
    """Hand a tensor from one stream (and device) to another; gradients take the way back."""

    @staticmethod
    def forward(ctx: Any, src: Stream, dst: Stream, device: torch.device, x: Tensor) -> Tensor:
        # The producer's device: where the gradient goes back to (its stream's, which stand-in streams keep apart on CPU).
        ctx.src, ctx.dst, ctx.src_device = src, dst, src.device if src is not None else x.device
        y = _move(x, src, dst, device)
        # Same device: 'y' is 'x'. Returned as is, autograd would make it a view created in a
        # custom Function, and an in-place op on a stage's input would raise (torchgpipe's Wait
        # returns detached tensors for the same reason).
        return y.detach() if y is x else y

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
