"""AutoCache skips the embeddings on served batches: exact, and loud when it cannot be exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipetransformer.cache.autocache import AutoCache
from lightning_pipetransformer.cache.embedding_skip import SkipError
from lightning_pipetransformer.freeze.apply import apply_freeze
from lightning_pipetransformer.stack.discovery import find_block_stack
from lightning_pipetransformer.stack.interception import installed_pipeline, remove_pipeline
from tests.helpers.models import SEQ, VOCAB, tiny_bert, tiny_vit
from tests.unit.cache.test_autocache import batch, count_rows, install


def plain_and_cached(make, tmp_path, num_frozen):
    """Two equal models with ``num_frozen`` blocks frozen: one plain, one served by an AutoCache; and the cache."""
    torch.manual_seed(0)
    plain, cached = make(), make()
    cached.load_state_dict(plain.state_dict())
    apply_freeze(find_block_stack(plain), num_frozen, include_pre=True)
    cache = AutoCache(True, str(tmp_path), 10**7)
    install(cached, cache, num_frozen)
    return plain, cached, cache


@pytest.fixture
def bert_with_cache(tmp_path):
    """A 3-block BERT with 2 blocks frozen and served by an AutoCache that may skip its embeddings."""
    torch.manual_seed(0)
    model = tiny_bert(3)
    cache = AutoCache(True, str(tmp_path), 10**7)
    install(model, cache, 2)
    return model, cache


def test_half_hit_batch_runs_the_frozen_blocks_for_the_misses_only(bert_with_cache):
    model, cache = bert_with_cache
    ids, mask = batch(0)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)  # stores all 6, shows the output reaches the stack
        model(input_ids=ids[:1], attention_mask=mask[:1])  # verification of the first hit
        runner = installed_pipeline(find_block_stack(model).container)
        prefix_rows: list[int] = []
        original = runner._prefix
        runner._prefix = lambda h, *a, **k: prefix_rows.append(h.shape[0]) or original(h, *a, **k)
        word_rows = count_rows(model.bert.embeddings.word_embeddings)
        mixed = torch.cat([ids[:3], torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(9))])
        out = model(input_ids=mixed, attention_mask=mask).logits
    # The embeddings run once, on the whole batch (they are cheap; see Skipped.rows); the frozen
    # blocks only for the 3 new samples.
    assert word_rows == [6] and prefix_rows == [3] and cache.counters.embeddings_skipped == 1
    remove_pipeline(find_block_stack(model).container)
    cache.detach()
    with torch.no_grad():
        torch.testing.assert_close(out, model(input_ids=mixed, attention_mask=mask).logits, rtol=1e-5, atol=1e-6)


def test_embeddings_called_outside_the_model_forward_are_real(bert_with_cache):
    model, cache = bert_with_cache
    ids, mask = batch(0)
    model(input_ids=ids, attention_mask=mask)
    model(input_ids=ids, attention_mask=mask)
    assert cache.counters.embeddings_skipped == 1
    direct = model.bert.embeddings(input_ids=ids)  # a user's own call: not inside BertModel.forward
    assert torch.isfinite(direct).all() and cache.counters.embeddings_skipped == 1


def test_vit_skips_patch_embeddings_exactly(tmp_path):
    plain, cached, cache = plain_and_cached(lambda: tiny_vit(3), tmp_path, 2)
    images = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    for _ in range(3):
        expected = plain(pixel_values=images).logits
        torch.testing.assert_close(cached(pixel_values=images).logits, expected, rtol=1e-5, atol=1e-6)
    assert cache.counters.embeddings_skipped == 2


class Rescaled(nn.Module):
    """Embeddings, then (when ``scale`` is set) a change of their output, then the stack."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))
        self.head = nn.Linear(dim, 2)
        self.scale = False
        self.early_exit = False
        self.inplace = False
        self.bump_ids = False
        self.peek: torch.Tensor | None = None  # embed these too, after ``ids``, and ignore them

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        if self.peek is not None:
            self.embed(self.peek)
        if self.early_exit:
            return x.mean(dim=1)
        if self.scale:
            x = x * 2
        if self.inplace:
            x.mul_(2)  # the same tensor object, a new version
        if self.bump_ids:
            ids.add_(0)  # the embeddings' input changed in place (a new version) after they ran
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


@pytest.mark.parametrize("change", ["scale", "early_exit", "inplace", "bump_ids"])
def test_placeholder_that_does_not_reach_the_stack_raises(tmp_path, change):
    torch.manual_seed(0)
    model = Rescaled()
    cache = AutoCache(True, str(tmp_path), 10**7)
    install(model, cache, 1)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(0))
    model(ids)  # the output reaches the stack unchanged: skipping is armed
    model(ids)
    assert cache.counters.embeddings_skipped == 1
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
    assert word_rows == [6, 6, 6] and cache.counters.embeddings_skipped == 0
    cache.detach()
    assert "forward" not in model.bert.embeddings.__dict__


def test_in_place_change_after_the_embeddings_is_never_skipped_and_stays_exact(tmp_path):
    plain, model, cache = plain_and_cached(Rescaled, tmp_path, 1)
    model.inplace = plain.inplace = True
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, VOCAB, (4, SEQ), generator=g) for _ in range(2))
    for ids in (a, b, a, b):
        torch.testing.assert_close(model(ids), plain(ids))
    assert not cache.embeddings.verified_modes and cache.counters.embeddings_skipped == 0
    assert cache.store.stats().hits == 8  # keyed on the hidden state itself, which is exact


def soft_prompt_grads(model, soft, ids, mask):
    """One step with ``inputs_embeds = word embeddings + a trainable soft prompt``: the prompt's gradient."""
    soft.grad = None
    embeds = model.bert.embeddings.word_embeddings(ids) + soft
    model(inputs_embeds=embeds, attention_mask=mask).logits.square().sum().backward()
    return soft.grad


def test_trainable_inputs_embeds_keep_their_gradient(tmp_path):
    plain, cached, cache = plain_and_cached(lambda: tiny_bert(3), tmp_path, 2)
    soft = torch.nn.Parameter(torch.randn(1, SEQ, 32) * 0.1)
    ids, mask = batch(0)
    for _ in range(3):
        expected = soft_prompt_grads(plain, soft, ids, mask).clone()
        actual = soft_prompt_grads(cached, soft, ids, mask)
        assert actual is not None
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    assert cache.counters.embeddings_skipped == 0


def test_output_made_to_require_grad_by_a_hook_is_never_skipped(tmp_path):
    torch.manual_seed(0)
    model = tiny_bert(3)
    cache = AutoCache(True, str(tmp_path), 10**7)
    install(model, cache, 2)
    model.enable_input_require_grads()  # a forward hook on the word embeddings: their output requires grad
    ids, mask = batch(0)
    for _ in range(3):
        model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert cache.counters.embeddings_skipped == 0


def test_validation_under_inference_mode_skips_and_is_exact(bert_with_cache):
    model, cache = bert_with_cache
    ids, mask = batch(0)
    model(input_ids=ids, attention_mask=mask)  # a training-mode forward shows the output reaches the stack
    other, _ = batch(5)
    with torch.inference_mode():
        # Real (a new signature: no grad; its entries keyed by the inputs, shown to name the hidden
        # state above), then skipped and all hits (verified once), then skipped again.
        outputs = [model(input_ids=other, attention_mask=mask).logits for _ in range(3)]
    assert cache.counters.embeddings_skipped == 2 and cache.store.stats().hits == 12
    remove_pipeline(find_block_stack(model).container)
    cache.detach()
    with torch.inference_mode():
        expected = model(input_ids=other, attention_mask=mask).logits
    for out in outputs:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_keys_come_from_the_skipped_call_not_a_later_one(tmp_path):
    plain, model, cache = plain_and_cached(Rescaled, tmp_path, 1)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, VOCAB, (4, SEQ), generator=g) for _ in range(2))
    model(a)  # arms skipping
    model(b)  # skipped, stores b
    model.peek = b  # the embeddings run again (for real, on b) between the skipped call on a and the stack
    torch.testing.assert_close(model(a), plain(a))  # a's entry, never b's
    assert cache.counters.embeddings_skipped == 2


class SharedPositionEmbeddings(nn.Module):
    """Token embeddings plus one position vector per column, from a 1-D ``positions`` shared by every row."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, dim)
        self.positions = nn.Embedding(SEQ, dim)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(positions)[None]


class SharedPositions(nn.Module):
    """Embeddings that read an argument shared by all rows, then the stack (a 1-D position_ids, as BERT took
    before transformers 5.25 made its mask builder read it per row)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embeddings = SharedPositionEmbeddings(dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))
        self.head = nn.Linear(dim, 2)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(ids, positions)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


def test_rows_of_a_half_hit_batch_keep_shared_inputs_whole(tmp_path):
    # A 1-D argument shared by all rows, whose length equals the batch size: cutting rows out of the
    # embeddings' inputs would cut it too and give the misses wrong positions.
    plain, model, cache = plain_and_cached(SharedPositions, tmp_path, 2)
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, VOCAB, (SEQ, SEQ), generator=g)
    b = a.clone()
    b[-1] = torch.randint(0, VOCAB, (SEQ,), generator=g)  # 7 hits, 1 miss
    positions = torch.arange(SEQ)
    with torch.no_grad():
        model(a, positions)  # stores a, arms skipping
        model(a, positions)  # skipped, all hits, verified
        out = model(b, positions)  # skipped; the real embeddings run for the miss
        torch.testing.assert_close(out, plain(b, positions), rtol=1e-5, atol=1e-6)
    assert cache.counters.embeddings_skipped == 2


class DropoutAfterEmbeddings(nn.Module):
    """T5-style: embeddings, then a dropout (the identity in eval mode only), then the blocks."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))
        self.head = nn.Linear(dim, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(ids))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


def test_skipping_shown_safe_in_eval_mode_is_not_used_in_training_mode(tmp_path):
    _, model, cache = plain_and_cached(DropoutAfterEmbeddings, tmp_path, 1)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():  # Trainer(inference_mode=False) validation: versions tracked, dropout is the identity
        model(ids)
        model(ids)
    assert cache.embeddings.verified_modes == {False} and cache.counters.embeddings_skipped == 1
    model.train()
    for _ in range(2):  # the dropout makes a new tensor: never skipped here, and no SkipError
        model(ids).sum().backward()
    assert cache.counters.embeddings_skipped == 1
