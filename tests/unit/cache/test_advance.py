"""Boundary moves (cache/advance.py): an advance equals computing from scratch, and the cache in the forward
pass (hits + misses) equals no cache before and after it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import BertConfig, BertModel

from lightning_pipetransformer.cache.advance import MAX_HELD_BYTES, advance_store, shard_of
from lightning_pipetransformer.cache.arguments import pack_block_inputs, select_rows
from lightning_pipetransformer.cache.batch import CachedBatch
from lightning_pipetransformer.cache.keys import content_keys
from lightning_pipetransformer.cache.prefix import run_blocks
from lightning_pipetransformer.cache.store import ActivationStore
from lightning_pipetransformer.cache.validity import prefix_fingerprint
from lightning_pipetransformer.freeze.apply import apply_freeze
from lightning_pipetransformer.stack.discovery import find_block_stack
from lightning_pipetransformer.stack.interception import install_pipeline, remove_pipeline
from lightning_pipetransformer.stack.stack_call import StackCall

SEQ, VOCAB = 8, 50


def _bert() -> BertModel:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return BertModel(config).eval()


def _batch(seed: int, n: int = 6, padded: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    mask = torch.ones(n, SEQ, dtype=torch.long)
    if padded:
        mask[::2, SEQ - 3 :] = 0
    return ids, mask


class CachedStack:
    """What the strategy installs in place of the stack: the frozen prefix comes from the store.

    The model's loop hands it one pass (every block's arguments); keys were computed from the
    batch before the forward (``self.keys``).
    """

    def __init__(self, blocks: list[torch.nn.Module], num_frozen: int, store: ActivationStore) -> None:
        self.blocks = tuple(blocks)
        self.num_frozen = num_frozen
        self.store = store
        self.keys: list[str] = []
        self.computed = 0

    def run(self, call: StackCall) -> torch.Tensor:
        hidden, frozen = call.hidden, self.num_frozen
        batch = hidden.shape[0]

        def rows(miss: torch.Tensor) -> torch.Tensor:
            self.computed += int(miss.sum())
            return select_rows(hidden, miss, batch)

        boundary = CachedBatch(
            self.store, self.keys, rows=rows, calls=call.calls[:frozen], extras=pack_block_inputs(call.calls[frozen:], frozen, batch),
            blocks=self.blocks[:frozen], prefix=run_blocks(list(self.blocks[:frozen])),
            sample_shape=hidden.shape[1:], dtype=hidden.dtype, device=hidden.device,
        ).boundary()
        return run_blocks(list(self.blocks[frozen:]))(boundary, call.calls[frozen:])


def _store(stack, num_frozen: int, path, budget: int = 10**6) -> ActivationStore:
    return ActivationStore(path, prefix_fingerprint(stack, num_frozen), num_frozen, memory_budget=budget)


def test_cache_on_equals_cache_off_with_hits_and_misses(tmp_path):
    model = _bert()
    stack = find_block_stack(model)
    apply_freeze(stack, 2, include_pre=True)
    cached = CachedStack(stack.blocks, 2, _store(stack, 2, tmp_path, budget=7 * (SEQ * 32 * 4 + SEQ * SEQ)))  # 7 entries
    batches = [_batch(0), _batch(1, padded=False), _batch(0), _batch(2)]
    batches.append((torch.cat([batches[0][0][:3], batches[3][0][3:]]), torch.cat([batches[0][1][:3], batches[3][1][3:]])))
    for ids, mask in batches:
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
        cached.keys = content_keys({"input_ids": ids, "attention_mask": mask})
        install_pipeline(stack.container, cached)  # type: ignore[arg-type]
        try:
            with torch.no_grad():
                got = model(input_ids=ids, attention_mask=mask).last_hidden_state
        finally:
            remove_pipeline(stack.container)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # 3 new batches of 6 computed; the repeat and the mixed batch came from the store
    # (memory for the first 7 entries, disk for the rest).
    assert cached.computed == 18
    stats = cached.store.stats()
    assert stats.hits == 12 and stats.memory_hits > 0 and stats.disk_hits > 0


@pytest.mark.parametrize("max_held_bytes", [MAX_HELD_BYTES, 1], ids=["groups-fill", "held-bytes-cap"])
def test_boundary_advance_equals_activations_from_scratch(tmp_path, max_held_bytes):
    model = _bert()
    stack = find_block_stack(model)
    apply_freeze(stack, 1, include_pre=True)
    cached = CachedStack(stack.blocks, 1, _store(stack, 1, tmp_path, budget=8 * (SEQ * 32 * 4 + SEQ * SEQ)))  # 8 of 17 in memory
    batches = [_batch(0), _batch(1, padded=False), _batch(2, n=5)]
    for ids, mask in batches:  # fill the cache at boundary 1 (masks and None masks)
        cached.keys = content_keys({"input_ids": ids, "attention_mask": mask})
        with torch.no_grad(), _installed(stack, cached):
            model(input_ids=ids, attention_mask=mask)
    src = cached.store
    apply_freeze(stack, 3, include_pre=True)
    dst = _store(stack, 3, tmp_path, budget=0)
    assert src.stats().entries_in_memory == 8
    assert advance_store(src, dst, run_blocks(stack.blocks[1:3]), batch_size=4, max_held_bytes=max_held_bytes) == 17
    assert src.stats().entries_in_memory == 0  # released as they were advanced
    assert advance_store(src, dst, run_blocks(stack.blocks[1:3])) == 0  # idempotent
    for ids, mask in batches:
        captured: dict[str, torch.Tensor] = {}
        hook = stack.blocks[3].register_forward_pre_hook(lambda m, a: captured.setdefault("h", a[0]))
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)  # from scratch: boundary-3 activation enters block 3
        hook.remove()
        hit, hits = dst.lookup(content_keys({"input_ids": ids, "attention_mask": mask}))
        assert hit.all()
        torch.testing.assert_close(hits, captured["h"], rtol=1e-5, atol=1e-6)
    # Then the model with the advanced cache equals the model without one.
    ids, mask = batches[0]
    cached3 = CachedStack(stack.blocks, 3, dst)
    cached3.keys = content_keys({"input_ids": ids, "attention_mask": mask})
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
        with _installed(stack, cached3):
            got = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert cached3.computed == 0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


class _installed:
    def __init__(self, stack, fn) -> None:
        self.stack, self.fn = stack, fn

    def __enter__(self) -> None:
        install_pipeline(self.stack.container, self.fn)

    def __exit__(self, *exc: Any) -> None:
        remove_pipeline(self.stack.container)


def test_sharded_advance_covers_every_entry_once(tmp_path):
    src = ActivationStore(tmp_path, "a" * 32, 1, memory_budget=0)
    keys = [f"k{i}" for i in range(20)]
    src.store(keys, torch.randn(20, 3), pack_block_inputs([((torch.ones(20, 2), None), {"is_causal": False})], 1, 20))

    def run(h, calls):
        ((m, _none), kwargs), = calls
        assert kwargs == {"is_causal": False}
        return h * 2 + m.sum(1, keepdim=True)

    done = 0
    for rank in range(3):
        dst = ActivationStore(tmp_path, "b" * 32, 2, memory_budget=0)
        done += advance_store(src, dst, run, shard=(rank, 3))
    assert done == 20 and len({shard_of(k, 3) for k in keys}) == 3
    hit, hits = dst.lookup(keys)
    assert hit.all()
    torch.testing.assert_close(hits, src.lookup(keys)[1] * 2 + 2)


def test_advance_refuses_entries_without_block_inputs_and_going_back(tmp_path):
    src = ActivationStore(tmp_path, "a" * 32, 1, memory_budget=0)
    src.store(["x"], torch.zeros(1, 2))  # no block inputs recorded
    with pytest.raises(ValueError, match="without its block inputs"):
        advance_store(src, ActivationStore(tmp_path, "b" * 32, 2, memory_budget=0), lambda h, calls: h)
    with pytest.raises(ValueError, match="forward only"):
        advance_store(src, src, lambda h, calls: h)
