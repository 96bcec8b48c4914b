"""When the first training forward may be served from kept entries before the call order is known, and the check
after its backward that it cut only gradients a plain run drops too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipetransformer.cache.budget import CacheConfigError
from lightning_pipetransformer.cache.first_forward import FirstForward, input_leaves, why_not


def embeddings(dropout: float = 0.0) -> nn.Module:
    return nn.Sequential(nn.Embedding(10, 4), nn.Dropout(dropout))


def test_a_frozen_deterministic_prefix_is_served():
    pre = embeddings().requires_grad_(False)
    hidden = pre(torch.arange(3)[None])
    assert input_leaves(hidden) == [] and why_not([("emb", pre)], [], input_leaves(hidden), pre_freezes=False) is None


def test_dropout_in_train_mode_is_not_served_as_in_a_plain_run():
    pre = embeddings(0.1).train()
    reason = why_not([("emb", pre)], [], [], pre_freezes=True)
    assert reason is not None and "Dropout" in reason and "until the call order is known" in reason


def test_a_gradient_into_the_embeddings_is_cut_only_if_they_freeze_before_the_backward():
    pre = embeddings()
    hidden = pre(torch.arange(3)[None])
    leaves = input_leaves(hidden)
    assert [id(t) for t in leaves] == [id(pre[0].weight)]
    assert why_not([("emb", pre)], [], leaves, pre_freezes=True) is None
    assert "still train" in why_not([("emb", pre)], [], leaves, pre_freezes=False)
    other = nn.Parameter(torch.ones(4))
    assert "outside the frozen prefix" in why_not([("emb", pre)], [], input_leaves(hidden * other), pre_freezes=True)
    assert why_not([("emb", pre)], [("cls", other)], input_leaves(hidden * other), pre_freezes=True) is None  # a loose one


def test_the_check_after_the_backward():
    pre = embeddings()
    early = FirstForward()
    early.note_cut({id(pre[0].weight): "emb.0.weight"}, [pre[0].weight])
    pre.requires_grad_(False)  # AutoFreeze froze them before the backward, as promised
    early.check_cut()
    early.note_cut({id(pre[0].weight): "emb.0.weight"}, [pre[0].weight])
    pre.requires_grad_(True)
    with pytest.raises(CacheConfigError, match="emb.0.weight still require"):
        early.check_cut()
    assert early.cut == []  # said once


def test_the_prefix_observed_confirms_or_refutes_the_one_opened_on():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    early = FirstForward()
    assert early.confirm([("a", a)]) is None  # nothing opened early
    early.opened([("a", a)])
    assert early.read_only and early.confirm([("a", a)]) is True and not early.read_only
    early.opened([("a", a)])
    assert early.confirm([("a", a), ("b", b)]) is False
