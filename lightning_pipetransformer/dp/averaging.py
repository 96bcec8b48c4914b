"""The replicas' mean gradient by hand, after backward, as DDP averages: for replicas of several stages.

Why by hand: a replica whose pipeline stages span several devices cannot be wrapped in DDP (its
buckets would live on every device, the process's groups only on its own), so
:class:`~lightning_pipetransformer.dp.ddp.GradientSync` calls :func:`average_gradients` after the
step's last backward. The gradients travel in the same pieces as the state sent to joining
replicas (:mod:`~lightning_pipetransformer.dp.state_transfer`): slices of large ones reduced in
place, small ones packed into one staging buffer on the process's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipetransformer import devices as dev
from lightning_pipetransformer.dp.pieces import CHUNK_BYTES, StagingRing, pack, pieces, unpack

__all__ = ["average_gradients", "average_op", "used_anywhere"]


def average_op(group: Any) -> tuple[Any, bool]:
    """``(op, divide_after)``: ``ReduceOp.AVG`` where the group's backend has it (NCCL; gloo since
    torch 2.8, where it is a sum and a division inside gloo), else a sum the caller divides."""
    if dist.get_backend(group) == "gloo" and _torch_version() < (2, 8):
        return dist.ReduceOp.SUM, True
    return dist.ReduceOp.AVG, False


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def used_anywhere(params: Sequence[torch.Tensor], host_group: Any) -> list[bool]:
    """For each parameter: whether any replica of ``host_group`` gave it a gradient this step.

    Which gradients are ``None`` is known on each host; so the flags, a byte per parameter, are
    all-reduced (MAX) on the host, over the active group's gloo twin
    (:func:`~lightning_pipetransformer.dp.groups.host_twin`), and read there. Why not on the device:
    under NCCL the result read back would make the host wait for the whole backward queued before
    the all-reduce, at every step (as DDP's ``find_unused_parameters`` does); over gloo the host
    waits only for the other hosts to reach this point, and the GPU keeps running. Exact at every
    step: a parameter used on some steps only (a routed expert) is seen on each of them.
    """
    flags = torch.tensor([param.grad is not None for param in params], dtype=torch.uint8)  # host data, never on a GPU
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=host_group)
    return [bool(flag) for flag in flags.tolist()]


def average_gradients(
    params: Sequence[torch.Tensor], group: Any, via: torch.device, host_group: Any, chunk_bytes: int = CHUNK_BYTES
) -> None:
    """The replicas' mean gradient of ``params``, in place, through buffers on ``via``, as DDP averages.

    For a replica whose pipeline stages span several devices, where DDP cannot be used (its
    buckets live on every device, the process's groups only on ``via``). Every active rank calls
    this after its last backward of the step, with the same parameters in the same order
    (``host_group``: the same ranks over gloo, for the flags of :func:`used_anywhere`).
    DDP's semantics: a parameter no replica used keeps ``grad = None`` (so AdamW's weight decay
    and momentum leave it alone, as with one process); one that some replica used and this one
    did not counts as zero here (and gets a gradient). Each piece (a slice of a large gradient on
    ``via``, reduced in place, or up to ``chunk_bytes`` of small or off-``via`` gradients packed into
    one staging buffer, reused piece after piece) is one all-reduce with the average op.
    """
    if not params:
        return  # everything frozen: the same on every replica, so no rank enters the collectives
    used = used_anywhere(params, host_group)
    grads = []
    for param, anywhere in zip(params, used):
        if not anywhere:
            continue  # no replica used it: no gradient, as with one process
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dev.tag_as(param.grad, dev.device_of(param))  # test mode: a gradient is where its parameter is
        grads.append(param.grad)
    op, divide_after = average_op(group)
    world = dist.get_world_size(group)
    # One staging buffer per device, reused: pack, all-reduce and unpack all run in order on the
    # current stream (a blocking collective makes it wait for NCCL), so reuse needs no host wait.
    staging = StagingRing(1)
    with torch.no_grad():
        for piece in pieces(grads, chunk_bytes, via):
            message = piece.direct
            if message is None:
                _, message = staging.take(piece)
                pack(message, piece.targets)
            dev.check_collective(message, "gradient averaging")
            dist.all_reduce(message, op=op, group=group)
            if divide_after:
                message.div_(world)
            if piece.direct is None:
                unpack(message, piece.targets)
