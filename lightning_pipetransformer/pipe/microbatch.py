"""Splitting one pass over the block stack into micro-batches, and joining the outputs back.

A pass is the hidden state plus every block's own arguments (a sliding-window mask for one
block, a full mask for the next, per-layer rotary embeddings ...). Which arguments are
batch-shaped? By default a heuristic applied to every tensor, nested in tuples, lists and dicts
too (Llama's ``position_embeddings=(cos, sin)``): a tensor whose first dimension equals the
hidden state's batch size is split; everything else (``None``, scalars, a ``(seq, seq)`` causal
mask, a broadcastable ``(1, ...)`` tensor) is passed whole. The heuristic is wrong when a
non-batch tensor happens to have ``batch`` rows (a ``(seq, seq)`` mask with ``seq == batch``):
the blocks then get a cut tensor whose shape no longer fits and fail, or the first-batch
self-check (:mod:`~lightning_pipetransformer.stack.self_check`) finds the difference; a batch
size other than that dimension, or ``chunks=1``, avoids it.

Some models fold the batch into another axis: BLOOM's ALiBi bias is ``[batch * heads, 1, seq]``,
batch-major. Arguments known to be folded that way (:data:`BATCH_MAJOR_FOLDED`) are cut into the
rows of each micro-batch's samples. An unknown folded argument cannot be told from an unrelated
tensor (DeBERTa's ``[2 * buckets, hidden]`` relative embeddings); it is passed whole, and if a
block then fails on a micro-batch the executor's error names every such argument.

Splitting follows :func:`torch.tensor_split`: ``chunks`` need not divide the batch, the first
``batch % chunks`` micro-batches get one sample more, and a batch smaller than ``chunks`` (the
last batch of an epoch) is cut into fewer micro-batches. The hidden state's pieces (and those of
any argument that requires grad) are copies, not views: an in-place operation on one
micro-batch's input (``ReLU(inplace=True)``) must not bump a version counter that another
micro-batch's saved tensors share. The other batch-shaped arguments (masks, position ids, rotary
tables: no gradient) share the argument's memory (:func:`_aliases`): a Llama/BERT 4-D mask
``[B, 1, S, S]`` is not copied per pass. Their rows do not overlap, so a block that writes one in
place changes what the model's own loop would change, and each piece has a version counter of its
own, so autograd checks each micro-batch on its own rows.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_pipetransformer import tree
from lightning_pipetransformer.stack.stack_call import BlockArgs

__all__: list[str] = []


#: Keyword arguments whose first dimension is ``batch * k``, batch-major (sample ``b`` owns rows
#: ``b*k .. b*k+k-1``): BLOOM's (and Falcon's) ALiBi bias, built by ``alibi.reshape(B * heads, 1, S)``.
BATCH_MAJOR_FOLDED = frozenset({"alibi"})


class Scatter(NamedTuple):
    """One pass cut into micro-batches."""

    #: Per micro-batch: the hidden state's rows.
    hidden: tuple[Tensor, ...]
    #: Per micro-batch: every block's arguments (tensors passed whole are the same objects in all).
    calls: tuple[tuple[BlockArgs, ...], ...]
    #: Samples per micro-batch.
    sizes: tuple[int, ...]
    #: ``(name, tensor)`` of the tensors passed whole (each once), for checks and error messages.
    whole: tuple[tuple[str, Tensor], ...]
    #: Names of mutable objects passed to the blocks (a key-value cache): the caller must not split the pass.
    stateful: tuple[str, ...]
    #: ``(name, tensor, pieces)`` of the tensors cut into micro-batches, the hidden state first.
    cut: tuple[tuple[str, Tensor, tuple[Tensor, ...]], ...] = ()


def batch_size(hidden: Any) -> int:
    """The batch size of the hidden state, i.e. its first dimension."""
    if not isinstance(hidden, Tensor) or hidden.dim() == 0:
        raise TypeError(
            "The pipeline's first argument must be the hidden state, a tensor whose first dimension "
            f"is the batch; got {type(hidden).__name__}"
            + (f" of shape {tuple(hidden.shape)}" if isinstance(hidden, Tensor) else "")
            + "."
        )
    return hidden.shape[0]


def effective_chunks(chunks: int, batch: int) -> int:
    """Micro-batches for a batch of ``batch`` samples: ``chunks``, fewer for a smaller batch, at least 1."""
    return max(1, min(chunks, batch))


def _is_batch_tensor(value: Any, batch: int) -> bool:
    return isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == batch


def scatter(hidden: Tensor, calls: Sequence[BlockArgs], chunks: int) -> Scatter:
    """Cut ``hidden`` and the batch-shaped block arguments into ``effective_chunks(chunks, batch)`` pieces.

    A tensor used by several blocks (one mask object for every layer) is cut once, and its
    pieces are shared by those blocks again.
    """
    batch = batch_size(hidden)
    n = effective_chunks(chunks, batch)
    hidden_pieces = _pieces(hidden, n)
    sizes = tuple(int(p.shape[0]) for p in hidden_pieces)
    cut: dict[int, tuple[Any, ...] | None] = {}  # id(tensor) -> its pieces (None: passed whole)
    cut_from: list[tuple[str, Tensor, tuple[Tensor, ...]]] = [("the hidden state", hidden, hidden_pieces)]
    whole: dict[int, tuple[str, Tensor]] = {}
    stateful: list[str] = []

    def split_tensor(value: Tensor, name: str, key: int | str) -> tuple[Any, ...]:
        if id(value) not in cut:
            if _is_batch_tensor(value, batch):
                cut[id(value)] = _pieces(value, n, copy=value.requires_grad)
                cut_from.append((name, value, cut[id(value)]))  # type: ignore[arg-type]
            elif _folded(key, value, batch):
                k = value.shape[0] // batch
                folded = torch.split(value, [s * k for s in sizes])
                cut[id(value)] = (value,) if n == 1 else (_copies(folded, n) if value.requires_grad else _aliases(folded))
                cut_from.append((name, value, cut[id(value)]))  # type: ignore[arg-type]
            else:
                cut[id(value)] = None
                whole[id(value)] = (name, value)
        pieces = cut[id(value)]
        return pieces if pieces is not None else (value,) * n

    def split(value: Any, name: str, key: int | str) -> tuple[Any, ...]:
        if isinstance(value, Tensor):
            return split_tensor(value, name, key)
        leaves, spec = tree.flatten(value)
        if spec.type is None:  # None, a flag, a key-value cache
            if tree.is_stateful(value):
                stateful.append(name)
            return (value,) * n
        paths: list[tree.Path] = []  # found only to name a tensor seen for the first time (the text costs)
        parts = []
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, Tensor) and id(leaf) in cut:
                parts.append(split_tensor(leaf, "", key))
                continue
            if isinstance(leaf, Tensor) or tree.is_stateful(leaf):
                paths = paths or tree.flatten_with_paths(value)[1]
                named = name + tree.path_str(paths[k])
                if isinstance(leaf, Tensor):
                    parts.append(split_tensor(leaf, named, key))
                    continue
                stateful.append(named)
            parts.append((leaf,) * n)
        return tuple(tree.unflatten([p[m] for p in parts], spec) for m in range(n))

    per_block: list[list[BlockArgs]] = [[] for _ in range(n)]
    for index, (args, kwargs) in enumerate(calls):
        arg_parts = [split(a, f"block {index} argument {p + 1}", p + 1) for p, a in enumerate(args)]
        kw_parts = {k: split(v, f"block {index} argument {k!r}", k) for k, v in kwargs.items()}
        for m in range(n):
            per_block[m].append((tuple(p[m] for p in arg_parts), {k: p[m] for k, p in kw_parts.items()}))
    return Scatter(
        hidden_pieces, tuple(tuple(b) for b in per_block), sizes, tuple(whole.values()), tuple(dict.fromkeys(stateful)),
        tuple(cut_from),
    )


def _folded(key: int | str, value: Tensor, batch: int) -> bool:
    return key in BATCH_MAJOR_FOLDED and value.dim() > 0 and value.shape[0] % batch == 0 and value.shape[0] > batch


def per_sample_view(key: int | str, value: Any, batch: int) -> Any:
    """A batch-major folded argument (:data:`BATCH_MAJOR_FOLDED`) as ``[batch, k, ...]``; anything else as it is.

    What caches and row selections need: one row per sample. ``view.flatten(0, 1)`` folds it back.
    """
    if isinstance(value, Tensor) and batch > 0 and _folded(key, value, batch):
        return value.reshape(batch, value.shape[0] // batch, *value.shape[1:])
    return value


def _pieces(value: Tensor, n: int, copy: bool = True) -> tuple[Tensor, ...]:
    """``n`` row blocks of ``value``: copies (``copy``) or aliases; one block is ``value`` itself."""
    if n == 1:
        return (value,)
    views = torch.tensor_split(value, n)
    return _copies(views, n) if copy else _aliases(views)


def _aliases(views: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """The same memory as ``views``, each with a version counter of its own.

    Views of one tensor share its version counter: a block that writes one micro-batch's rows in
    place (``mask.clamp_()``) would make autograd refuse every other micro-batch's saved rows
    ("modified by an inplace operation"), though they were not touched. An alias made with
    ``set_`` shares the storage but not the counter, so each micro-batch is checked on its own
    rows, as the model's own loop checks the whole tensor. Under inference mode (no autograd, no
    version counters) views are enough.
    """
    if any(v.is_inference() for v in views):
        return tuple(views)
    if len({v.storage_offset() for v in views}) < len(views):
        # An argument expanded along the batch (stride 0 there): its micro-batches share elements, so
        # an in-place write to one would change the others behind autograd's back. Copies keep them apart.
        return _copies(views, len(views))
    with torch.no_grad():
        return tuple(
            torch.empty(0, dtype=v.dtype, device=v.device).set_(v.untyped_storage(), v.storage_offset(), v.size(), v.stride())
            for v in views
        )


def _copies(pieces: Sequence[Tensor], n: int) -> tuple[Tensor, ...]:
    # One micro-batch: the tensor itself (the plain loop's object). Several: each its own storage.
    return tuple(pieces) if n == 1 else tuple(p.clone() for p in pieces)


def gather(outputs: Sequence[Any], sizes: Sequence[int], broadcast: Collection[tree.Path] = ()) -> Any:
    """Join the per-micro-batch outputs into one output of the same structure.

    Tensors whose first dimension is their micro-batch's size are concatenated along it,
    containers (tuples, dicts, a ``ModelOutput``: :mod:`~lightning_pipetransformer.tree`) are
    rebuilt around them; anything else (``None``, scalars, non-batch tensors) is taken from the
    first micro-batch. So are the tensors at the ``broadcast`` paths (see
    :func:`~lightning_pipetransformer.tree.tensor_paths`): with micro-batches of one sample, a
    broadcastable ``(1, ...)`` output cannot be told from a per-sample one by its shape, and the
    executor names them from an output it saw on more samples.

    Raises:
        ValueError: the micro-batches' outputs differ in structure (other keys, another length):
            there is no one output to join them into.
    """
    first = outputs[0]
    if len(outputs) == 1:
        return first
    flat = [tree.flatten(o) for o in outputs]
    leaves, spec = flat[0]
    paths = tree.flatten_with_paths(first)[1] if broadcast else [()] * len(leaves)
    for i, (_, other) in enumerate(flat[1:], start=1):
        if other != spec:
            raise ValueError(
                f"The last block returned outputs of different structure for micro-batch 0 and micro-batch {i} "
                "(other keys or lengths, e.g. a ModelOutput field that is None in one only): they cannot be joined. "
                "Use chunks=1 for this model."
            )
    joined = []
    for k, (path, leaf) in enumerate(zip(paths, leaves)):
        pieces = [f[0][k] for f in flat]
        if isinstance(leaf, Tensor) and path not in broadcast and all(_is_batch_tensor(p, n) for p, n in zip(pieces, sizes)):
            joined.append(torch.cat(pieces))
        else:
            joined.append(leaf)
    return tree.unflatten(joined, spec)
