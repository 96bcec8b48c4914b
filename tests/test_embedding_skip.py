"""AutoCache skips the embeddings on served batches: exact, and loud when it cannot be exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipetransformer.autocache import AutoCache
from lightning_pipetransformer.core.discovery import find_block_stack
from lightning_pipetransformer.core.embedding_skip import SkipError
from lightning_pipetransformer.core.freezing import apply_freeze
from lightning_pipetransformer.core.pipeline import remove_pipeline
from models import SEQ, VOCAB, tiny_bert, tiny_vit
from test_autocache import batch, count_rows, install


@pytest.fixture
def bert_with_cache(tmp_path):
    """A 3-block BERT with 2 blocks frozen and served by an AutoCache that may skip its embeddings."""
    torch.manual_seed(0)
    model = tiny_bert(3)
    cache = AutoCache(True, str(tmp_path), 10**7)
    install(model, cache, 2)
    return model, cache


def test_half_hit_batch_runs_embeddings_for_the_misses_only(bert_with_cache):
    model, cache = bert_with_cache
    ids, mask = batch(0)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)  # stores all 6, shows the output reaches the stack
        model(input_ids=ids[:1], attention_mask=mask[:1])  # verification of the first hit: one real row
        word_rows = count_rows(model.bert.embeddings.word_embeddings)
        mixed = torch.cat([ids[:3], torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(9))])
        out = model(input_ids=mixed, attention_mask=mask).logits
    assert word_rows == [3]  # the 3 new samples; the 3 hits skip the embeddings
    remove_pipeline(find_block_stack(model).container)
    cache.detach()
    with torch.no_grad():
        torch.testing.assert_close(out, model(input_ids=mixed, attention_mask=mask).logits, rtol=1e-5, atol=1e-6)


def test_embeddings_called_outside_the_model_forward_are_real(bert_with_cache):
    model, cache = bert_with_cache
    ids, mask = batch(0)
    model(input_ids=ids, attention_mask=mask)
    model(input_ids=ids, attention_mask=mask)
    assert cache.embeddings_skipped == 1
    direct = model.bert.embeddings(input_ids=ids)  # a user's own call: not inside BertModel.forward
    assert torch.isfinite(direct).all() and cache.embeddings_skipped == 1


def test_vit_skips_patch_embeddings_exactly(tmp_path):
    torch.manual_seed(0)
    plain, cached = tiny_vit(3), tiny_vit(3)
    cached.load_state_dict(plain.state_dict())
    apply_freeze(find_block_stack(plain), 2, include_pre=True)
    cache = AutoCache(True, str(tmp_path), 10**7)
    install(cached, cache, 2)
    images = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    for _ in range(3):
        expected = plain(pixel_values=images).logits
        torch.testing.assert_close(cached(pixel_values=images).logits, expected, rtol=1e-5, atol=1e-6)
    assert cache.embeddings_skipped == 2


class Rescaled(nn.Module):
    """Embeddings, then (when ``scale`` is set) a change of their output, then the stack."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))
        self.head = nn.Linear(dim, 2)
        self.scale = False
        self.early_exit = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        if self.early_exit:
            return x.mean(dim=1)
        if self.scale:
            x = x * 2
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


@pytest.mark.parametrize("change", ["scale", "early_exit"])
def test_placeholder_that_does_not_reach_the_stack_raises(tmp_path, change):
    torch.manual_seed(0)
    model = Rescaled()
    cache = AutoCache(True, str(tmp_path), 10**7)
    install(model, cache, 1)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(0))
    model(ids)  # the output reaches the stack unchanged: skipping is armed
    model(ids)
    assert cache.embeddings_skipped == 1
    setattr(model, change, True)
    with pytest.raises(SkipError, match="cache_skip_embeddings=False"):
        model(ids)


def test_skipping_off_runs_the_embeddings_every_time(tmp_path):
    torch.manual_seed(0)
    model = tiny_bert(3)
    cache = AutoCache(True, str(tmp_path), 10**7, skip_embeddings=False)
    install(model, cache, 2)
    word_rows = count_rows(model.bert.embeddings.word_embeddings)
    ids, mask = batch(0)
    for _ in range(3):
        model(input_ids=ids, attention_mask=mask)
    assert word_rows == [6, 6, 6] and cache.embeddings_skipped == 0
    cache.detach()
    assert "forward" not in model.bert.embeddings.__dict__
