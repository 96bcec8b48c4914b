"""Deferred block outputs: the placeholders a block call returns until the stack's last block runs them all.

A block call the interception (:mod:`~.interception`) records returns a :class:`Deferred` in place
of its output, shaped like what the block returns (:func:`output_template`, learnt in the first
pass): a tensor, or a tuple such as BLOOM's ``(hidden, attention)``. The model may only pass it on
to the next block; any other use raises :class:`~.stack_call.InterceptionError` naming the block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_pipetransformer import tree
from lightning_pipetransformer.stack.stack_call import InterceptionError

__all__ = ["Deferred", "contains_deferred", "output_template", "placeholder_output", "same_structure"]

# Reading these from a placeholder is harmless: they do not depend on values not computed yet.
_HARMLESS = frozenset(
    {
        Tensor.dtype.__get__,  # type: ignore[attr-defined]
        Tensor.device.__get__,  # type: ignore[attr-defined]
        Tensor.is_cuda.__get__,  # type: ignore[attr-defined]
        Tensor.requires_grad.__get__,  # type: ignore[attr-defined]
    }
)


class Deferred(Tensor):
    """The output of a block that has not run yet: it runs when the stack's last block is called.

    It carries the dtype and device of the block's input and nothing else; any use other than
    passing it on to the next block raises :class:`InterceptionError` naming the block.
    """

    _what: str

    @staticmethod
    def __new__(cls, like: Tensor, what: str) -> Deferred:
        data = torch.empty(0, dtype=like.dtype, device=like.device)
        placeholder = Tensor._make_subclass(cls, data, False)
        placeholder._what = what
        return placeholder

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return f"Deferred({self._what})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        if func in _HARMLESS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        what = next((a._what for a in tree.leaves((args, kwargs)) if isinstance(a, Deferred)), "a block output")
        owner = getattr(func, "__self__", None)  # a property getter: name the property ('shape')
        name = getattr(owner, "__name__", None) if getattr(func, "__name__", "") == "__get__" else getattr(func, "__name__", None)
        name = name or repr(func)
        raise InterceptionError(
            f"The model used {what} ({name}), a placeholder for a block output that the pipeline or cache does not "
            "produce. strategy='pipetransformer' runs the whole stack when its last block is called, so a model's "
            "loop may only pass each block's output on to the next block (no reading or changing it between blocks, "
            "no stopping early, no keeping it: a model that collects per-layer outputs in its own loop, with "
            "output_hidden_states=True or output_attentions=True, keeps placeholders; turn those flags off while "
            "training). Use pipe_len=1, chunks=1 and cache=False for this model, or name another container with layers=."
        )


def contains_deferred(value: Any) -> bool:
    return any(isinstance(v, Deferred) for v in tree.tensors(value))


# -- what a block returns ------------------------------------------------------------------------

_HIDDEN, _TENSOR = "hidden", "tensor"


def output_template(output: Any) -> Any:
    """The structure of a block output: tensors are slots, the first one (the hidden state) marked.

    Follows :func:`hidden_of`: a tensor is the hidden state, else the first element of a tuple /
    list / ``ModelOutput``.
    """
    if isinstance(output, Tensor):
        return _HIDDEN
    if isinstance(output, (tuple, list)) and output:
        rest = [_TENSOR if isinstance(v, Tensor) else ("value", v) if not isinstance(v, (tuple, list, Mapping)) else None for v in output[1:]]
        if any(r is None for r in rest):
            return ("opaque", type(output).__name__)
        return ("seq", type(output), (_HIDDEN, *rest))
    return ("opaque", type(output).__name__)


def same_structure(a: Any, b: Any) -> bool:
    if a == b:
        return True
    if isinstance(a, tuple) and isinstance(b, tuple) and a[:2] == b[:2] and a[0] == "seq":
        # Plain values (None, flags) inside may differ between calls only if both are plain values.
        return len(a[2]) == len(b[2]) and all(
            x == y or (isinstance(x, tuple) and isinstance(y, tuple) and x[0] == y[0] == "value")
            for x, y in zip(a[2], b[2])
        )
    return False


def placeholder_output(template: Any, like: Tensor, what: str) -> tuple[Any, Deferred]:
    """A stand-in for a block output of ``template``'s structure, and the placeholder of its hidden state."""
    hidden = Deferred(like, what)
    if template == _HIDDEN:
        return hidden, hidden
    if template[0] != "seq":
        raise InterceptionError(
            f"{what[0].upper()}{what[1:]} is a {template[1]}, not a tensor or a tuple of tensors and plain values: a "
            "placeholder of that structure cannot be made, so the pass cannot be deferred to the stack's last block. "
            "Use pipe_len=1, chunks=1 and cache=False for this model."
        )
    _, kind, slots = template
    items = [hidden] + [
        Deferred(like, f"{what} (element {i + 1})") if s == _TENSOR else s[1] for i, s in enumerate(slots[1:])
    ]
    out = kind(*items) if hasattr(kind, "_fields") else kind(items)
    return out, hidden

