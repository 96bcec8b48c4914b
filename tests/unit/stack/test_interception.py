"""Block-level interception (stack.interception) and the executor's edge cases, on models' own loops.

Every equivalence test counts real block runs beside it: a bypassed pipeline gives the same
numbers on CPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_pipetransformer.pipe.pipeline import Pipeline
from lightning_pipetransformer.stack.deferred import Deferred
from lightning_pipetransformer.stack.interception import interception_stats, pipelined
from lightning_pipetransformer.stack.stack_call import InterceptionError
from tests.helpers.block_runs import ForwardRuns

WIDTH, BATCH, SEQ = 8, 6, 5


class Layer(nn.Module):
    """A block with a kind (read by the model's loop), a mask argument and rotary-like extras."""

    def __init__(self, kind: str = "full", out: str = "tensor", inplace: bool = False) -> None:
        super().__init__()
        self.attention_type = kind
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.act = nn.ReLU(inplace=inplace)
        self.out = out

    def forward(self, x, mask=None, rotary=None, extras=None):
        h = self.lin(self.act(x) if self.act.inplace else x)
        if mask is not None:
            h = h * mask[..., None]
        if rotary is not None:
            h = h * rotary[0] + rotary[1]
        if extras is not None:
            h = h + extras["bias"]
        y = x + torch.tanh(h)
        if self.out == "tuple":
            return y, None  # BLOOM / DeBERTa style
        if self.out == "triple":
            return y, y.mean(-1), None  # Swin style
        return y


class Model(nn.Module):
    """Loops the way current models do; ``loop`` picks the way."""

    def __init__(self, loop: str = "slice", out: str = "tensor", depth: int = 4, inplace: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Layer("sliding" if i % 2 else "full", out, inplace and i == 2) for i in range(depth))
        self.loop = loop
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x, masks, rotary, extras=None, n=None):
        if self.loop == "slice":  # Llama: a slice, and each layer's mask picked by its attribute
            for layer in self.layers[: n or len(self.layers)]:
                x = layer(x, masks.get(layer.attention_type, masks["full"]), rotary=rotary, extras=extras)
        elif self.loop == "index":  # BLOOM: the output is a tuple, its first element the hidden state
            for i, layer in enumerate(self.layers):
                outputs = layer(x, mask=masks[layer.attention_type], rotary=rotary)
                x = outputs[0]
        elif self.loop == "unpack":  # Swin: three values unpacked
            for layer in self.layers:
                x, _, _ = layer(x, masks[layer.attention_type], rotary)
        elif self.loop == "changes":  # the hidden state changed between blocks (DeBERTa-v2's conv after block 0)
            for i, layer in enumerate(self.layers):
                x = layer(x, masks["full"])
                if i == 0:
                    x = x * 2
        elif self.loop == "feeds":  # an intermediate output fed into a later block
            first = self.layers[0](x, masks["full"])
            x = self.layers[1](first, masks["full"], rotary=(first, first))
            for layer in self.layers[2:]:
                x = layer(x)
        return self.head(x.mean(1))


def inputs(batch=BATCH):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, SEQ, WIDTH, generator=g)
    full = (torch.rand(batch, SEQ, generator=g) > 0.2).float()
    sliding = torch.ones(batch, SEQ)
    sliding[:, 0] = 0
    rotary = (torch.rand(1, SEQ, WIDTH, generator=g), torch.rand(batch, SEQ, WIDTH, generator=g))  # broadcast + batch
    return x, {"full": full, "sliding": sliding}, rotary


def step(model, *args, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(*args, **kwargs)
    (out ** 2).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-6)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=1e-5, atol=1e-6, msg=name)


def pipeline(model, stages=2, chunks=3, num_frozen=0):
    blocks = list(model.layers)
    balance = {1: (len(blocks),), 2: (len(blocks) // 2, len(blocks) - len(blocks) // 2)}[stages]
    return Pipeline(blocks, balance, ["cpu"] * stages, chunks, num_frozen)


@pytest.mark.parametrize("loop, out", [("slice", "tensor"), ("index", "tuple"), ("unpack", "triple")])
def test_model_loops_engage_with_each_block_own_arguments(loop, out):
    model = Model(loop, out)
    x, masks, rotary = inputs()
    expected = step(model, x, masks, rotary)
    runs = ForwardRuns(model.layers)
    with pipelined(model.layers, pipeline(model)):
        step(model, x, masks, rotary)  # the first pass also learns what each block returns
        runs[:] = [0] * 4
        got = step(model, x, masks, rotary)
        stats = interception_stats(model.layers)
        assert (stats.deferred, stats.probes, stats.last_block_runs) == (2, 1, 6)
    assert runs == [3] * 4  # engaged: once per micro-batch
    assert_same(got, expected)
    assert all(type(layer) is Layer for layer in model.layers)


def test_changing_the_hidden_state_between_blocks_is_refused_at_the_first_batch():
    model = Model("changes")
    x, masks, rotary = inputs()
    with pipelined(model.layers, pipeline(model)), pytest.raises(InterceptionError, match=r"used the output of block 0 \(mul\).*no reading or changing it between blocks"):
        model(x, masks, rotary)


def test_an_intermediate_output_fed_to_a_later_block_is_refused():
    model = Model("feeds")
    x, masks, rotary = inputs()
    with pipelined(model.layers, pipeline(model)):
        # Refused from the first pass on: the probe, too, hands the model placeholders, not its own outputs.
        for _ in range(2):
            with pytest.raises(InterceptionError, match="extra argument"):
                model(x, masks, rotary)


def test_a_loop_that_stops_early_never_engages_and_its_placeholder_raises_when_used():
    model = Model("slice")
    x, masks, rotary = inputs()
    with pipelined(model.layers, pipeline(model)):
        model(x, masks, rotary)  # learns every block's output
        with pytest.raises(InterceptionError, match="a placeholder for a block output"):
            model(x, masks, rotary, n=2)  # the head reads block 1's output, which does not exist yet
    placeholder = Deferred(x, "the output of block 1")
    with pytest.raises(InterceptionError, match="the output of block 1 \\(shape\\)"):
        placeholder.shape
    assert placeholder.dtype == x.dtype and placeholder.device == x.device


def test_a_structure_change_between_passes_is_an_error():
    model = Model("index", "tuple")
    x, masks, rotary = inputs()
    with pipelined(model.layers, pipeline(model)):
        model(x, masks, rotary)
        for layer in model.layers:
            layer.out = "triple"
        with pytest.raises(InterceptionError, match="returned .* this time"):
            model(x, masks, rotary)


def test_in_place_op_on_a_stage_input_with_several_micro_batches():
    # Block 2 (the first of stage 1) applies ReLU(inplace=True) to its input: micro-batches that were
    # views of one tensor would share a version counter and fail at backward.
    model = Model("slice", inplace=True)
    x, masks, rotary = inputs()
    expected = step(model, x, masks, rotary)
    with pipelined(model.layers, pipeline(model)):
        step(model, x, masks, rotary)
        got = step(model, x, masks, rotary)
    assert_same(got, expected)


def test_in_place_op_on_a_split_argument_with_several_micro_batches():
    class ScaleInPlace(Layer):
        def forward(self, x, mask=None, rotary=None, extras=None):
            if self.attention_type != "scaled":
                return super().forward(x, mask)
            scale = extras["scale"].clamp_(0, 1)  # in place on a batch-shaped (split) argument, then saved by mul
            return x + self.lin(x) * scale[..., None]

    model = Model("slice")
    model.layers = nn.ModuleList(ScaleInPlace("scaled" if i == 2 else "full") for i in range(4))
    x, masks, rotary = inputs()
    scale = torch.randn(BATCH, SEQ)
    expected = step(model, x, masks, rotary, extras={"scale": scale.clone()})
    with pipelined(model.layers, pipeline(model)):
        step(model, x, masks, rotary, extras={"scale": scale.clone()})
        got = step(model, x, masks, rotary, extras={"scale": scale.clone()})
    assert_same(got, expected)


def test_a_whole_argument_mutated_in_place_is_refused():
    class Accumulate(Layer):
        def forward(self, x, mask=None, rotary=None, extras=None):
            extras["bias"].add_(1.0)  # one tensor for all samples, changed by every call
            return super().forward(x)

    model = Model("slice")
    model.layers = nn.ModuleList(Accumulate() for _ in range(4))
    x, masks, rotary = inputs()
    for grad in (True, False):  # the first pass too: a probe on copies, then the runner's pass
        with pipelined(model.layers, pipeline(model, chunks=2)), torch.set_grad_enabled(grad):
            with pytest.raises(InterceptionError, match="modified .*in place.* 2 times"):
                model(x, masks, rotary, extras={"bias": torch.zeros(WIDTH)})


def test_a_trainable_tensor_nested_in_the_arguments_keeps_frozen_blocks_in_the_graph():
    model = Model("slice")
    for layer in model.layers[:3]:
        layer.requires_grad_(False)
    x, masks, rotary = inputs()
    bias = nn.Parameter(torch.randn(WIDTH) * 0.1)  # trainable, inside a dict argument of every block
    expected = step(model, x, masks, rotary, extras={"bias": bias}), bias.grad.clone()
    with pipelined(model.layers, pipeline(model, num_frozen=3)):
        step(model, x, masks, rotary, extras={"bias": bias})
        bias.grad = None
        got = step(model, x, masks, rotary, extras={"bias": bias}), bias.grad.clone()
    assert_same(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])  # silently zero if the frozen blocks ran without a graph


@pytest.mark.parametrize("batch", [2, 0])
def test_a_batch_smaller_than_chunks_runs_with_fewer_micro_batches(batch):
    model = Model("slice")
    x, masks, rotary = inputs(max(batch, 1))
    x, masks = x[:batch], {k: v[:batch] for k, v in masks.items()}
    rotary = (rotary[0], rotary[1][:batch])
    with torch.no_grad():
        expected = model(x, masks, rotary)
    runs = ForwardRuns(model.layers)
    with pipelined(model.layers, pipeline(model, chunks=4)), torch.no_grad():
        model(x, masks, rotary)
        runs[:] = [0] * 4
        got = model(x, masks, rotary)
    torch.testing.assert_close(got, expected)
    assert runs == [max(batch, 1)] * 4  # one micro-batch per sample, one for an empty batch


def test_a_mutable_per_call_object_runs_as_one_micro_batch_with_a_warning():
    class KeyValueCache:
        def __init__(self):
            self.calls = 0

        def update(self):
            self.calls += 1

        def get_seq_length(self):
            return self.calls

    class Caching(Layer):
        def forward(self, x, mask=None, rotary=None, extras=None):
            extras["cache"].update()
            return super().forward(x)

    model = Model("slice")
    model.layers = nn.ModuleList(Caching() for _ in range(4))
    x, masks, rotary = inputs()
    pipe = pipeline(model, chunks=3)
    with pipelined(model.layers, pipe):
        first = KeyValueCache()
        model(x, masks, rotary, extras={"cache": first})  # the first pass runs as the model calls it, with gradients
        assert first.calls == 4 and interception_stats(model.layers).eager == 1
        cache = KeyValueCache()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(x, masks, rotary, extras={"cache": cache})
    assert cache.calls == 4  # once per block, as in the model's own loop (not once per micro-batch)
    assert pipe.stats.stateful_fallbacks == 1 and pipe.stats.micro_batches == 1
    assert sum("mutable object" in str(w.message) for w in caught) == 1


def test_an_unknown_folded_argument_is_named_when_a_block_fails():
    class Folded(Layer):
        def forward(self, x, mask=None, rotary=None, extras=None):
            bias = extras["heads_bias"].reshape(x.shape[0], 2, 1, 1).mean(1)  # [batch * 2, 1, 1] folded
            return super().forward(x) + bias

    model = Model("slice")
    model.layers = nn.ModuleList(Folded() for _ in range(4))
    x, masks, rotary = inputs()
    with pipelined(model.layers, pipeline(model, chunks=2)):
        extras = {"heads_bias": torch.randn(BATCH * 2, 1, 1)}
        with pytest.raises(InterceptionError, match=r"heads_bias.*\(12, 1, 1\).*use chunks=1"):
            model(x, masks, rotary, extras=extras)


@pytest.mark.parametrize("stages", [1, 2])
def test_a_non_tensor_hidden_state_gets_the_same_clear_error(stages):
    pipe = pipeline(Model("slice"), stages=stages, chunks=1)
    with pytest.raises(TypeError, match="hidden state"):
        pipe([torch.zeros(2, WIDTH)])
