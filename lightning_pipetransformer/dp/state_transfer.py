"""State transfer to joining replicas, through each process's root device.

When the pipeline shrinks, shadow ranks become replicas: they receive the model, optimizer,
scheduler and AutoFreeze state from global rank 0, in pieces of bounded size along a tree. The
pieces and the staging ring (:mod:`~lightning_pipetransformer.dp.pieces`) are shared with the
gradient average by hand (:mod:`~lightning_pipetransformer.dp.averaging`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipetransformer import devices as dev
from lightning_pipetransformer.dp.pieces import CHUNK_BYTES, Piece, Request, StagingRing, pack, pieces, unpack
from lightning_pipetransformer.freeze.seam import FreezeSource

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
    _relay(pieces(tensors, chunk_bytes, via), parent, children, group)


#: Pieces a rank holds at once (receives posted ahead, and pieces still being sent on): the
#: process's device holds at most this many staging buffers of ``chunk_bytes`` (a fixed ring).
IN_FLIGHT = 4


def _relay(
    messages: Iterator[Piece], parent: int | None, children: list[int], group: Any, in_flight: int = IN_FLIGHT,
) -> None:
    """Receive each of ``messages`` from ``parent`` (none at the root), then send it to ``children``, in order.

    A window of ``in_flight`` pieces: the next pieces' receives are posted while the current one
    is unpacked and sent on, so the tree stays pipelined. Staged pieces live in a fixed ring of
    ``in_flight`` buffers on the process's device (:class:`StagingRing`): peak staging is
    ``in_flight`` pieces on every backend, whether or not ``Work.wait()`` blocks the host.
    """
    ring = StagingRing(in_flight)
    # Posted, oldest first: (message, piece, slot or None, receive or None).
    receiving: deque[tuple[torch.Tensor, Piece, int | None, Request | None]] = deque()
    sending: deque[list[Request]] = deque()  # sent on, not yet delivered
    pending = True
    while True:
        while pending and len(receiving) + len(sending) < in_flight:
            piece = next(messages, None)
            if piece is None:
                pending = False
                break
            slot, message = (None, piece.direct) if piece.direct is not None else ring.take(piece)
            dev.check_collective(message, "state transfer to a joining replica")
            work = Request(dist.irecv(message, src=parent, group=group)) if parent is not None else None
            receiving.append((message, piece, slot, work))
        if not receiving:
            break
        message, piece, slot, work = receiving.popleft()
        if work is not None:
            work.wait()  # the unpack and the sends below are ordered after the receive (the stream waits on NCCL)
            if slot is not None:
                ring.used_by(slot, [work], piece.device)
                unpack(message, piece.targets)
        elif slot is not None:
            pack(message, piece.targets)
        works = [Request(dist.isend(message, dst=child, group=group)) for child in children]
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
