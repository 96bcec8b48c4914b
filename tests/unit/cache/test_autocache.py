"""AutoCache installed in a model's loop: outputs and gradients equal the uncached model."""

from __future__ import annotations

import pytest
import torch

from lightning_pipetransformer.cache.autocache import AutoCache
from lightning_pipetransformer.cache.cached_stack import CachedStack
from lightning_pipetransformer.cache.prefix import StaleCacheError, run_blocks
from lightning_pipetransformer.freeze.apply import apply_freeze
from lightning_pipetransformer.stack.discovery import find_block_stack
from lightning_pipetransformer.stack.interception import install_pipeline, remove_pipeline
from lightning_pipetransformer.stack.observers import sees_block_runs
from tests.helpers.models import SEQ, VOCAB, tiny_bert


def batch(seed, n=6):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[::2, -3:] = 0
    return ids, mask


def grads_and_logits(model, ids, mask):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    logits.square().sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def install(model, cache, num_frozen):
    stack = find_block_stack(model)
    apply_freeze(stack, num_frozen, include_pre=True)
    cache.attach(stack, model)  # with the model as root: the embeddings are skipped where that is exact
    cache.move_boundary(stack, num_frozen, True, torch.device("cpu"), (0, 1))
    runner = cache_runner(model, cache, num_frozen)
    install_pipeline(stack.container, runner)
    return stack, runner


def warmed(tmp_path):
    """A 3-block BERT with blocks 0-1 cached, after one forward of batch 0: ``(model, cache, ids, mask)``."""
    torch.manual_seed(0)
    model = tiny_bert(3)
    cache = AutoCache(True, str(tmp_path), 10**7)
    install(model, cache, 2)
    ids, mask = batch(0)
    model(input_ids=ids, attention_mask=mask)
    return model, cache, ids, mask


def count_rows(module: torch.nn.Module) -> list[int]:
    """The batch size of every real call of ``module`` (marked: it counts real runs, and keeps skipping on)."""
    calls: list[int] = []
    module.register_forward_hook(sees_block_runs(lambda m, args, out: calls.append(out.shape[0])))
    return calls


def assert_same_step(plain, cached, ids, mask):
    """Logits and gradients of one step agree between the plain and the cached model."""
    expected = grads_and_logits(plain, ids, mask)
    actual = grads_and_logits(cached, ids, mask)
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-5, atol=1e-6)
    assert actual[1].keys() == expected[1].keys()
    for name in expected[1]:
        torch.testing.assert_close(actual[1][name], expected[1][name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("budget", [10**7, 0])  # in memory, and all on disk
def test_cached_equals_uncached_over_epochs_and_boundary_moves(tmp_path, budget):
    torch.manual_seed(0)
    plain, cached = tiny_bert(4), tiny_bert(4)
    cached.load_state_dict(plain.state_dict())
    apply_freeze(find_block_stack(plain), 1, include_pre=True)
    cache = AutoCache(True, str(tmp_path), budget)
    stack, _ = install(cached, cache, 1)
    word_rows = count_rows(cached.bert.embeddings.word_embeddings)  # runs only inside the real embeddings
    for seed in (0, 1):  # epoch 1: all misses; the first forward shows the embeddings' output reaches the stack
        assert_same_step(plain, cached, *batch(seed))
    assert word_rows == [6, 6] and cache.counters.embeddings_skipped == 1  # batch 1 skipped them, then ran them for its 6 misses
    word_rows.clear()
    for seed in (0, 1):  # epoch 2: all hit; the embeddings run only for the one-off verification of the first hits
        assert_same_step(plain, cached, *batch(seed))
    assert word_rows == [6] and cache.counters.embeddings_skipped == 3
    assert cache.store.stats().hits == 12 and cache.store.stats().misses == 12

    # Move the boundary 1 -> 3: entries are advanced, not recomputed from the input.
    apply_freeze(find_block_stack(plain), 3, include_pre=True)
    remove_pipeline(stack.container)
    _, runner = install(cached, cache, 3)
    cache.embeddings.verified_modes = {True}  # attach() starts unverified; this model was verified above (training mode)
    computed = []
    original = runner._prefix
    runner._prefix = lambda *a, **k: computed.append(a[0].shape[0]) or original(*a, **k)
    word_rows.clear()
    assert_same_step(plain, cached, *batch(0))
    assert_same_step(plain, cached, *batch(1))
    # All 12 hit; the only prefix (and embeddings) run is the one-off verification of the first hits.
    assert cache.store.stats().hits == 12 and computed == [6] and word_rows == [6]


def test_input_changed_in_forward_misses(tmp_path):
    model, cache, ids, mask = warmed(tmp_path)
    other = ids.clone()
    other[0, 0] = (other[0, 0] + 1) % VOCAB  # one token differs: that row misses
    model(input_ids=other, attention_mask=mask)
    stats = cache.store.stats()
    assert stats.hits == 5 and stats.misses == 7


def test_stale_source_is_detected(tmp_path):
    """Something changes the prefix where no version counter sees it (``.data``) and no pass start came: the first-hit
    verification, the backstop, catches it."""
    model, cache, ids, mask = warmed(tmp_path)
    weight = model.bert.embeddings.word_embeddings.weight  # not a uniform shift: LayerNorm hides that
    weight.data.add_(torch.randn_like(weight))
    with pytest.raises(StaleCacheError):
        model(input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("how", ["no_grad", "data_at_a_pass_start", "unfreeze", "swap"])
def test_a_changed_prefix_is_not_served_and_said(tmp_path, how):
    """The prefix changed behind the cache's back (version counter, a pass start's fingerprint, requires_grad, another
    parameter object): the cache stands aside (the output equals the plain model's), names the change, and serves
    again once the model is as the entries were computed (the swap back)."""
    model, cache, ids, mask = warmed(tmp_path)
    block = model.bert.encoder.layer[1]
    weight = block.attention.self.query.weight
    saved = weight
    if how == "no_grad":
        with torch.no_grad():
            weight.mul_(1.5)
    elif how == "data_at_a_pass_start":
        weight.data.mul_(1.5)
        cache.new_pass()
    elif how == "unfreeze":
        weight.requires_grad_(True)
    else:
        block.attention.self.query.weight = torch.nn.Parameter(weight.detach() * 1.5, requires_grad=False)
    hits = cache.store.stats().hits
    logits = model(input_ids=ids, attention_mask=mask).logits
    remove_pipeline(find_block_stack(model).container)
    plain = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits, plain)
    assert cache.store.stats().hits == hits and cache.counters.prefix_changes == 1  # not served, counted
    assert cache.changed is not None and ("query" in cache.changed.describe() or "values differ" in cache.changed.describe())
    if how == "swap":  # the entries' weights are back: served again
        block.attention.self.query.weight = saved
        install_pipeline(find_block_stack(model).container, cache_runner(model, cache))
        model(input_ids=ids, attention_mask=mask)
        assert cache.store.stats().hits == hits + 6 and cache.changed is None


def cache_runner(model, cache, num_frozen=2):
    stack = find_block_stack(model)
    active = run_blocks(stack.blocks[num_frozen:])
    return CachedStack(cache, stack.blocks, num_frozen, lambda call: active(call.hidden, call.calls))


def test_dropout_in_frozen_prefix_is_refused_or_turns_cache_off(tmp_path):
    torch.manual_seed(0)
    model = tiny_bert(3, dropout=0.1)
    stack = find_block_stack(model)
    apply_freeze(stack, 2, include_pre=True)
    stack.blocks[0].train()  # left in train mode: not deterministic
    with pytest.raises(Exception, match="(?i)dropout|determin"):
        AutoCache(True, str(tmp_path), 10**7).move_boundary(stack, 2, True, torch.device("cpu"), (0, 1))
    auto = AutoCache("auto", str(tmp_path), 10**7)
    with pytest.warns(UserWarning, match="turned off"):
        auto.move_boundary(stack, 2, True, torch.device("cpu"), (0, 1))
    assert auto.store is None and not auto.enabled


def test_unwritable_cache_dir_is_a_clear_error(tmp_path):
    from lightning_pipetransformer.cache.store import CacheConfigError, probe_cache_dir

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CacheConfigError, match="cache_dir"):
        probe_cache_dir(str(blocker / "cache"))
    probe_cache_dir(str(tmp_path / "ok"))


class TwoEmbeddings(torch.nn.Module):
    """The hidden state is tok(ids) + seg(segments): the first embedding's inputs do not name it."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, 8)
        self.seg = torch.nn.Embedding(2, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, ids, segments):
        hidden = self.tok(ids) + self.seg(segments)
        for block in self.blocks:
            hidden = block(hidden)
        return hidden


def test_keys_follow_the_hidden_state_not_only_the_first_embedding(tmp_path):
    torch.manual_seed(0)
    model, plain = TwoEmbeddings(), TwoEmbeddings()
    plain.load_state_dict(model.state_dict())
    cache = AutoCache(True, str(tmp_path), 10**7)
    install(model, cache, 2)
    apply_freeze(find_block_stack(plain), 2, include_pre=True)
    ids = torch.randint(0, VOCAB, (4, SEQ))
    zeros, ones = torch.zeros_like(ids), torch.ones_like(ids)
    with torch.no_grad():
        model(ids, zeros)
        out = model(ids, ones)  # same ids, other segments: must not hit the zeros' entries
        torch.testing.assert_close(out, plain(ids, ones))


class PairEncoder(torch.nn.Module):
    """Embeds two inputs, then runs the stack on the first: the recorder saw the second call last."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, a, b):
        first, _second = self.tok(a), self.tok(b)
        for block in self.blocks:
            first = block(first)
        return first


def test_pair_model_keys_on_what_reaches_the_stack(tmp_path):
    torch.manual_seed(0)
    model, plain = PairEncoder(), PairEncoder()
    plain.load_state_dict(model.state_dict())
    cache = AutoCache(True, str(tmp_path), 10**7)
    install(model, cache, 2)
    apply_freeze(find_block_stack(plain), 2, include_pre=True)
    x, y, z = (torch.randint(0, VOCAB, (4, SEQ)) for _ in range(3))
    with torch.no_grad():
        model(x, y)
        model(x, y)  # hits (and the first-hit verification passes)
        torch.testing.assert_close(model(z, y), plain(z, y))  # z was never seen: must not get x's entry
