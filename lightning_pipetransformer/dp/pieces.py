"""Tensors cut into messages of bounded size, and the fixed ring of staging buffers they travel through.

Shared by the state transfer to joining replicas (:mod:`~lightning_pipetransformer.dp.state_transfer`,
point to point along a tree) and the gradient average by hand (:mod:`~lightning_pipetransformer.dp.averaging`,
all-reduces): both send many tensors of mixed sizes through a process's own device, where NCCL wants
them, without staging more than a few pieces at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch

from lightning_pipetransformer import devices as dev

__all__ = ["CHUNK_BYTES", "COALESCE_BYTES", "Piece", "Request", "StagingRing", "blocks", "itemsize", "pack", "pieces", "unpack"]

#: Tensors are sent in pieces of at most this many bytes, so that a rank that has received a piece
#: forwards it while the next one arrives (a pipelined tree, see :func:`~lightning_pipetransformer.dp.state_transfer.transfer_tree`).
CHUNK_BYTES = 16 << 20


#: Tensors smaller than this are copied together into one staging buffer per piece (one message
#: instead of hundreds of tiny ones); larger contiguous tensors go straight from and into their
#: own memory, with no staging copy.
COALESCE_BYTES = 1 << 20


class Piece(NamedTuple):
    """One message: a slice of a large tensor sent from (received into) its own memory
    (``direct``), or a staging buffer of ``numel`` elements standing for ``targets`` in order."""

    direct: torch.Tensor | None
    targets: list[torch.Tensor]
    dtype: torch.dtype
    numel: int
    #: Where the message lives: the tensor's device (direct), or the staging device.
    device: torch.device


class Request:
    """A point-to-point request, waited at most once: gloo's ``wait`` is not idempotent (a second
    call waits for another message)."""

    def __init__(self, work: Any) -> None:
        self.work, self.waited = work, False

    def wait(self) -> None:
        if not self.waited:
            self.work.wait()
            self.waited = True


class StagingRing:
    """``slots`` staging buffers per device, taken in turn; a slot is handed out again only after
    every transfer that used it is known done.

    Why a ring and why "known done": under NCCL ``Work.wait()`` returns at once (it only makes the
    current stream wait) and the caching allocator keeps a buffer a point-to-point op used until
    the NCCL stream has passed it, so dropping each piece's buffer and allocating the next bounds
    nothing: the host runs ahead and every piece is staged at once. Here the memory is fixed
    (``slots`` buffers of the largest piece) whatever the backend, and before a slot is reused the
    host waits for its last transfers (:func:`~lightning_pipetransformer.devices.host_catches_up`
    after ``Work.wait()``: on CUDA an event recorded after the waits, synchronised).
    """

    def __init__(self, slots: int) -> None:
        self._buffers: list[dict[torch.device, torch.Tensor]] = [{} for _ in range(slots)]
        self._users: list[list[tuple[Request, torch.device]]] = [[] for _ in range(slots)]
        self._next = 0

    def take(self, piece: Piece) -> tuple[int, torch.Tensor]:
        """The next slot (waiting for its last transfers), viewed as ``piece``'s message."""
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        self.settle(slot)
        nbytes = piece.numel * itemsize(piece.dtype)
        buffer = self._buffers[slot].get(piece.device)
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=piece.device)
            dev.tag_as(buffer, piece.device)
            self._buffers[slot][piece.device] = buffer
        message = buffer[:nbytes].view(piece.dtype)
        dev.tag_as(message, piece.device)
        return slot, message

    def used_by(self, slot: int, requests: list[Request], device: torch.device) -> None:
        """``requests`` read or write slot ``slot``: it is not handed out again before they are done."""
        self._users[slot].extend((request, device) for request in requests)

    def settle(self, slot: int | None = None) -> None:
        """Block until the transfers of ``slot`` (default: of every slot) are done."""
        devices: set[torch.device] = set()
        for index in range(len(self._users)) if slot is None else (slot,):
            for request, device in self._users[index]:
                request.wait()
                devices.add(device)
            self._users[index] = []
        for device in devices:
            dev.host_catches_up(device)


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def pieces(
    tensors: Sequence[torch.Tensor], chunk_bytes: int, via: torch.device | None = None,
) -> Iterator[Piece]:
    """The messages for ``tensors``, in order: slices of large contiguous tensors sent from their
    own memory, and staged pieces (coalesced small tensors of one dtype, or slices that are not
    contiguous or not on ``via``) that the caller gives a staging buffer. With ``via``, every
    tensor not on ``via`` is staged through buffers there. No memory is allocated here."""
    small: list[torch.Tensor] = []

    def staged(targets: list[torch.Tensor], dtype: torch.dtype) -> Piece:
        device = via if via is not None else dev.device_of(targets[0])
        return Piece(None, list(targets), dtype, sum(t.numel() for t in targets), device)

    def flush() -> Iterator[Piece]:
        if small:
            yield staged(small, small[0].dtype)
            small.clear()

    for t in tensors:
        if t.numel() == 0:
            continue
        direct = via is None or dev.device_of(t) == via
        nbytes = t.numel() * t.element_size()
        if nbytes >= COALESCE_BYTES or nbytes > chunk_bytes:
            yield from flush()
            for block in blocks(t, max(1, chunk_bytes // t.element_size())):
                if direct and block.is_contiguous():
                    dev.tag_as(block, dev.device_of(t))
                    yield Piece(block, [], t.dtype, block.numel(), dev.device_of(t))
                else:  # on another device, or not contiguous: through a buffer of one piece
                    yield staged([block], t.dtype)
            continue
        if small and (
            small[0].dtype != t.dtype
            or (via is None and dev.device_of(small[0]) != dev.device_of(t))
            or (sum(s.numel() for s in small) + t.numel()) * t.element_size() > chunk_bytes
        ):
            yield from flush()
        small.append(t)
    yield from flush()


def blocks(t: torch.Tensor, numel: int) -> Iterator[torch.Tensor]:
    """Views covering ``t`` in order, of at most ``numel`` elements each (one element at least):
    runs of rows, or the rows' own blocks where one row is larger.

    The cut depends on the shape alone, so sender and receiver cut alike whatever their strides;
    the views of a contiguous tensor are contiguous (and can be sent from its own memory).
    """
    if t.numel() <= numel or t.dim() == 0:
        yield t
        return
    row = t[0].numel()
    if row <= numel:
        rows = numel // row
        for start in range(0, t.shape[0], rows):
            yield t[start : start + rows]
        return
    for index in range(t.shape[0]):
        yield from blocks(t[index], numel)


def pack(buffer: torch.Tensor, targets: list[torch.Tensor]) -> None:
    offset = 0
    for t in targets:
        buffer[offset : offset + t.numel()].view(t.shape).copy_(t)
        offset += t.numel()


def unpack(buffer: torch.Tensor, targets: list[torch.Tensor]) -> None:
    offset = 0
    for t in targets:
        t.copy_(buffer[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
