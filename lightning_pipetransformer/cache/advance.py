"""Boundary moves: the entries stored at boundary F carried to boundary F' without recomputing them.

When the boundary moves F -> F' (:func:`advance_store`), every entry at F goes through blocks
F..F'-1 only, never again from the input, and is stored under the new prefix's fingerprint. The
blocks' inputs come from the entry itself: stored with it by the per-batch path
(:func:`~lightning_pipetransformer.cache.arguments.pack_block_inputs`), read back by
:func:`~lightning_pipetransformer.cache.arguments.unpack_block_inputs`. With several processes on a
node, :func:`shard_of` splits the directory's entries among them.

Entries are grouped by shape (one block call per group of ``batch_size``), so the entries read and
not yet advanced sit on the host in part-filled groups: with many shapes (dynamic padding: one per
length) and few entries each, that was every entry of the boundary at once. The groups together
hold at most ``max_held_bytes`` (plus the entry just read, whose size is known once it is read): an
entry that would pass it flushes the largest part-filled groups first (smaller block calls, the same
results: each entry's computation is its own).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_pipetransformer.cache.arguments import INPUTS_MARKER, unpack_block_inputs
from lightning_pipetransformer.cache.store import ActivationStore, StoredEntry
from lightning_pipetransformer.stack.stack_call import hidden_of

__all__ = ["MAX_HELD_BYTES", "advance_store", "shard_of"]

#: Host bytes the part-filled groups of an advance hold at most (entries read, not yet advanced):
#: about 8 groups of 32 entries of 512 x 1024 fp32 activations. Large enough that groups still fill
#: where the shapes are few; the bound is what matters where they are many.
MAX_HELD_BYTES = 512 << 20


def shard_of(key: str, num_shards: int) -> int:
    """Which of ``num_shards`` processes advances ``key`` (stable across processes and runs)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") % num_shards


def _signature(entry: StoredEntry) -> tuple:
    """Entries with equal signatures can be stacked into one batch and run with one block call."""
    parts: list[Any] = [tuple(entry.hidden.shape), entry.hidden.dtype]
    for name in sorted(entry.extras):
        t = entry.extras[name]
        parts.append((name, tuple(t.shape), t.dtype, t.item() if name.startswith("s.") else None))
    return tuple(parts)


def _nbytes(entry: StoredEntry) -> int:
    return entry.hidden.nbytes + sum(t.nbytes for t in entry.extras.values())


@dataclass
class _Group:
    """Entries of one signature waiting for their block call, and their host bytes."""

    entries: list[tuple[str, StoredEntry]] = field(default_factory=list)
    nbytes: int = 0


def advance_store(
    src: ActivationStore,
    dst: ActivationStore,
    run: Callable[..., Any],
    *,
    batch_size: int = 32,
    device: torch.device | str | None = None,
    shard: tuple[int, int] = (0, 1),
    max_held_bytes: int = MAX_HELD_BYTES,
) -> int:
    """Advance entries of ``src`` (boundary F) through blocks F..F'-1 into ``dst`` (boundary F'); return how many.

    Args:
        run: ``run(hidden, calls)`` runs blocks F..F'-1 exactly as the model's loop does, block
            ``F + i`` with ``calls[i]`` (its stored ``(args, kwargs)``), and returns the hidden
            state (or a block output :func:`~lightning_pipetransformer.stack.stack_call.hidden_of` reads). It is called under
            ``torch.no_grad()``.
        batch_size: entries per call of ``run``.
        device: where ``run`` computes (inputs are moved there); default CPU.
        shard: ``(rank, world)``: with several processes on one node, each advances the disk
            entries with ``shard_of(key, world) == rank`` plus the entries only it holds in
            memory. Then (after a barrier) one process may ``src.close(delete=True)``.
        max_held_bytes: host bytes the part-filled groups may hold together; an entry that would
            pass it flushes the largest groups first (one entry larger than it is advanced alone).

    Advanced entries leave ``src``'s memory (their files stay until ``src.close(delete=True)``), so
    with equal budgets the two stores together hold about one budget. Entries already in ``dst``
    are skipped, so an interrupted advance can simply be rerun.
    Entries stored without block inputs cannot be advanced: ``ValueError``.
    """
    if dst.boundary <= src.boundary:
        raise ValueError(f"advance_store goes forward only: boundary {src.boundary} -> {dst.boundary}.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}.")
    if isinstance(max_held_bytes, bool) or not isinstance(max_held_bytes, int) or max_held_bytes < 0:
        raise ValueError(f"max_held_bytes must be a non-negative int of bytes, got {max_held_bytes!r}.")
    rank, world = shard
    target = torch.device(device) if device is not None else torch.device("cpu")
    todo = [
        k
        for k in src.keys()
        if (src.in_memory(k) and not src.on_disk(k)) or shard_of(k, world) == rank
    ]
    groups: dict[tuple, _Group] = {}
    advanced = 0
    held = 0  # host bytes of the entries in groups

    def flush(signature: tuple) -> None:
        nonlocal advanced, held
        taken = groups.pop(signature)
        held -= taken.nbytes
        group = taken.entries
        keys = [k for k, _ in group]
        hidden = torch.stack([e.hidden for _, e in group]).to(target)
        extras = {n: torch.stack([e.extras[n] for _, e in group]) for n in group[0][1].extras}
        calls = unpack_block_inputs({n: t.to(target) for n, t in extras.items()}, range(src.boundary, dst.boundary))
        with torch.no_grad():
            out = run(hidden, calls)
        out = out if isinstance(out, Tensor) else hidden_of(out)
        dst.store(keys, out, extras, check_fits=False)  # a group of entries, not a training batch: it may spill
        # The old entries are done: free their memory so src + dst stay within about one budget
        # (plus one group) instead of two.
        src.discard(keys)
        advanced += len(keys)

    for key in todo:
        if dst.in_memory(key) or dst.on_disk(key):
            continue
        entry = src.read(key)
        if entry is None:  # removed or rejected meanwhile: it will simply miss
            continue
        if INPUTS_MARKER not in entry.extras:
            raise ValueError(
                f"Entry {key!r} at boundary {src.boundary} was stored without its block inputs, so it cannot "
                "be advanced: store entries with extras=pack_block_inputs(calls, first_block, B)."
            )
        size = _nbytes(entry)
        while groups and held + size > max_held_bytes:  # the largest first: the fewest, fullest block calls
            flush(max(groups, key=lambda signature: groups[signature].nbytes))
        signature = _signature(entry)
        group = groups.setdefault(signature, _Group())
        group.entries.append((key, entry))
        group.nbytes += size
        held += size
        if len(group.entries) == batch_size:
            flush(signature)
    for signature in list(groups):
        flush(signature)
    dst.finish_copies()  # the entries are written when this returns: the others read them after a barrier
    return advanced
