"""Content and index keys: exact on near-duplicates, independent of batch layout, device-free arithmetic checked."""

from __future__ import annotations

import pytest
import torch

from lightning_pipetransformer.cache import keys as ck
from lightning_pipetransformer.cache.keys import content_keys, index_keys, row_hashes, tensor_digest

M64 = (1 << 64) - 1


def _ref_mix_a(z: int) -> int:
    z &= M64
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & M64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _ref_mix_b(z: int) -> int:
    z &= M64
    z ^= z >> 33
    z = (z * 0xFF51AFD7ED558CCD) & M64
    z ^= z >> 33
    z = (z * 0xC4CEB9FE1A85EC53) & M64
    return z ^ (z >> 33)


def test_row_hash_matches_a_pure_python_reference():
    # Guards the signed-int64 emulation of unsigned arithmetic (wrapping multiply, logical shift).
    rows = torch.tensor([[0, 1, -1, 2**40 + 7, -(2**63)], [5, 4, 3, 2, 1]], dtype=torch.int64)
    got = row_hashes(rows)
    words = rows.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    for r in range(2):
        ref_a = sum(_ref_mix_a((w | (i << 32)) ^ 0x9E3779B97F4A7C15) for i, w in enumerate(words[r].tolist())) & M64
        ref_b = sum(_ref_mix_b((w | (i << 32)) ^ 0xD1B54A32D192ED03) for i, w in enumerate(words[r].tolist())) & M64
        assert got[r, 0].item() & M64 == ref_a
        assert got[r, 1].item() & M64 == ref_b


def test_keys_are_per_row_and_independent_of_the_rest_of_the_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 30000, (8, 16), generator=g)
    mask = torch.ones(8, 16, dtype=torch.long)
    full = content_keys({"input_ids": ids, "attention_mask": mask})
    assert all(len(k) == 32 and int(k, 16) >= 0 for k in full)
    # The same sample in another batch, at another position, gets the same key.
    perm = torch.tensor([5, 2, 7])
    part = content_keys({"attention_mask": mask[perm], "input_ids": ids[perm]})  # dict order irrelevant
    assert part == [full[i] for i in perm.tolist()]
    assert content_keys({"input_ids": ids, "attention_mask": mask}) == full  # deterministic


def test_one_token_changes_every_key():
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 30000, (1, 64), generator=g)
    variants = base.repeat(64 * 2 + 1, 1)
    for pos in range(64):  # +1 and -1 at every position: 128 near-duplicates plus the original
        variants[1 + 2 * pos, pos] += 1
        variants[2 + 2 * pos, pos] -= 1
    mask = torch.ones_like(variants)
    keys = content_keys(variants, mask)
    assert len(set(keys)) == len(keys)
    # A changed attention mask alone is another input too.
    mask2 = mask.clone()
    mask2[0, -1] = 0
    assert content_keys(variants[:1], mask2[:1]) != content_keys(variants[:1], mask[:1])


def test_one_pixel_one_ulp_changes_the_key():
    g = torch.Generator().manual_seed(2)
    image = torch.rand(1, 1, 28, 28, generator=g)
    variants = image.repeat(1 + 28, 1, 1, 1)
    bits = variants.view(torch.int32)
    for i in range(28):  # the smallest possible change of one pixel: one ulp (next float32 up)
        bits[1 + i, 0, i, i] += 1
    assert all(variants[1 + i, 0, i, i] != image[0, 0, i, i] for i in range(28))
    keys = content_keys(variants)
    assert len(set(keys)) == len(keys)
    zeros = torch.zeros(2, 4)
    zeros[1, 0] = -0.0  # a different bit pattern: exact means exact
    assert len(set(content_keys(zeros))) == 2


def test_no_collisions_among_many_random_and_swapped_rows():
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 8, (20000, 12), generator=g)  # small alphabet: many near-duplicates
    rows = torch.unique(rows, dim=0)
    assert len(set(content_keys(rows))) == rows.shape[0]
    swapped = torch.tensor([[1, 2, 3, 4], [2, 1, 3, 4], [1, 2, 4, 3]])
    assert len(set(content_keys(swapped))) == 3


def test_dtype_shape_shared_tensors_and_plain_values_enter_the_key():
    ids = torch.arange(12).reshape(3, 4)
    base = content_keys(ids)
    assert content_keys(ids.to(torch.int32)) != base  # same numbers, another dtype
    assert content_keys(ids.reshape(3, 2, 2)) != base  # same bits, another shape
    assert content_keys(ids, torch.ones(4)) != base  # a tensor shared by all rows
    assert content_keys(ids, {"flag": True}) != content_keys(ids, {"flag": False})
    assert content_keys(ids, None) != base
    half = torch.ones(3, 4, dtype=torch.bfloat16)
    assert len(set(content_keys(half, torch.ones(3, dtype=torch.bool)))) == 1


def test_bad_input_is_refused():
    with pytest.raises(TypeError, match="cannot hash"):
        content_keys(torch.zeros(2, 3), object())
    with pytest.raises(ValueError, match="batch dimension"):
        content_keys(None, 3)
    with pytest.raises(ValueError, match="batch size"):
        content_keys(torch.zeros(2, 3), batch_size=5)


def test_chunked_tensor_digest_equals_one_pass_and_sees_one_element(monkeypatch):
    t = torch.randn(1000)
    whole = tensor_digest(t)
    monkeypatch.setattr(ck, "_CHUNK_WORDS", 64)  # many chunks: sums are associative
    assert tensor_digest(t) == whole
    t2 = t.clone()
    t2.view(torch.int32)[777] += 1  # one ulp
    assert tensor_digest(t2) != whole


def test_index_keys():
    assert index_keys(torch.tensor([3, 0]), "train") == ["traini3", "traini0"]
    assert index_keys([7]) == ["i7"]
    assert index_keys([7], "val") != index_keys([7], "train")
    with pytest.raises(ValueError, match="namespace"):
        index_keys([1], "../x")
    with pytest.raises(ValueError, match="non-negative"):
        index_keys([-1])
    with pytest.raises(TypeError, match="integers"):
        index_keys(torch.tensor([1.0]))
    assert ck.DEFAULT_CACHE_KEY == "content"


def test_index_keys_with_no_tensor_among_the_block_arguments_are_made_on_the_host():
    """Nothing the blocks get is on the device: the keys' suffix is made on the host, whatever the
    device, so a served step makes no host wait for it (a meta device proves no tensor went there)."""
    from lightning_pipetransformer.cache.prefix import with_block_arguments

    calls = [((None,), {"output_attentions": False}), ((None,), {"output_attentions": False})]
    on_meta = with_block_arguments(["i0", "i1"], calls, torch.device("meta"))
    on_host = with_block_arguments(["i0", "i1"], calls, torch.device("cpu"))
    assert on_meta == on_host and on_meta is not None and on_meta[0] != on_meta[1]
    changed = with_block_arguments(["i0", "i1"], [((None,), {"output_attentions": True})] * 2, torch.device("cpu"))
    assert changed is not None and changed[0] != on_host[0]  # the arguments still enter the keys
