"""Prefix fingerprint and determinism check: a stale entry (weight, boundary, config, input) is never hit."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertModel

from lightning_pipetransformer.cache.keys import content_keys
from lightning_pipetransformer.cache.store import ActivationStore
from lightning_pipetransformer.cache.validity import (
    NondeterministicPrefixError,
    check_deterministic,
    nondeterministic_reasons,
    prefix_fingerprint,
    prefix_modules,
)
from lightning_pipetransformer.freeze.apply import apply_freeze
from lightning_pipetransformer.stack.discovery import find_block_stack


def _bert(seed: int = 0, **overrides) -> BertModel:
    torch.manual_seed(seed)
    config = dict(
        vocab_size=50, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    config.update(overrides)
    return BertModel(BertConfig(**config)).eval()


def _nudge(param: torch.Tensor) -> None:
    with torch.no_grad():
        param.view(-1)[0] += 1e-6


def test_fingerprint_covers_frozen_weights_boundary_and_config_only():
    model = _bert()
    stack = find_block_stack(model)
    base = prefix_fingerprint(stack, 2)
    assert base == prefix_fingerprint(stack, 2) and len(base) == 32
    assert prefix_fingerprint(stack, 3) != base
    assert prefix_fingerprint(stack, 2, include_pre=False) != base
    assert prefix_fingerprint(stack, 2, extra="autocast=bf16") != base
    # Training the active blocks and the pooler does not invalidate the cache ...
    _nudge(stack.blocks[2].output.dense.weight)
    _nudge(model.pooler.dense.weight)
    assert prefix_fingerprint(stack, 2) == base
    # ... a frozen weight, or an embedding, does.
    _nudge(stack.blocks[1].attention.self.query.bias)
    assert prefix_fingerprint(stack, 2) != base
    model2 = _bert()
    stack2 = find_block_stack(model2)
    _nudge(model2.embeddings.word_embeddings.weight)
    assert prefix_fingerprint(stack2, 2) != base
    # Same weights, other hyper-parameters (eps, attention implementation).
    assert prefix_fingerprint(find_block_stack(_bert(layer_norm_eps=1e-5)), 2) != base
    assert prefix_fingerprint(find_block_stack(_bert(attn_implementation="eager")), 2) != base


def test_fingerprint_covers_a_private_flag_that_changes_the_forward_not_torch_bookkeeping():
    # PEFT turns its adapters off with a private flag on each LoRA layer (_disable_adapters): the same weights, another
    # function. Before: private attributes were left out, and a kept or current store served the adapters' entries.
    stack = find_block_stack(_bert())
    base = prefix_fingerprint(stack, 2)
    stack.blocks[0].register_full_backward_hook(lambda *_: None)  # nn.Module's own _is_full_backward_hook flips
    assert prefix_fingerprint(stack, 2) == base
    stack.blocks[1].attention.self.query._disable_adapters = True
    assert prefix_fingerprint(stack, 2) != base
    stack.blocks[1].attention.self.query._disable_adapters = False
    assert prefix_fingerprint(stack, 2) != base  # a flag set is a flag: False is not "absent"
    del stack.blocks[1].attention.self.query._disable_adapters
    assert prefix_fingerprint(stack, 2) == base


def test_stale_entries_are_never_hit(tmp_path):
    model = _bert()
    stack = find_block_stack(model)
    ids = torch.randint(0, 50, (3, 8), generator=torch.Generator().manual_seed(0))
    keys = content_keys(ids)
    first = ActivationStore(tmp_path, prefix_fingerprint(stack, 2), 2, memory_budget=0)
    first.store(keys, torch.randn(3, 8, 32))
    assert ActivationStore(tmp_path, prefix_fingerprint(stack, 2), 2, memory_budget=0).lookup(keys)[0].all()
    # Another boundary, or a changed frozen weight: another store, nothing found.
    assert not ActivationStore(tmp_path, prefix_fingerprint(stack, 3), 3, memory_budget=0).lookup(keys)[0].any()
    _nudge(stack.blocks[0].output.LayerNorm.weight)
    assert not ActivationStore(tmp_path, prefix_fingerprint(stack, 2), 2, memory_budget=0).lookup(keys)[0].any()


def test_determinism_check():
    model = _bert(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    stack = find_block_stack(model)
    modules = prefix_modules(stack, 2)
    assert any("requires grad" in r for r in nondeterministic_reasons(modules))
    apply_freeze(stack, 2, include_pre=True)  # what AutoFreeze does: no grad, eval mode
    assert nondeterministic_reasons(modules) == []
    check_deterministic(modules)
    model.train()  # a user's model.train() flips frozen blocks back
    reasons = nondeterministic_reasons(modules)
    assert any("Dropout" in r and "train mode" in r for r in reasons)
    with pytest.raises(NondeterministicPrefixError, match="eval mode"):
        check_deterministic(modules)


def test_determinism_check_sees_batchnorm_and_float_drop_probabilities():
    class DropPath(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop_prob = 0.1

    net = nn.Sequential(nn.BatchNorm1d(4), DropPath()).requires_grad_(False)
    reasons = nondeterministic_reasons([("net", net)])
    assert len(reasons) == 2 and "BatchNorm1d" in reasons[0] and "drop_prob" in reasons[1]
    assert nondeterministic_reasons([("net", net.eval())]) == []
