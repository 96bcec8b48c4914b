"""Splitting arguments into micro-batches and joining outputs (pipe.microbatch)."""

from collections import OrderedDict, namedtuple

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipetransformer.pipe.microbatch import batch_size, gather, scatter
from lightning_pipetransformer.tree import map_tensors, tensor_paths


def one_block(*args, **kwargs):
    """The per-block arguments of a pass over one block."""
    return [(args, kwargs)]


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 20), chunks=st.integers(1, 20))
def test_scatter_gather_roundtrip_follows_tensor_split(batch, chunks):
    x = torch.arange(batch * 3.0).reshape(batch, 3)
    split = scatter(x, one_block(), chunks)
    # A batch smaller than chunks (an epoch's last batch) is cut into fewer micro-batches, never refused.
    expected = [c.shape[0] for c in torch.tensor_split(x, min(chunks, batch))]
    assert list(split.sizes) == expected == [h.shape[0] for h in split.hidden]
    assert sum(split.sizes) == batch and max(split.sizes) - min(split.sizes) <= 1
    assert torch.equal(gather(list(split.hidden), split.sizes), x)


def test_an_empty_batch_is_one_empty_micro_batch():
    split = scatter(torch.zeros(0, 3), one_block(torch.zeros(0, 2)), 4)
    assert split.sizes == (0,) and split.calls[0][0][0][0].shape == (0, 2)


def test_batch_shaped_arguments_are_split_and_others_passed_whole():
    x = torch.randn(10, 4, 8)
    mask = torch.ones(10, 4)
    bias = torch.randn(8)  # not batch-shaped: passed whole
    causal = torch.randn(4, 4)  # first dim != batch: passed whole
    broadcast = torch.randn(1, 4)  # broadcastable over the batch: passed whole
    split = scatter(x, one_block(mask, None, 3.0, bias=bias, causal=causal, b=broadcast, k="v"), 3)
    assert split.sizes == (4, 3, 3)
    assert {name for name, _ in split.whole} == {"block 0 argument 'bias'", "block 0 argument 'causal'", "block 0 argument 'b'"}
    for m, ((args, kwargs),) in enumerate(split.calls):
        assert args[0].shape[0] == split.sizes[m]
        assert args[1] is None and args[2] == 3.0
        assert kwargs["bias"] is bias and kwargs["causal"] is causal and kwargs["b"] is broadcast
        assert kwargs["k"] == "v"
    assert torch.equal(torch.cat([c[0][0][0] for c in split.calls]), mask)


def test_every_block_keeps_its_own_arguments_and_a_shared_tensor_is_cut_once():
    x, full, window = torch.randn(6, 2), torch.ones(6, 5), torch.zeros(6, 5)
    cos_sin = (torch.randn(6, 5, 2), torch.randn(1, 5, 2))  # nested: a batch-shaped and a broadcast tensor
    calls = [((), {"mask": full, "rot": cos_sin}), ((), {"mask": window, "rot": cos_sin}), ((), {"mask": full, "rot": cos_sin})]
    split = scatter(x, calls, 2)
    for m, (b0, b1, b2) in enumerate(split.calls):
        assert torch.equal(b0[1]["mask"], full[3 * m : 3 * m + 3]) and torch.equal(b1[1]["mask"], window[3 * m : 3 * m + 3])
        assert b2[1]["mask"] is b0[1]["mask"]  # one tensor, one set of pieces, shared again
        assert isinstance(b0[1]["rot"], tuple) and torch.equal(b0[1]["rot"][0], cos_sin[0][3 * m : 3 * m + 3])
        assert b0[1]["rot"][1] is cos_sin[1]


def test_pieces_are_copies_so_in_place_ops_do_not_share_a_version_counter():
    x = torch.randn(4, 3)
    split = scatter(x, one_block(), 2)
    first, second = split.hidden
    first.add_(1)
    assert second._version == 0 and x._version == 0 and first.data_ptr() != x.data_ptr()
    assert scatter(x, one_block(), 1).hidden[0] is x  # one micro-batch: the tensor itself, no copy


def test_masks_and_other_arguments_without_gradient_share_memory_not_copies():
    """A 4-D mask [B, 1, S, S] is not copied per pass (its pieces alias its rows, each with a version
    counter of its own); an argument that requires grad, and the hidden state, still are."""
    x = torch.randn(4, 3, 2)
    mask = torch.randn(4, 1, 3, 3)
    bias = torch.randn(4, 3, requires_grad=True)
    alibi = torch.randn(4 * 2, 1, 3)
    split = scatter(x, [((), {"mask": mask, "bias": bias, "alibi": alibi})], 2)
    for m, calls in enumerate(split.calls):
        kwargs = calls[0][1]
        piece = kwargs["mask"]
        assert piece.data_ptr() == mask[2 * m].data_ptr() and torch.equal(piece, mask[2 * m : 2 * m + 2])  # no copy
        assert kwargs["alibi"].data_ptr() == alibi[4 * m].data_ptr()  # a folded argument too
        assert kwargs["bias"].data_ptr() != bias[2 * m].data_ptr()  # requires grad: a copy
    assert split.hidden[0].data_ptr() != x.data_ptr()  # the hidden state's pieces stay copies
    first, second = (calls[0][1]["mask"] for calls in split.calls)
    before = second._version
    first.mul_(2)  # a block writing its micro-batch's rows in place: the model's tensor changes as in its own loop ...
    assert torch.equal(mask[:2], first) and second._version == before  # ... and the other micro-batch's counter does not move
    with torch.inference_mode():
        frozen = torch.randn(4, 3)
        piece = scatter(torch.randn(4, 2), [((frozen,), {})], 2).calls[1][0][0][0]
        assert piece.is_inference() and piece.data_ptr() == frozen[2].data_ptr()  # views there


def test_batch_major_folded_arguments_are_cut_by_sample():
    batch, heads = 6, 3
    alibi = torch.arange(batch * heads * 1.0).reshape(batch * heads, 1, 1)  # row b*heads+h: sample b
    split = scatter(torch.zeros(batch, 2), one_block(alibi=alibi), 2)
    assert [c[0][1]["alibi"].shape[0] for c in split.calls] == [9, 9]
    assert torch.equal(torch.cat([c[0][1]["alibi"] for c in split.calls]), alibi)
    # Under another name a [batch * k, ...] tensor is not assumed folded: passed whole (and named).
    split = scatter(torch.zeros(batch, 2), one_block(rel=alibi), 2)
    assert split.calls[0][0][1]["rel"] is alibi and split.whole[0][0] == "block 0 argument 'rel'"


def test_stateful_objects_are_reported():
    class Cache:
        def update(self, *a): ...

        def get_seq_length(self): ...

    cache = Cache()
    split = scatter(torch.zeros(4, 2), one_block(cache=cache), 2)
    assert split.stateful == ("block 0 argument 'cache'",)
    assert all(c[0][1]["cache"] is cache for c in split.calls)


def test_a_square_argument_with_batch_rows_is_cut_by_the_heuristic():
    # A (seq, seq) mask with seq == batch looks batch-shaped: it is cut (the blocks then fail on its
    # shape, or the first-batch self-check finds the difference), never silently passed whole.
    x, square = torch.randn(4, 4, 2), torch.randn(4, 4)
    assert scatter(x, one_block(square), 2).calls[0][0][0][0].shape == (2, 4)


def test_hidden_must_be_a_batched_tensor():
    with pytest.raises(TypeError, match="hidden state"):
        batch_size([1, 2])
    with pytest.raises(TypeError, match=r"shape \(\)"):
        scatter(torch.tensor(1.0), one_block(), 1)


Pair = namedtuple("Pair", "hidden aux")


class Output(OrderedDict):
    """Stands in for a Hugging Face ModelOutput (a dict subclass built from keywords)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)


def test_gather_keeps_structure():
    sizes = (2, 1)
    a, b = torch.randn(2, 3), torch.randn(1, 3)
    stat = torch.randn(5)  # not batch-shaped: taken from the first micro-batch
    assert torch.equal(gather([a, b], sizes), torch.cat([a, b]))
    out = gather([(a, None, stat, 7), (b, None, stat * 0, 8)], sizes)
    assert isinstance(out, tuple) and torch.equal(out[0], torch.cat([a, b]))
    assert out[1] is None and out[2] is stat and out[3] == 7
    pair = gather([Pair(a, [a]), Pair(b, [b])], sizes)
    assert isinstance(pair, Pair) and isinstance(pair.aux, list) and torch.equal(pair.aux[0], torch.cat([a, b]))
    mo = gather([Output(last=a, pooled=a[:, 0]), Output(last=b, pooled=b[:, 0])], sizes)
    assert isinstance(mo, Output) and torch.equal(mo["pooled"], torch.cat([a, b])[:, 0])
    only = (a, None)
    assert gather([only], (2,)) is only  # one micro-batch: returned as is
    with pytest.raises(ValueError, match="different structure"):
        gather([{"x": a}, {"y": b}], sizes)  # nothing to join them into


def test_gather_leaves_the_named_broadcast_tensors_unjoined():
    sizes = (1, 1, 1)  # one sample each: a (1, n) tensor looks per-sample
    rows = [torch.randn(1, 4) for _ in sizes]
    bias = torch.randn(1, 4)
    outputs = [(r, {"bias": bias, "per_sample": r[:, :2]}) for r in rows]
    assert gather(outputs, sizes)[1]["bias"].shape == (3, 4)  # by shape alone
    paths = tensor_paths(outputs[0])
    at = pytree.SequenceKey, pytree.MappingKey
    bias_path = (at[0](1), at[1]("bias"))
    assert list(paths) == [(at[0](0),), bias_path, (at[0](1), at[1]("per_sample"))] and paths[bias_path] is bias
    out = gather(outputs, sizes, broadcast={bias_path})
    assert out[1]["bias"] is bias and out[1]["per_sample"].shape == (3, 2) and torch.equal(out[0], torch.cat(rows))


def test_map_tensors_reaches_nested_tensors_only():
    a = torch.ones(2)
    out = map_tensors(lambda t: t * 2, (a, [a, None], Output(x=a), "s"))
    assert torch.equal(out[0], a * 2) and torch.equal(out[1][0], a * 2) and out[1][1] is None
    assert isinstance(out[2], Output) and torch.equal(out[2]["x"], a * 2) and out[3] == "s"


def test_an_argument_expanded_along_the_batch_is_copied_not_aliased():
    """Its rows are one memory: aliases would let an in-place write to one micro-batch change the others."""
    from lightning_pipetransformer.pipe.microbatch import _aliases

    mask = torch.zeros(1, 3).expand(4, 3)
    pieces = _aliases(torch.tensor_split(mask, 2))
    pieces[0].add_(1)
    assert torch.equal(pieces[1], torch.zeros(2, 3)) and torch.equal(mask, torch.zeros(4, 3))
    rows = torch.zeros(4, 3)
    aliased = _aliases(torch.tensor_split(rows, 2))
    aliased[0].add_(1)  # rows that do not overlap stay aliases: the write lands in the argument
    assert torch.equal(rows[:2], torch.ones(2, 3)) and torch.equal(rows[2:], torch.zeros(2, 3))
