"""The blocks' nested arguments per sample (cache/arguments.py): packed into an entry and back, cut to rows."""

from __future__ import annotations

import pytest
import torch

from lightning_pipetransformer.cache.arguments import pack_block_inputs, select_rows, shared_once, unpack_block_inputs


def test_block_inputs_round_trip_and_refusals():
    mask, window = torch.ones(4, 1, 3, 3, dtype=torch.bool), torch.zeros(4, 1, 3, 3, dtype=torch.bool)
    cos_sin = (torch.randn(1, 3, 2), torch.randn(1, 3, 2))
    calls = [
        ((mask, None, torch.zeros(1, 3)), {"is_causal": True, "scale": 0.5, "rotary": cos_sin, "dims": (2, 3)}),
        ((window, None, torch.zeros(1, 3)), {"is_causal": True, "scale": 0.5, "rotary": cos_sin, "dims": (1, 1), "empty": ()}),
        ((mask,), {"extra": {"a": None, "b": [1.5]}}),
    ]
    extras = pack_block_inputs(calls, 4, 4)
    assert sum(name.startswith("t.") for name in extras) == 6  # mask, window, two zeros(1, 3), cos, sin: each once
    (a4, k4), (a5, k5), (a6, k6) = unpack_block_inputs(extras, [4, 5, 6])
    assert torch.equal(a4[0], mask) and a4[1] is None and a4[2].shape == (4, 3)  # broadcast row kept per sample
    assert torch.equal(a5[0], window) and torch.equal(a6[0], mask)
    assert k4["is_causal"] is True and k4["scale"] == 0.5 and k4["dims"] == (2, 3) and k5["dims"] == (1, 1)
    assert isinstance(k4["rotary"], tuple) and torch.equal(k4["rotary"][0], cos_sin[0].expand(4, 3, 2))
    assert k5["empty"] == () and k6 == {"extra": {"a": None, "b": [1.5]}}
    ((only_args, _),) = unpack_block_inputs(extras, [5])  # any subset of the stored blocks
    assert torch.equal(only_args[0], window)
    with pytest.raises(ValueError, match="no inputs for block 3"):
        unpack_block_inputs(extras, [3])
    # The argument is named as the model passes it, with its type (not the entry's internal path).
    with pytest.raises(TypeError, match=r"block 0's argument 1 is a tensor of shape \(7,\), neither \[batch=4"):
        pack_block_inputs([((torch.zeros(7),), {})], 0, 4)
    with pytest.raises(TypeError, match=r"block 2's argument resolution is a torch.Size"):
        pack_block_inputs([((), {"resolution": torch.Size([4, 4])})], 2, 4)
    with pytest.raises(TypeError, match=r"block 0's argument 1 \[1\] is a builtins.object"):
        pack_block_inputs([(((None, object()),), {})], 0, 4)


def test_select_rows_cuts_each_batch_tensor_once_and_leaves_the_rest():
    mask = torch.ones(4, 3)
    shared = torch.arange(3.0)  # not batch-shaped: every row's
    calls = [((mask, shared), {"flag": True}), ((mask,), {"pair": (mask, None)})]
    rows = torch.tensor([True, False, True, False])
    (a0, k0), (a1, k1) = select_rows(calls, rows, 4)
    assert a0[0].shape == (2, 3) and a0[1] is shared and k0 == {"flag": True}
    assert a1[0] is a0[0] and k1["pair"][0] is a0[0] and k1["pair"][1] is None  # one mask object, cut once


def test_shared_once_hashes_a_repeated_tensor_by_reference():
    mask = torch.ones(2, 3)
    seen = shared_once([((mask,), {}), ((mask,), {"m": mask})], 2)
    assert seen[0][0][0] is mask and seen[1][0][0] == "@0" and seen[1][1]["m"] == "@0"
