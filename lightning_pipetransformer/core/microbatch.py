"""Splitting a call's arguments into micro-batches, and joining the outputs back.

Which arguments are batch-shaped? By default a heuristic: every tensor argument (positional
or keyword) whose first dimension equals the batch size of the first argument (the hidden
state) is split; everything else (``None``, scalars, tensors of other shapes such as a
``(seq, seq)`` causal mask or a broadcastable ``(1, ...)`` mask) is passed whole. The
heuristic is wrong when a non-batch tensor happens to have ``batch`` rows (a ``(seq, seq)``
mask with ``seq == batch``): name the batch-shaped arguments explicitly with ``batch_args``
(positions, ``0`` being the hidden state, and keyword names) to rule that out.

Splitting follows :func:`torch.tensor_split`: ``chunks`` need not divide the batch, the first
``batch % chunks`` micro-batches get one sample more. Only top-level tensors are split; tensors
nested in lists or objects are passed whole.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__: list[str] = []

Args = tuple[Any, ...]
Kwargs = dict[str, Any]
#: Which arguments are batch-shaped: positions (0 is the hidden state) and keyword names.
BatchArgs = Collection[int | str]


class Scatter(NamedTuple):
    """One call's arguments cut into micro-batches."""

    #: Per micro-batch: its positional and keyword arguments (whole ones are the same objects).
    batches: list[tuple[Args, Kwargs]]
    #: Positions of the split positional arguments (always contains 0, the hidden state).
    split_args: frozenset[int]
    #: Names of the split keyword arguments.
    split_kwargs: frozenset[str]
    #: Samples per micro-batch.
    sizes: tuple[int, ...]


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


def _is_batch_tensor(value: Any, batch: int) -> bool:
    return isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == batch


def scatter(args: Args, kwargs: Kwargs, chunks: int, batch_args: BatchArgs | None = None) -> Scatter:
    """Cut ``args[0]`` (the hidden state) and the other batch-shaped arguments into ``chunks``.

    Raises:
        ValueError: ``chunks`` is larger than the batch, or an argument named in ``batch_args``
            is a tensor whose first dimension is not the batch size.
    """
    batch = batch_size(args[0])
    if chunks > batch:
        raise ValueError(
            f"Cannot split a batch of {batch} samples into {chunks} micro-batches: "
            f"use at most {batch} micro-batches (chunks) or a larger batch."
        )
    if batch_args is None:
        split_args = frozenset(i for i, a in enumerate(args) if _is_batch_tensor(a, batch))
        split_kwargs = frozenset(k for k, v in kwargs.items() if _is_batch_tensor(v, batch))
    else:
        # Named arguments that are absent or None this call are simply not split.
        split_args = frozenset(
            {0} | {i for i in batch_args if isinstance(i, int) and i < len(args) and isinstance(args[i], Tensor)}
        )
        split_kwargs = frozenset(
            k for k in batch_args if isinstance(k, str) and isinstance(kwargs.get(k), Tensor)
        )
        named = [(f"argument {i}", args[i]) for i in split_args] + [(repr(k), kwargs[k]) for k in split_kwargs]
        for name, value in named:
            if not _is_batch_tensor(value, batch):
                raise ValueError(
                    f"Batch argument {name} has shape {tuple(value.shape)}, but the batch size "
                    f"(the hidden state's first dimension) is {batch}."
                )

    pieces_args = {i: torch.tensor_split(args[i], chunks) for i in split_args}
    pieces_kwargs = {k: torch.tensor_split(kwargs[k], chunks) for k in split_kwargs}
    batches = []
    for m in range(chunks):
        a = tuple(pieces_args[i][m] if i in pieces_args else v for i, v in enumerate(args))
        kw = {k: pieces_kwargs[k][m] if k in pieces_kwargs else v for k, v in kwargs.items()}
        batches.append((a, kw))
    sizes = tuple(p.shape[0] for p in pieces_args[0])
    return Scatter(batches, split_args, split_kwargs, sizes)


def map_tensors(fn: Callable[[Tensor], Tensor], obj: Any) -> Any:
    """Apply ``fn`` to every tensor in ``obj`` (a tensor, tuple, list or mapping, nested)."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        items = [map_tensors(fn, v) for v in obj]
        return _rebuild(obj, items)
    if isinstance(obj, Mapping):
        return type(obj)(**{k: map_tensors(fn, v) for k, v in obj.items()})
    return obj


def gather(outputs: Sequence[Any], sizes: Sequence[int]) -> Any:
    """Join the per-micro-batch outputs into one output of the same structure.

    Tensors whose first dimension is their micro-batch's size are concatenated along it;
    tuples, lists and mappings (e.g. a ``ModelOutput``) are joined field by field; anything
    else (``None``, scalars, non-batch tensors) is taken from the first micro-batch.
    """
    first = outputs[0]
    if len(outputs) == 1:
        return first
    if isinstance(first, Tensor):
        if all(_is_batch_tensor(o, n) for o, n in zip(outputs, sizes)):
            return torch.cat(list(outputs))
        return first
    if isinstance(first, (tuple, list)):
        items = [gather([o[i] for o in outputs], sizes) for i in range(len(first))]
        return _rebuild(first, items)
    if isinstance(first, Mapping):
        return type(first)(**{k: gather([o[k] for o in outputs], sizes) for k in first})
    return first


def _rebuild(like: tuple | list, items: list[Any]) -> Any:
    if isinstance(like, tuple) and hasattr(like, "_fields"):  # a namedtuple takes fields
        return type(like)(*items)
    return type(like)(items)
