"""Boundary moves: the entries stored at boundary F carried to boundary F' without recomputing them.

When the boundary moves F -> F' (:func:`advance_store`), every entry at F goes through blocks
F..F'-1 only, never again from the input, and is stored under the new prefix's fingerprint. The
blocks' inputs come from the entry itself: stored with it by the per-batch path
(:func:`~lightning_pipetransformer.cache.arguments.pack_block_inputs`), read back by
:func:`~lightning_pipetransformer.cache.arguments.unpack_block_inputs`. With several processes on a
node, :func:`shard_of` splits the directory's entries among them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_pipetransformer.cache.arguments import INPUTS_MARKER, unpack_block_inputs
from lightning_pipetransformer.cache.store import ActivationStore, StoredEntry
from lightning_pipetransformer.stack.stack_call import hidden_of

__all__ = ["advance_store", "shard_of"]


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


def advance_store(
    src: ActivationStore,
    dst: ActivationStore,
    run: Callable[..., Any],
    *,
    batch_size: int = 32,
    device: torch.device | str | None = None,
    shard: tuple[int, int] = (0, 1),
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

    Advanced entries leave ``src``'s memory (their files stay until ``src.close(delete=True)``), so
    with equal budgets the two stores together hold about one budget. Entries already in ``dst``
    are skipped, so an interrupted advance can simply be rerun.
    Entries stored without block inputs cannot be advanced: ``ValueError``.
    """
    if dst.boundary <= src.boundary:
        raise ValueError(f"advance_store goes forward only: boundary {src.boundary} -> {dst.boundary}.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}.")
    rank, world = shard
    target = torch.device(device) if device is not None else torch.device("cpu")
    todo = [
        k
        for k in src.keys()
        if (src.in_memory(k) and not src.on_disk(k)) or shard_of(k, world) == rank
    ]
    groups: dict[tuple, list[tuple[str, StoredEntry]]] = {}
    advanced = 0

    def flush(group: list[tuple[str, StoredEntry]]) -> None:
        nonlocal advanced
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
        group = groups.setdefault(_signature(entry), [])
        group.append((key, entry))
        if len(group) == batch_size:
            flush(group)
            group.clear()
    for group in groups.values():
        if group:
            flush(group)
    return advanced
