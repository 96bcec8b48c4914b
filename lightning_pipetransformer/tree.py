"""Nested arguments and outputs of block calls: one way to walk them, built on ``torch.utils._pytree``.

A block gets and returns tensors nested in tuples, lists, dicts, named tuples and transformers'
``ModelOutput`` (Llama's ``position_embeddings=(cos, sin)``, BLOOM's ``(hidden, attention)``, a
dict of masks). Every part that looks inside them (the interception, the micro-batch split and
join, moving an output to the first stage's device, the cache's keys and row selections) must see
the same tensors at the same paths and rebuild the same types, or one part splits a tensor that
another passes whole. So there is one rule, here:

- a tensor is a leaf; so is a mutable per-call object the blocks update (:func:`is_stateful`: a
  key-value ``Cache``), even where it is registered with pytree: it is passed on, never rebuilt;
  so is a ``torch.Size`` (pytree would rebuild it as a plain tuple, which a block may not take);
- the containers pytree knows are walked and rebuilt by pytree's own functions: ``tuple``,
  ``list``, ``dict``, ``OrderedDict``, ``defaultdict``, ``deque``, every **named tuple** (rebuilt
  as its own type from its fields: the one rule for named tuples; its path keys are the field
  names) and every transformers ``ModelOutput`` (transformers registers each subclass: rebuilt
  from its fields that are not ``None``);
- any other ``Mapping``, ``tuple`` or ``list`` subclass (a user's dict subclass) is walked too,
  and rebuilt as ``type(x)(**items)`` (a mapping built from keywords), else ``type(x)(items)``.
  pytree alone would make it a leaf, and its tensors would then be passed whole to every
  micro-batch, left unjoined or left on the last stage;
- anything else (``None``, numbers, strings, other objects) is a leaf.

A path is the tuple of pytree key entries that lead to a leaf (``SequenceKey(i)``,
``MappingKey(k)``, ``GetAttrKey(field)``), as ``tree_flatten_with_path`` gives them; :func:`path_str`
writes one as ``[0]['mask']``.

Who walks with what: the interception (:func:`leaves` to find placeholders and key-value
caches, :func:`map_tensors` with ``memo=`` for the probe's copies, each shared tensor copied
once), the self-check and the call-order watch likewise, the micro-batch split and join
(:func:`flatten_with_paths` per argument or output, :func:`unflatten` per micro-batch),
the pipeline (:func:`map_tensors` with a ``memo=`` per stage: a tensor passed whole goes to each
stage once; :func:`tensor_paths` for its broadcast outputs) and ``runners.to_device``.

The cache walks with it too (:mod:`~lightning_pipetransformer.cache.arguments`): its content keys
hash :func:`leaves_with_paths` (the path text enters each leaf's salt), its row selection and its
shared-tensor references use :func:`map_tensors_with_paths` (a keyword's path names a batch-major
folded argument). Only ``pack_block_inputs`` keeps its own walk: an entry on disk is rebuilt from
names, without Python types, so it accepts only plain tuples, lists and dicts on purpose
(:func:`containers` tells which types a tree holds).
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

__all__ = [
    "Path",
    "Spec",
    "containers",
    "flatten",
    "flatten_with_paths",
    "is_stateful",
    "leaves",
    "leaves_with_paths",
    "map_leaves",
    "map_tensors",
    "map_tensors_with_paths",
    "path_str",
    "tensor_paths",
    "tensors",
    "unflatten",
]

#: The pytree key entries that lead from the root to a leaf.
Path = tuple[Any, ...]


def is_stateful(value: Any) -> bool:
    """A mutable per-call object the blocks update (a Hugging Face ``Cache``: ``update`` + ``get_seq_length``)."""
    return callable(getattr(value, "update", None)) and callable(getattr(value, "get_seq_length", None))


class Spec(NamedTuple):
    """The structure of a tree without its leaves: what :func:`unflatten` rebuilds.

    Two trees with equal specs have the same containers, keys and number of leaves (leaf values,
    ``None`` or not, are not part of it). A named tuple, not a dataclass: one is made per
    container of every block argument on every pass.
    """

    #: The container's type (``None``: a leaf).
    type: type | None
    #: What rebuilding needs beside the children (a dict's keys, a named tuple's type ...).
    context: Any = None
    children: tuple[Spec, ...] = ()
    num_leaves: int = 1
    #: ``unflatten_fn(children, context)`` rebuilds the container (pytree's registered function, or ours).
    unflatten_fn: Callable[[list[Any], Any], Any] | None = None


_LEAF = Spec(None)


def _as_tuple(children: list[Any], _: Any) -> tuple[Any, ...]:
    return tuple(children)


def _as_list(children: list[Any], _: Any) -> list[Any]:
    return children


def _as_dict(children: list[Any], keys: list[Any]) -> dict[Any, Any]:
    return dict(zip(keys, children))


def _as_mapping(children: list[Any], context: tuple[type, list[Any]]) -> Any:
    kind, keys = context
    items = dict(zip(keys, children))
    try:
        return kind(**items)  # a mapping built from keywords (a ModelOutput-like class)
    except TypeError:
        return kind(items)


def _as_sequence(children: list[Any], kind: type) -> Any:
    return kind(children)


def _node(value: Any) -> tuple[Any, list[Any], list[Any], Callable[[list[Any], Any], Any]] | None:
    """``(context, children, their key entries, unflatten_fn)`` of a container not a plain tuple,
    list or dict; ``None`` for a leaf."""
    if isinstance(value, torch.Size) or is_stateful(value):
        return None
    node_type = namedtuple if pytree.is_namedtuple_instance(value) else type(value)  # one pytree key for them all
    handler = pytree.SUPPORTED_NODES.get(node_type)
    if handler is not None:
        if handler.flatten_with_keys_fn is not None:
            keyed, context = handler.flatten_with_keys_fn(value)
            return context, [v for _, v in keyed], [k for k, _ in keyed], handler.unflatten_fn
        children, context = handler.flatten_fn(value)
        return context, list(children), [pytree.SequenceKey(i) for i in range(len(children))], handler.unflatten_fn
    if isinstance(value, Mapping):
        keys = list(value.keys())
        return (type(value), keys), [value[k] for k in keys], [pytree.MappingKey(k) for k in keys], _as_mapping
    if isinstance(value, (tuple, list)):
        return type(value), list(value), [pytree.SequenceKey(i) for i in range(len(value))], _as_sequence
    return None


_SCALARS = (bool, int, float, str, type(None))


def _flatten(value: Any, path: Path, out: list[Any], paths: list[Path] | None) -> Spec:
    kind = type(value)
    if isinstance(value, Tensor) or kind in _SCALARS:
        out.append(value)
        if paths is not None:
            paths.append(path)
        return _LEAF
    # The plain containers (most arguments) without the registry's lookups; the same rebuild as pytree's.
    if kind is tuple or kind is list:
        keys: Any = range(len(value))
        children: Any = value
        context: Any = None
        rebuild: Callable[[list[Any], Any], Any] = _as_tuple if kind is tuple else _as_list
        entry: Callable[[Any], Any] = pytree.SequenceKey
    elif kind is dict:
        keys = context = list(value)
        children = [value[k] for k in keys]
        rebuild, entry = _as_dict, pytree.MappingKey
    else:
        node = _node(value)
        if node is None:
            out.append(value)
            if paths is not None:
                paths.append(path)
            return _LEAF
        context, children, keys, rebuild = node
        entry = lambda key: key  # noqa: E731  (the registry gave key entries already)
    if paths is None:
        specs = tuple(_flatten(child, path, out, None) for child in children)
    else:
        specs = tuple(_flatten(child, (*path, entry(key)), out, paths) for child, key in zip(children, keys))
    return Spec(kind, context, specs, sum(s.num_leaves for s in specs), rebuild)


def flatten(tree: Any) -> tuple[list[Any], Spec]:
    """The leaves of ``tree`` in order, and its structure."""
    out: list[Any] = []
    return out, _flatten(tree, (), out, None)


def flatten_with_paths(tree: Any) -> tuple[list[Any], list[Path], Spec]:
    """:func:`flatten`, with each leaf's path."""
    out: list[Any] = []
    paths: list[Path] = []
    return out, paths, _flatten(tree, (), out, paths)


def unflatten(leaves: list[Any], spec: Spec) -> Any:
    """The tree of ``spec``'s structure holding ``leaves`` (as many as ``spec.num_leaves``)."""
    if len(leaves) != spec.num_leaves:
        raise ValueError(f"This structure holds {spec.num_leaves} leaves; got {len(leaves)}.")
    if spec.type is None:
        return leaves[0]
    position = 0

    def build(s: Spec) -> Any:
        nonlocal position
        if s.type is None:
            position += 1
            return leaves[position - 1]
        assert s.unflatten_fn is not None
        return s.unflatten_fn([build(c) for c in s.children], s.context)

    return build(spec)


def leaves(tree: Any) -> list[Any]:
    """Every leaf of ``tree`` in order (tensors, ``None``, plain values, stateful objects)."""
    return flatten(tree)[0]


def tensors(tree: Any) -> list[Tensor]:
    """Every tensor in ``tree``, in order (a tensor reached twice is listed twice)."""
    return [v for v in leaves(tree) if isinstance(v, Tensor)]


def leaves_with_paths(tree: Any) -> list[tuple[Path, Any]]:
    """Every leaf of ``tree`` with its path, in order."""
    out, paths, _ = flatten_with_paths(tree)
    return list(zip(paths, out))


def tensor_paths(tree: Any) -> dict[Path, Tensor]:
    """Every tensor in ``tree`` by its path."""
    return {p: v for p, v in leaves_with_paths(tree) if isinstance(v, Tensor)}


def containers(tree: Any) -> set[type]:
    """The container types ``tree`` holds (empty for a leaf)."""
    found: set[type] = set()

    def visit(s: Spec) -> None:
        if s.type is not None:
            found.add(s.type)
            for c in s.children:
                visit(c)

    visit(flatten(tree)[1])
    return found


def map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with every leaf replaced by ``fn(leaf)``, containers rebuilt as their own types."""
    values, spec = flatten(tree)
    return unflatten([fn(v) for v in values], spec)


def map_tensors(fn: Callable[[Tensor], Any], tree: Any, *, memo: dict[int, Any] | None = None) -> Any:
    """``tree`` with every tensor replaced by ``fn(tensor)``; other leaves as they are.

    ``memo`` (by ``id`` of the original tensor): a tensor reached several times (one mask object
    for every block) is mapped once and all its places get the same result, also across calls
    that pass the same ``memo``. The originals must stay alive while it is in use.
    """
    values, spec = flatten(tree)
    return unflatten(_mapped(values, [()] * len(values), lambda _, t: fn(t), memo), spec)


def map_tensors_with_paths(fn: Callable[[Path, Tensor], Any], tree: Any, *, memo: dict[int, Any] | None = None) -> Any:
    """:func:`map_tensors` with ``fn(path, tensor)``; with ``memo``, a shared tensor's first path decides."""
    values, paths, spec = flatten_with_paths(tree)
    return unflatten(_mapped(values, paths, fn, memo), spec)


def _mapped(values: list[Any], paths: list[Path], fn: Callable[[Path, Tensor], Any], memo: dict[int, Any] | None) -> list[Any]:
    out = []
    for path, value in zip(paths, values):
        if not isinstance(value, Tensor):
            out.append(value)
        elif memo is None:
            out.append(fn(path, value))
        else:
            if id(value) not in memo:
                memo[id(value)] = fn(path, value)
            out.append(memo[id(value)])
    return out


def path_str(path: Path) -> str:
    """``path`` as text, e.g. ``[1]['mask']`` or ``.hidden``."""
    return pytree.keystr(path)
