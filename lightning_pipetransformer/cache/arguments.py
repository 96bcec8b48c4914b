"""The blocks' nested arguments, per sample: every walk the cache makes over them, in one place.

A block receives the hidden state and then any nesting of tuples, lists and dicts of tensors and plain
values (an attention mask, ``position_embeddings=(cos, sin)``, flags). The cache walks them four ways,
each with its own rule for what a leaf is:

- :func:`leaves`: every leaf with a stable path (dict keys sorted): what a content key hashes;
- :func:`shared_once`: repeats of one tensor replaced by a reference: what a content key hashes of the
  blocks' arguments (one mask object for every block is hashed once);
- :func:`select_rows`: every batch-shaped tensor cut to some rows: the frozen prefix run for the misses;
- :func:`pack_block_inputs` / :func:`unpack_block_inputs`: the arguments as per-sample tensors stored with
  an entry, and back: a boundary advance runs the stored entries through the next blocks.

When the boundary moves F -> F' (:func:`advance_store`), every entry at F goes through blocks
F..F'-1 only, never again from the input, and is stored under the new prefix's fingerprint.
Those blocks need the per-sample inputs the model's loop passed to each of them with the hidden
state (an attention mask, a sliding-window mask for some layers, rotary embeddings ...): they
are stored *with* each entry, for every block from the boundary on, as extra tensors built by
:func:`pack_block_inputs` and turned back into each block's ``(args, kwargs)`` by
:func:`unpack_block_inputs`. A tensor that several blocks receive (one mask object for all
layers) is stored once. Encoding of one leaf of block ``b``'s arguments, nested tuples, lists
and dicts included (``position_embeddings=(cos, sin)``)::

    tensor [B, ...]     -> "t.<path>"            one row per sample
    tensor [1, ...]     -> "t.<path>"            expanded to one row per sample (broadcast: same result)
    tensor [B * k, ...] -> "f.<path>"            a batch-major folded argument (BLOOM's alibi), as [B, k, ...]
    a tensor seen before-> "r.<path>.-<path'>"   an empty row: the same tensor as <path'>
    None                -> "n.<path>"            an empty row, [B, 0]
    bool / int / float  -> "s.<path>"            a [B] tensor; entries are advanced in groups of equal values
    empty tuple / list  -> "e.<path>"            an empty row
    (always)            -> "m.inputs"            an empty row: block inputs were recorded (even if none)

``<path>`` is ``b<block>`` then ``.a<i>`` for positional argument i (0 = the first after the
hidden state) or ``.k<name>`` for a keyword, then ``.t<i>`` / ``.l<i>`` / ``.d<key>`` for an
element of a tuple, list or dict. A BERT layer's extras are one bool mask row ``[1, S, S]``
(S*S bytes: 4 KiB at S = 64, against 96 KiB of fp32 activation) or nothing when unpadded.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from lightning_pipetransformer import tree
from lightning_pipetransformer.cache.rows import take_rows
from lightning_pipetransformer.pipe.microbatch import per_sample_view
from lightning_pipetransformer.stack.stack_call import BlockArgs

__all__ = [
    "ENTRY_FORMAT",
    "INPUTS_MARKER",
    "entry_bytes",
    "leaves",
    "pack_block_inputs",
    "select_rows",
    "shared_once",
    "unpack_block_inputs",
]

#: The layout of stored block inputs; part of every store's fingerprint, so entries written in
#: another layout are never read.
ENTRY_FORMAT = 2

#: The extra every entry stored with its block inputs holds (even when the blocks take none).
INPUTS_MARKER = "m.inputs"


def leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """Leaves of a nested batch with their paths under ``path`` (the one rule of :mod:`~lightning_pipetransformer.tree`).

    A content key sums per-row hashes salted by these paths, so the order of the leaves (collate order
    of a dict may vary) does not change a key; the paths do.
    """
    for where, leaf in tree.leaves_with_paths(value):
        yield f"{path}{tree.path_str(where)}", leaf


def shared_once(calls: Sequence[BlockArgs], batch: int) -> Any:
    """``calls`` with every repeat of a tensor (one mask object for every block) replaced by a reference.

    Content keys hash what is left: each distinct tensor once, and which block gets which. A
    batch-major folded argument (BLOOM's alibi) is hashed per sample (:func:`per_sample_view`).
    """
    seen: dict[int, int] = {}

    def ref(path: tree.Path, value: Tensor) -> Any:
        if id(value) in seen:
            return f"@{seen[id(value)]}"
        seen[id(value)] = len(seen)
        return per_sample_view(_argument_name(path), value, batch)

    return [tree.map_tensors_with_paths(ref, call) for call in calls]


def _argument_name(path: tree.Path) -> int | str:
    """The keyword a tensor was passed under (the last mapping key on its path), else 0: what
    :func:`per_sample_view` asks to tell a batch-major folded argument."""
    for entry in reversed(path):
        if isinstance(entry, pytree.MappingKey):
            return entry.key
    return 0


def _readable(path: str) -> str:
    """``"b3.krel_embeddings"`` as ``"block 3's argument rel_embeddings"``, ``"b2.a1.t0"`` as ``"block 2's argument 2 [0]"``."""
    block, *parts = path.split(".")
    words = f"block {block[1:]}'s argument "
    for i, part in enumerate(parts):
        kind, rest = part[0], part[1:]
        if i == 0:
            words += rest if kind == "k" else str(int(rest) + 1)
        else:
            words += f" [{rest}]" if kind in "tl" else f" [{rest!r}]"
    return words


def pack_block_inputs(calls: Sequence[BlockArgs], first_block: int, batch_size: int) -> dict[str, Tensor]:
    """Encode the arguments of blocks ``first_block, first_block + 1, ...`` as per-sample tensors ``[B, ...]``.

    ``calls[i]`` is block ``first_block + i``'s ``(args, kwargs)`` after the hidden state.

    Raises:
        TypeError: an argument that is neither batch-shaped, broadcast (first dimension 1),
            None, a bool/int/float, nor a tuple/list/dict of those: it cannot be split per sample.
    """
    out: dict[str, Tensor] = {INPUTS_MARKER: torch.zeros(batch_size, 0, dtype=torch.uint8)}
    seen: dict[int, str] = {}

    def empty() -> Tensor:
        return torch.zeros(batch_size, 0, dtype=torch.uint8)

    def pack(path: str, value: Any, key: int | str) -> None:
        per_sample = per_sample_view(key, value, batch_size)
        if per_sample is not value:
            out[f"f.{path}"] = per_sample.detach()
            return
        if value is None:
            out[f"n.{path}"] = empty()
        elif isinstance(value, Tensor):
            if id(value) in seen:
                out[f"r.{path}.-{seen[id(value)]}"] = empty()
                return
            if value.dim() > 0 and value.shape[0] == batch_size:
                out[f"t.{path}"] = value.detach()
            elif value.dim() > 0 and value.shape[0] == 1:
                out[f"t.{path}"] = value.detach().expand(batch_size, *value.shape[1:])
            else:
                raise TypeError(
                    f"{_readable(path)} is a tensor of shape {tuple(value.shape)}, neither [batch={batch_size}, ...] "
                    "nor broadcast [1, ...] (one value shared by all samples, such as a weight handed to every block)"
                )
            seen[id(value)] = path
        elif isinstance(value, (bool, int, float)):
            dtype = torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) else torch.float64
            out[f"s.{path}"] = torch.full((batch_size,), value, dtype=dtype)
        elif isinstance(value, (tuple, list)) and type(value) in (tuple, list):
            if not value:
                out[f"e.{path}.{'t' if isinstance(value, tuple) else 'l'}"] = empty()
            kind = "t" if isinstance(value, tuple) else "l"
            for i, item in enumerate(value):
                pack(f"{path}.{kind}{i}", item, key)
        elif type(value) is dict and all(isinstance(k, str) and k.isidentifier() for k in value):
            for name, item in value.items():
                pack(f"{path}.d{name}", item, key)
        else:
            raise TypeError(
                f"{_readable(path)} is a {type(value).__module__}.{type(value).__qualname__}, which an entry cannot hold "
                "(tensors, None, bool/int/float and plain tuples, lists and dicts of them can)"
            )

    for offset, (args, kwargs) in enumerate(calls):
        block = f"b{first_block + offset}"
        out[f"e.{block}"] = empty()  # the block was recorded (even with no arguments)
        for i, value in enumerate(args):
            pack(f"{block}.a{i}", value, i + 1)
        for name, value in kwargs.items():
            pack(f"{block}.k{name}", value, name)
    return out


def entry_bytes(hidden: Tensor, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int | None:
    """Bytes one sample's entry takes in the store (its activation plus one block's :func:`pack_block_inputs` rows).

    ``None`` when the arguments cannot be stored per sample (the cache then computes those batches).
    """
    try:
        extras = pack_block_inputs([(tuple(args), dict(kwargs))], 0, hidden.shape[0])
    except TypeError:
        return None
    return hidden[0].numel() * hidden.element_size() + sum(t[0].numel() * t.element_size() for t in extras.values())


def unpack_block_inputs(extras: Mapping[str, Tensor], blocks: Sequence[int]) -> list[BlockArgs]:
    """Inverse of :func:`pack_block_inputs` for ``n`` stacked samples: each of ``blocks``' ``(args, kwargs)``.

    Raises:
        ValueError: a block's inputs were not stored (entries from before that block's boundary).
    """
    values: dict[str, Any] = {}
    references: dict[str, str] = {}
    recorded: set[str] = set()
    for name, tensor in extras.items():
        kind, _, path = name.partition(".")
        if kind == "t":
            values[path] = tensor
        elif kind == "f":
            values[path] = tensor.flatten(0, 1)
        elif kind == "n":
            values[path] = None
        elif kind == "s":
            values[path] = tensor[0].item()  # equal in the group (advance_store groups by value)
        elif kind == "r":
            path, _, target = path.partition(".-")
            references[path] = target
        elif kind == "e":
            if path.count(".") == 0:
                recorded.add(path)
            else:
                values[path] = "<empty>"
    for path, target in references.items():
        values[path] = values[target]
    calls: list[BlockArgs] = []
    for block in blocks:
        prefix = f"b{block}"
        if prefix not in recorded:
            raise ValueError(f"The stored entry holds no inputs for block {block}: it cannot be advanced through it.")
        tree: dict[str, Any] = {}
        for path, value in values.items():
            head, _, rest = path.partition(".")
            if head == prefix:
                _insert(tree, rest.split("."), value)
        slots = sorted(int(k[1:]) for k in tree if k.startswith("a"))
        if slots != list(range(len(slots))):
            raise ValueError(f"Stored inputs of block {block} have positional slots {slots}: some are missing.")
        args = tuple(_build(tree[f"a{i}"]) for i in slots)
        kwargs = {k[1:]: _build(v) for k, v in tree.items() if k.startswith("k")}
        calls.append((args, kwargs))
    return calls


def _insert(tree: dict[str, Any], parts: list[str], value: Any) -> None:
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def _build(node: Any) -> Any:
    """A packed subtree back into the tuple / list / dict it was."""
    if not isinstance(node, dict):
        return node
    if set(node) in ({"t"}, {"l"}) and node[next(iter(node))] == "<empty>":
        return () if "t" in node else []
    kind = next(iter(node))[0]
    if kind == "d":
        return {k[1:]: _build(v) for k, v in node.items()}
    items = [_build(v) for _, v in sorted(node.items(), key=lambda kv: int(kv[0][1:]))]
    return tuple(items) if kind == "t" else items


def select_rows(value: Any, mask: Tensor, batch_size: int) -> Any:
    """``value`` (nested arguments) with every ``[batch_size, ...]`` tensor cut to the rows in ``mask``.

    A tensor that appears several times (one mask for every block) is cut once; a batch-major
    folded keyword argument (:func:`~lightning_pipetransformer.pipe.microbatch.per_sample_view`) is cut by sample.
    """

    def cut(path: tree.Path, v: Tensor) -> Tensor:
        # Only a keyword's own value is a folded argument; an element nested inside it is cut by rows.
        folded = per_sample_view(path[-1].key, v, batch_size) if path and isinstance(path[-1], pytree.MappingKey) else v
        if folded is not v:
            return take_rows(folded, mask).flatten(0, 1)
        if v.dim() > 0 and v.shape[0] == batch_size:
            return take_rows(v, mask)
        return v

    return tree.map_tensors_with_paths(cut, value, memo={})
