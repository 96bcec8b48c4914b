"""tree: one rule for nested block arguments and outputs, on the inputs where the walkers it replaces disagreed."""

from __future__ import annotations

from collections import OrderedDict, defaultdict, namedtuple

import pytest
import torch
import torch.utils._pytree as pytree
from transformers import DynamicCache
from transformers.modeling_outputs import BaseModelOutput

from lightning_pipetransformer import tree
from lightning_pipetransformer.cache.arguments import leaves as key_leaves
from lightning_pipetransformer.cache.arguments import select_rows, shared_once

Pair = namedtuple("Pair", "hidden aux")
Seq, Map = pytree.SequenceKey, pytree.MappingKey


class KeywordDict(dict):
    """A user's dict subclass built from keywords (pytree does not know it)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)


def tricky():
    """One of each: named tuple, ModelOutput with a None field, nested dicts, None, plain values, a
    key-value cache, torch.Size, an unregistered dict subclass, and one tensor in two places."""
    shared = torch.randn(4, 3)
    other = torch.randn(4, 2)
    value = (
        Pair(shared, None),
        BaseModelOutput(last_hidden_state=other, hidden_states=(shared,)),
        {"outer": {"inner": [other, 7, "s"]}, "none": None},
        OrderedDict(x=other),
        KeywordDict(k=shared),
        torch.Size([4, 3]),
        DynamicCache(),
    )
    return value, shared, other


def test_leaves_and_paths_follow_pytree_keys():
    value, shared, other = tricky()
    pairs = tree.leaves_with_paths(value)
    paths = [p for p, _ in pairs]
    assert paths[:2] == [(Seq(0), pytree.GetAttrKey("hidden")), (Seq(0), pytree.GetAttrKey("aux"))]  # named tuple: field names
    # A ModelOutput keeps only its fields that are not None (hidden_states here; attentions absent).
    assert paths[2:4] == [(Seq(1), Map("last_hidden_state")), (Seq(1), Map("hidden_states"), Seq(0))]
    assert tree.path_str(paths[4]) == "[2]['outer']['inner'][0]"
    found = [v for _, v in pairs]
    assert found[0] is shared and found[1] is None and found[2] is other and found[3] is shared
    assert found[5:7] == [7, "s"] and found[7] is None
    assert isinstance(found[-1], DynamicCache)  # a key-value cache is a leaf, not walked
    assert found[-2] is value[5]  # torch.Size: a leaf (pytree would rebuild it as a plain tuple)
    assert [id(t) for t in tree.tensors(value)] == [id(shared), id(other), id(shared), id(other), id(other), id(shared)]
    assert tree.tensor_paths(value)[(Seq(4), Map("k"))] is shared  # the unregistered dict subclass is walked


def test_map_tensors_rebuilds_every_container_as_its_own_type():
    value, shared, other = tricky()
    out = tree.map_tensors(lambda t: t * 2, value)
    assert type(out) is tuple and len(out) == len(value)
    assert type(out[0]) is Pair and torch.equal(out[0].hidden, shared * 2) and out[0].aux is None
    assert type(out[1]) is BaseModelOutput and out[1][0] is out[1].last_hidden_state and out[1].attentions is None
    assert torch.equal(out[1].hidden_states[0], shared * 2)
    assert type(out[2]) is dict and out[2]["outer"]["inner"][1:] == [7, "s"] and out[2]["none"] is None
    assert type(out[3]) is OrderedDict and torch.equal(out[3]["x"], other * 2)
    assert type(out[4]) is KeywordDict and torch.equal(out[4]["k"], shared * 2)
    assert out[5] is value[5]
    assert out[6] is value[6]  # the cache object itself


def test_defaultdict_keeps_its_factory():
    d = defaultdict(list, a=torch.ones(1))
    out = tree.map_tensors(lambda t: t + 1, d)
    assert type(out) is defaultdict and out.default_factory is list and torch.equal(out["a"], torch.full((1,), 2.0))


def test_a_shared_tensor_is_mapped_once_with_a_memo():
    value, shared, _ = tricky()
    calls = []
    memo: dict[int, object] = {}
    out = tree.map_tensors(lambda t: calls.append(t) or t.clone(), value, memo=memo)
    assert sum(c is shared for c in calls) == 1
    assert out[0].hidden is out[1].hidden_states[0] is out[4]["k"]  # both places get the one copy
    again = tree.map_tensors(lambda t: t.clone(), (shared,), memo=memo)  # across calls too
    assert again[0] is out[0].hidden
    without = tree.map_tensors(lambda t: t.clone(), value)
    assert without[0].hidden is not without[4]["k"]


def test_map_tensors_with_paths_gives_each_tensor_its_path():
    value, shared, _ = tricky()
    seen = {}
    tree.map_tensors_with_paths(lambda p, t: seen.setdefault(tree.path_str(p), t), value)
    assert seen["[0].hidden"] is shared and "[3]['x']" in seen


def test_a_bare_tensor_and_plain_values_are_leaves():
    t = torch.ones(2)
    assert tree.map_tensors(lambda x: x + 1, t).tolist() == [2.0, 2.0]
    assert tree.leaves(None) == [None] and tree.leaves("abc") == ["abc"] and tree.containers(t) == set()
    assert tree.map_leaves(lambda v: v, ()) == () and tree.leaves([]) == []


def test_specs_compare_structure_not_leaves():
    a, b = torch.ones(2), torch.zeros(3)
    _, s1 = tree.flatten((a, {"m": None}))
    _, s2 = tree.flatten((b, {"m": a}))
    _, s3 = tree.flatten((b, {"n": a}))
    assert s1 == s2 and s1 != s3 and s1.num_leaves == 2
    with pytest.raises(ValueError, match="holds 2 leaves; got 1"):
        tree.unflatten([a], s1)
    assert tree.containers((a, Pair(a, {"x": a}))) == {tuple, Pair, dict}


def test_the_cache_walkers_reach_the_same_tensors():
    """The cache's keys, row selection and shared_once walk with the tree: on the tricky inputs they
    reach exactly the tensors the micro-batch split reaches, and a row selection keeps the containers'
    types (a named tuple stays one), or a key would miss a tensor that the split cuts."""
    value, shared, other = tricky()
    value = value[:-1]  # select_rows and keys: a cache object never reaches them
    reached = sorted(id(t) for t in tree.tensors(value))
    assert sorted(id(v) for _, v in key_leaves(value, "batch") if isinstance(v, torch.Tensor)) == reached
    cut = select_rows(value, torch.tensor([True, False, True, False]), 4)
    assert len(tree.tensors(cut)) == len(reached) and all(t.shape[0] == 2 for t in tree.tensors(cut))
    assert tree.flatten(cut)[1] == tree.flatten(value)[1]  # the same structure and types, fewer rows
    once = shared_once([((value,), {})], 4)
    assert len(tree.tensors(once)) == len({id(t) for t in tree.tensors(value)})  # repeats become references
