"""Splitting arguments into micro-batches and joining outputs (core.microbatch)."""

from collections import OrderedDict, namedtuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipetransformer.core.microbatch import batch_size, gather, map_tensors, scatter


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 20), chunks=st.integers(1, 20))
def test_scatter_gather_roundtrip_follows_tensor_split(batch, chunks):
    x = torch.arange(batch * 3.0).reshape(batch, 3)
    if chunks > batch:
        with pytest.raises(ValueError, match=rf"batch of {batch} samples into {chunks} micro-batches"):
            scatter((x,), {}, chunks)
        return
    split = scatter((x,), {}, chunks)
    expected = [c.shape[0] for c in torch.tensor_split(x, chunks)]
    assert list(split.sizes) == expected
    assert sum(split.sizes) == batch and max(split.sizes) - min(split.sizes) <= 1
    joined = gather([a[0] for a, _ in split.batches], split.sizes)
    assert torch.equal(joined, x)


def test_batch_shaped_arguments_are_split_and_others_passed_whole():
    x = torch.randn(10, 4, 8)
    mask = torch.ones(10, 4)
    bias = torch.randn(8)  # not batch-shaped: passed whole
    causal = torch.randn(4, 4)  # first dim != batch: passed whole
    broadcast = torch.randn(1, 4)  # broadcastable over the batch: passed whole
    split = scatter((x, mask, None, 3.0), {"bias": bias, "causal": causal, "b": broadcast, "k": "v"}, 3)
    assert split.split_args == {0, 1} and split.split_kwargs == set()
    assert split.sizes == (4, 3, 3)
    for m, (args, kwargs) in enumerate(split.batches):
        assert args[0].shape[0] == split.sizes[m] and args[1].shape[0] == split.sizes[m]
        assert args[2] is None and args[3] == 3.0
        assert kwargs["bias"] is bias and kwargs["causal"] is causal and kwargs["b"] is broadcast
        assert kwargs["k"] == "v"
    assert torch.equal(torch.cat([a[1] for a, _ in split.batches]), mask)


def test_batch_shaped_keyword_arguments_are_split():
    x, mask = torch.randn(6, 2), torch.randn(6, 5)
    split = scatter((x,), {"attention_mask": mask}, 2)
    assert split.split_kwargs == {"attention_mask"}
    assert [kw["attention_mask"].shape[0] for _, kw in split.batches] == [3, 3]


def test_explicit_batch_args_override_the_heuristic():
    # A (seq, seq) mask with seq == batch looks batch-shaped to the heuristic.
    x, square, mask = torch.randn(4, 4, 2), torch.randn(4, 4), torch.randn(4, 4)
    assert scatter((x, square), {"mask": mask}, 2).split_args == {0, 1}
    split = scatter((x, square), {"mask": mask}, 2, batch_args=("mask",))
    assert split.split_args == {0} and split.split_kwargs == {"mask"}
    assert all(a[1] is square for a, _ in split.batches)
    # Named but absent or None this call: not split, no error.
    split = scatter((x, None), {}, 2, batch_args=(1, "mask"))
    assert split.split_args == {0} and split.batches[0][0][1] is None


def test_explicit_batch_arg_with_wrong_shape_is_an_error():
    with pytest.raises(ValueError, match=r"'mask' has shape \(3, 4\).*batch size .* is 4"):
        scatter((torch.randn(4, 2),), {"mask": torch.randn(3, 4)}, 2, batch_args=("mask",))


def test_hidden_must_be_a_batched_tensor():
    with pytest.raises(TypeError, match="hidden state"):
        batch_size([1, 2])
    with pytest.raises(TypeError, match=r"shape \(\)"):
        scatter((torch.tensor(1.0),), {}, 1)


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


def test_map_tensors_reaches_nested_tensors_only():
    a = torch.ones(2)
    out = map_tensors(lambda t: t * 2, (a, [a, None], Output(x=a), "s"))
    assert torch.equal(out[0], a * 2) and torch.equal(out[1][0], a * 2) and out[1][1] is None
    assert isinstance(out[2], Output) and torch.equal(out[2]["x"], a * 2) and out[3] == "s"
