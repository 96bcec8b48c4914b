"""Running the frozen prefix around the store: one batch with hits and misses, and a boundary advance.

Per batch (:func:`cached_prefix`)::

    keys --lookup--> hit_mask, hits ---------------------------.
      misses --compute(miss_mask)--> boundary rows --store--> merge_rows --> first active block

Only the misses run through the prefix; the merged batch enters the first active block with the
batch's own block arguments (attention mask ...), which the model computes as usual.

When the boundary moves F -> F' (:func:`advance_store`), every entry at F goes through blocks
F..F'-1 only, never again from the input, and is stored under the new prefix's fingerprint.
Those blocks need the per-sample inputs the encoder loop passed with the hidden state (an
attention mask, ``is_causal`` ...): they are stored *with* each entry, as extra tensors built by
:func:`pack_block_inputs`, and turned back into ``(*args, **kwargs)`` by
:func:`unpack_block_inputs`. Encoding of one block call's arguments after the hidden state::

    tensor [B, ...]   -> "t.<slot>"  one row per sample
    tensor [1, ...]   -> "t.<slot>"  expanded to one row per sample (broadcast: same result)
    None              -> "n.<slot>"  an empty row, [B, 0]
    bool / int / float-> "s.<slot>"  a [B] tensor; entries are advanced in groups of equal values
    (always)          -> "m.inputs"  an empty row: block inputs were recorded (even if none)

``<slot>`` is ``a<i>`` for positional argument i (0 = the first after the hidden state) or
``k.<name>`` for a keyword. A BERT layer's extras are one bool mask row ``[1, S, S]``
(S*S bytes: 4 KiB at S = 64, against 96 KiB of fp32 activation) or nothing when unpadded.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .cache_store import ActivationStore, StoredEntry, merge_rows
from .pipeline import hidden_of

__all__ = [
    "advance_store",
    "cached_prefix",
    "entry_bytes",
    "pack_block_inputs",
    "select_rows",
    "shard_of",
    "unpack_block_inputs",
]

Kwargs = dict[str, Any]

_MARKER = "m.inputs"


def pack_block_inputs(args: Sequence[Any], kwargs: Mapping[str, Any], batch_size: int) -> dict[str, Tensor]:
    """Encode a block call's arguments (after the hidden state) as per-sample tensors ``[B, ...]``.

    Raises:
        TypeError: an argument that is neither batch-shaped, broadcast (first dimension 1),
            None nor a bool/int/float: it cannot be split per sample (pass it from ``run``
            in :func:`advance_store` instead, and leave it out here).
    """
    slots = [(f"a{i}", v) for i, v in enumerate(args)] + [(f"k.{k}", v) for k, v in kwargs.items()]
    # The marker says "block inputs were recorded", also for a block that takes none.
    out: dict[str, Tensor] = {_MARKER: torch.zeros(batch_size, 0, dtype=torch.uint8)}
    for slot, value in slots:
        if value is None:
            out[f"n.{slot}"] = torch.zeros(batch_size, 0, dtype=torch.uint8)
        elif isinstance(value, Tensor):
            if value.dim() > 0 and value.shape[0] == batch_size:
                out[f"t.{slot}"] = value.detach()
            elif value.dim() > 0 and value.shape[0] == 1:
                out[f"t.{slot}"] = value.detach().expand(batch_size, *value.shape[1:])
            else:
                raise TypeError(
                    f"Block argument {slot} has shape {tuple(value.shape)}, neither [batch={batch_size}, ...] "
                    "nor broadcast [1, ...]: it cannot be stored per sample."
                )
        elif isinstance(value, (bool, int, float)):
            dtype = torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) else torch.float64
            out[f"s.{slot}"] = torch.full((batch_size,), value, dtype=dtype)
        else:
            raise TypeError(
                f"Block argument {slot} of type {type(value).__name__} cannot be stored per sample: "
                "supply it inside the run function given to advance_store."
            )
    return out


def entry_bytes(hidden: Tensor, args: Sequence[Any], kwargs: Mapping[str, Any], storage_dtype: torch.dtype | None) -> int | None:
    """Bytes one sample's entry takes in the store (its activation plus :func:`pack_block_inputs`' rows).

    ``None`` when the arguments cannot be stored per sample (the cache then computes those batches).
    """
    try:
        extras = pack_block_inputs(args, kwargs, hidden.shape[0])
    except TypeError:
        return None
    itemsize = torch.empty((), dtype=storage_dtype or hidden.dtype).element_size()
    return hidden[0].numel() * itemsize + sum(t[0].numel() * t.element_size() for t in extras.values())


def unpack_block_inputs(extras: Mapping[str, Tensor]) -> tuple[tuple[Any, ...], Kwargs]:
    """Inverse of :func:`pack_block_inputs` for ``n`` stacked samples: ``(args, kwargs)`` for a block."""
    positional: dict[int, Any] = {}
    kwargs: Kwargs = {}
    for name, tensor in extras.items():
        kind, _, slot = name.partition(".")
        if kind == "n":
            value: Any = None
        elif kind == "t":
            value = tensor
        elif kind == "s":
            value = tensor[0].item()  # equal in the group (advance_store groups by value)
        else:
            continue  # not a block input (the caller's own extra)
        if slot.startswith("k."):
            kwargs[slot[2:]] = value
        else:
            positional[int(slot[1:])] = value
    if sorted(positional) != list(range(len(positional))):
        raise ValueError(f"Stored block inputs have positional slots {sorted(positional)}: some are missing.")
    return tuple(positional[i] for i in range(len(positional))), kwargs


def select_rows(value: Any, mask: Tensor, batch_size: int) -> Any:
    """``value`` (nested tuples/lists/dicts) with every ``[batch_size, ...]`` tensor cut to the rows in ``mask``."""
    if isinstance(value, Tensor):
        if value.dim() > 0 and value.shape[0] == batch_size:
            return value[mask.to(value.device)]
        return value
    if isinstance(value, Mapping):
        return {k: select_rows(v, mask, batch_size) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(select_rows(v, mask, batch_size) for v in value)
    return value


def cached_prefix(
    store: ActivationStore,
    keys: Sequence[str],
    compute: Callable[[Tensor], Tensor],
    *,
    extras: Mapping[str, Tensor] | None = None,
    sample_shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """The boundary activations of a whole batch, computing only the misses; returns ``(activations, hit_mask)``.

    Args:
        store: the store of the current boundary.
        keys: one key per sample (:func:`~.cache_keys.content_keys` / ``index_keys``).
        compute: ``compute(miss_mask) -> [misses, ...]``: runs the frozen prefix (no grad) on the
            rows where ``miss_mask`` (CPU bool ``[B]``) is true; :func:`select_rows` cuts a batch.
            Not called when every sample hits.
        extras: per-sample tensors ``[B, ...]`` to keep with new entries, normally
            ``pack_block_inputs(args, kwargs, B)`` so the entries can be advanced later.
        sample_shape, dtype, device: of one activation, as the first active block expects it.
    """
    hit_mask, hits = store.lookup(keys, sample_shape=sample_shape, dtype=dtype, device=device)
    miss_mask = ~hit_mask
    if not bool(miss_mask.any()):
        return hits, hit_mask
    computed = compute(miss_mask)
    miss_keys = [k for k, hit in zip(keys, hit_mask.tolist()) if not hit]
    miss_extras = {n: t[miss_mask.to(t.device)] for n, t in (extras or {}).items()}
    store.store(miss_keys, computed, miss_extras)
    return merge_rows(hit_mask, hits, computed), hit_mask


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
        run: ``run(hidden, *args, **kwargs)`` runs blocks F..F'-1 exactly as the encoder loop
            does (e.g. ``for b in blocks[F:F2]: hidden = hidden_of(b(hidden, *args, **kwargs))``)
            and returns the hidden state (or a block output :func:`~.pipeline.hidden_of` reads).
            It is called under ``torch.no_grad()`` with the stored block inputs.
        batch_size: entries per call of ``run``.
        device: where ``run`` computes (inputs are moved there); default CPU.
        shard: ``(rank, world)``: with several processes on one node, each advances the disk
            entries with ``shard_of(key, world) == rank`` plus the entries only it holds in
            memory. Then (after a barrier) one process may ``src.clear(disk=True)``.

    Advanced entries leave ``src``'s memory (their files stay until ``src.clear(disk=True)``), so
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
        args, kwargs = unpack_block_inputs({n: t.to(target) for n, t in extras.items()})
        with torch.no_grad():
            out = run(hidden, *args, **kwargs)
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
        if _MARKER not in entry.extras:
            raise ValueError(
                f"Entry {key!r} at boundary {src.boundary} was stored without its block inputs, so it cannot "
                "be advanced: store entries with extras=pack_block_inputs(args, kwargs, B)."
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
