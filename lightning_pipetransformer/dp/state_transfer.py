"""State transfer to joining replicas, through each process's root device.

When the pipeline shrinks, shadow ranks become replicas: they receive the model, optimizer,
scheduler and AutoFreeze state from global rank 0, in pieces of bounded size along a tree. The
pieces and the staging ring are shared with the gradient average by hand
(:mod:`~lightning_pipetransformer.dp.averaging`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipetransformer import devices as dev
from lightning_pipetransformer.freeze.seam import FreezeSource

#: Tensors are sent in pieces of at most this many bytes, so that a rank that has received a piece
#: forwards it while the next one arrives (a pipelined tree, see :func:`transfer_tree`).
CHUNK_BYTES = 16 << 20


#: Tensors smaller than this are copied together into one staging buffer per piece (one message
#: instead of hundreds of tiny ones); larger contiguous tensors go straight from and into their
#: own memory, with no staging copy.
COALESCE_BYTES = 1 << 20


#: Optimizer-state tensors smaller than this ('step' counters, tiny buffers) travel (on the CPU)
#: inside the pickled structure of :func:`broadcast_state` instead of as messages.
PICKLE_BYTES = 64 << 10


def transfer_tree(src: int, receivers: Sequence[int]) -> dict[int, tuple[int | None, list[int]]]:
    """``{rank: (parent, children)}`` of a binomial tree over ``src`` and ``receivers``.

    Position ``i`` in ``[src, *receivers]`` gets the data from position ``i - 2**floor(log2 i)``:
    in round ``k`` every rank that already has it sends to one that has not, so ``R`` receivers
    take ``ceil(log2(R + 1))`` rounds and ``src`` sends at most that many copies. Ranks that are
    neither ``src`` nor a receiver are not in the tree and take no part.
    """
    order = [src] + [r for r in dict.fromkeys(receivers) if r != src]
    tree: dict[int, tuple[int | None, list[int]]] = {r: (None, []) for r in order}
    for i in range(1, len(order)):
        parent = order[i - (1 << (i.bit_length() - 1))]
        tree[order[i]] = (parent, tree[order[i]][1])
        tree[parent][1].append(order[i])
    return tree


def _receivers_of(src: int, receivers: Sequence[int] | None, group: Any) -> list[int]:
    if receivers is None:  # every other member of the group
        receivers = dist.get_process_group_ranks(group)
    return sorted(r for r in set(receivers) if r != src)


def send_tensors(
    tensors: Sequence[torch.Tensor], src: int, receivers: Sequence[int] | None, group: Any,
    chunk_bytes: int = CHUNK_BYTES, via: torch.device | None = None,
) -> None:
    """Copy ``tensors`` from global rank ``src`` into the same-shaped ``tensors`` of each receiver, in place.

    ``src`` and every receiver (global ranks, members of ``group``; ``None``: all other members)
    call this with tensors of the same shapes and dtypes in the same order; any other rank may
    call it too and returns at once. Point-to-point messages on ``group`` along
    :func:`transfer_tree`, in pieces of at most ``chunk_bytes`` that a receiver forwards as soon as
    it has them; each message waits at most the group's timeout. Bit-exact: bytes are copied, no
    arithmetic. ``via``: the process's own device, the one its groups are bound to (NCCL refuses
    tensors on others): tensors elsewhere (a pipeline stage on another GPU) travel through
    staging buffers there.
    """
    rank = dist.get_rank()
    tree = transfer_tree(src, _receivers_of(src, receivers, group))
    if rank not in tree or len(tree) == 1:
        return
    parent, children = tree[rank]
    _relay(_pieces(tensors, chunk_bytes, via), parent, children, group)


#: Pieces a rank holds at once (receives posted ahead, and pieces still being sent on): the
#: process's device holds at most this many staging buffers of ``chunk_bytes`` (a fixed ring).
IN_FLIGHT = 4


class _Piece(NamedTuple):
    """One message: a slice of a large tensor sent from (received into) its own memory
    (``direct``), or a staging buffer of ``numel`` elements standing for ``targets`` in order."""

    direct: torch.Tensor | None
    targets: list[torch.Tensor]
    dtype: torch.dtype
    numel: int
    #: Where the message lives: the tensor's device (direct), or the staging device.
    device: torch.device


class _Request:
    """A point-to-point request, waited at most once: gloo's ``wait`` is not idempotent (a second
    call waits for another message)."""

    def __init__(self, work: Any) -> None:
        self.work, self.waited = work, False

    def wait(self) -> None:
        if not self.waited:
            self.work.wait()
            self.waited = True


class _StagingRing:
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
        self._users: list[list[tuple[_Request, torch.device]]] = [[] for _ in range(slots)]
        self._next = 0

    def take(self, piece: _Piece) -> tuple[int, torch.Tensor]:
        """The next slot (waiting for its last transfers), viewed as ``piece``'s message."""
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        self.settle(slot)
        nbytes = piece.numel * _itemsize(piece.dtype)
        buffer = self._buffers[slot].get(piece.device)
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=piece.device)
            dev.tag_as(buffer, piece.device)
            self._buffers[slot][piece.device] = buffer
        message = buffer[:nbytes].view(piece.dtype)
        dev.tag_as(message, piece.device)
        return slot, message

    def used_by(self, slot: int, requests: list[_Request], device: torch.device) -> None:
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


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _relay(
    pieces: Iterator[_Piece], parent: int | None, children: list[int], group: Any, in_flight: int = IN_FLIGHT,
) -> None:
    """Receive each piece from ``parent`` (none at the root), then send it to ``children``, in order.

    A window of ``in_flight`` pieces: the next pieces' receives are posted while the current one
    is unpacked and sent on, so the tree stays pipelined. Staged pieces live in a fixed ring of
    ``in_flight`` buffers on the process's device (:class:`_StagingRing`): peak staging is
    ``in_flight`` pieces on every backend, whether or not ``Work.wait()`` blocks the host.
    """
    ring = _StagingRing(in_flight)
    # Posted, oldest first: (message, piece, slot or None, receive or None).
    receiving: deque[tuple[torch.Tensor, _Piece, int | None, _Request | None]] = deque()
    sending: deque[list[_Request]] = deque()  # sent on, not yet delivered
    pending = True
    while True:
        while pending and len(receiving) + len(sending) < in_flight:
            piece = next(pieces, None)
            if piece is None:
                pending = False
                break
            slot, message = (None, piece.direct) if piece.direct is not None else ring.take(piece)
            dev.check_collective(message, "state transfer to a joining replica")
            work = _Request(dist.irecv(message, src=parent, group=group)) if parent is not None else None
            receiving.append((message, piece, slot, work))
        if not receiving:
            break
        message, piece, slot, work = receiving.popleft()
        if work is not None:
            work.wait()  # the unpack and the sends below are ordered after the receive (the stream waits on NCCL)
            if slot is not None:
                ring.used_by(slot, [work], piece.device)
                _unpack(message, piece.targets)
        elif slot is not None:
            _pack(message, piece.targets)
        works = [_Request(dist.isend(message, dst=child, group=group)) for child in children]
        sending.append(works)
        if slot is not None:
            ring.used_by(slot, works, piece.device)
        while sending and len(receiving) + len(sending) >= in_flight:
            for done in sending.popleft():  # a full window: the oldest piece must be delivered first
                done.wait()
    for works in sending:
        for done in works:
            done.wait()
    ring.settle()  # the next transfer starts from a free ring; an error leaves the buffers to the group's abort


def _pieces(
    tensors: Sequence[torch.Tensor], chunk_bytes: int, via: torch.device | None = None,
) -> Iterator[_Piece]:
    """The messages for ``tensors``, in order: slices of large contiguous tensors sent from their
    own memory, and staged pieces (coalesced small tensors of one dtype, or slices that are not
    contiguous or not on ``via``) that the caller gives a staging buffer. With ``via``, every
    tensor not on ``via`` is staged through buffers there. No memory is allocated here."""
    small: list[torch.Tensor] = []

    def staged(targets: list[torch.Tensor], dtype: torch.dtype) -> _Piece:
        device = via if via is not None else dev.device_of(targets[0])
        return _Piece(None, list(targets), dtype, sum(t.numel() for t in targets), device)

    def flush() -> Iterator[_Piece]:
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
            for block in _blocks(t, max(1, chunk_bytes // t.element_size())):
                if direct and block.is_contiguous():
                    dev.tag_as(block, dev.device_of(t))
                    yield _Piece(block, [], t.dtype, block.numel(), dev.device_of(t))
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


def _blocks(t: torch.Tensor, numel: int) -> Iterator[torch.Tensor]:
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
        yield from _blocks(t[index], numel)


def _pack(buffer: torch.Tensor, targets: list[torch.Tensor]) -> None:
    offset = 0
    for t in targets:
        buffer[offset : offset + t.numel()].view(t.shape).copy_(t)
        offset += t.numel()


def _unpack(buffer: torch.Tensor, targets: list[torch.Tensor]) -> None:
    offset = 0
    for t in targets:
        t.copy_(buffer[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()


def module_state_tensors(module: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``module``'s parameters and buffers (detached, sharing memory), each storage once."""
    seen: set[tuple[int, int, torch.dtype]] = set()

    def unique(tensors: Iterator[torch.Tensor]) -> list[torch.Tensor]:
        kept = []
        for t in tensors:
            key = (t.data_ptr(), t.numel(), t.dtype)
            if key not in seen:  # tied weights are sent once
                seen.add(key)
                kept.append(t.detach())
        return kept

    return unique(module.parameters()), unique(module.buffers())


def broadcast_module_state(
    module: nn.Module, src: int, group: Any, receivers: Sequence[int] | None = None, via: torch.device | None = None,
) -> None:
    """``module``'s parameters from global rank ``src`` to ``receivers``, its buffers to all of ``group``.

    Every member of ``group`` calls this. ``receivers`` (global ranks; default: every other member)
    get the parameters straight into their own memory, with no staging copy for the large ones
    (see :func:`send_tensors`). Buffers (running statistics and the like: small, and replicas'
    may differ after their last forward) go to every member, so that all replicas start from
    ``src``'s.
    """
    params, buffers = module_state_tensors(module)
    with torch.no_grad():
        send_tensors(buffers, src, None, group, via=via)
        send_tensors(params, src, receivers, group, via=via)


def broadcast_state(
    state: Any, src: int, group: Any, receivers: Sequence[int] | None = None, via: torch.device | None = None,
) -> Any:
    """A nested state (optimizer and scheduler state dicts) from global rank ``src`` to ``receivers``.

    ``receivers``: global ranks (default: all other members of ``group``); other ranks may call
    this and get ``None``. The structure and the small tensors go as one pickled object along the
    tree, the large tensors as messages (:func:`send_tensors`; no pickling of hundreds of MB of
    momentum). Received large tensors are on the device kind ``src`` had them on (CPU, or this
    rank's current CUDA device); ``Optimizer.load_state_dict`` moves them to each parameter's
    device. Returns the state (on ``src``: as given).
    """
    rank = dist.get_rank()
    receivers = _receivers_of(src, receivers, group)
    tree = transfer_tree(src, receivers)
    if rank not in tree:
        return None
    tensors: list[torch.Tensor] = []
    message = None
    if rank == src:
        skeleton = _skeleton(state, tensors)
        message = (skeleton, [(tuple(t.shape), t.dtype, t.device.type) for t in tensors])
    skeleton, specs = _send_object(message, tree, group)
    if rank != src:
        tensors = [_empty(shape, dtype, via if via is not None else _device_of_kind(kind)) for shape, dtype, kind in specs]
    send_tensors(tensors, src, receivers, group, via=via)
    return state if rank == src else _fill(skeleton, tensors)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=dtype, device=device)
    dev.tag_as(tensor, device)
    return tensor


def _device_of_kind(kind: str) -> torch.device:
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def _send_object(obj: Any, tree: dict[int, tuple[int | None, list[int]]], group: Any) -> Any:
    """A small picklable object from the tree's root to every rank in it (one message per edge)."""
    import pickle

    parent, children = tree[dist.get_rank()]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    if parent is None:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.empty(1, dtype=torch.int64, device=device)
        dist.recv(size, src=parent, group=group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.recv(payload, src=parent, group=group)
        obj = pickle.loads(payload.cpu().numpy().tobytes())
    works = [w for child in children for w in (dist.isend(size, dst=child, group=group), dist.isend(payload, dst=child, group=group))]
    for work in works:
        work.wait()
    return obj


def without_state_of(optimizer_state: dict[str, Any], optimizer: torch.optim.Optimizer, params: Any) -> dict[str, Any]:
    """``optimizer_state`` (``optimizer.state_dict()``) without the per-parameter state of ``params``.

    For parameters that AutoFreeze has frozen: they never thaw, so a new replica never reads
    their momentum; ``Optimizer.load_state_dict`` accepts a state without their entries.
    """
    dropped = {id(p) for p in params}
    indices = {i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]) if id(p) in dropped}
    return {**optimizer_state, "state": {k: v for k, v in optimizer_state["state"].items() if k not in indices}}


def frozen_for_good(autofreeze: FreezeSource | None) -> list[nn.Parameter]:
    """The parameters AutoFreeze has frozen (``requires_grad`` off): they never thaw."""
    if autofreeze is None or autofreeze.stack is None or not autofreeze.num_frozen:
        return []
    from lightning_pipetransformer.freeze.apply import frozen_parameters

    params = frozen_parameters(autofreeze.stack, autofreeze.num_frozen, autofreeze.freeze_embeddings)
    return [p for p in params if not p.requires_grad]


class _TensorSlot:
    def __init__(self, index: int) -> None:
        self.index = index


def _skeleton(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() * value.element_size() < PICKLE_BYTES:
            return value.detach().cpu().clone()  # pickled with the structure
        tensors.append(value.detach())
        return _TensorSlot(len(tensors) - 1)
    if isinstance(value, dict):
        return {k: _skeleton(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_skeleton(v, tensors) for v in value)
    return value


def _fill(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, _TensorSlot):
        return tensors[value.index]
    if isinstance(value, dict):
        return {k: _fill(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_fill(v, tensors) for v in value)
    return value
