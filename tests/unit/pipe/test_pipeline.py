"""The pipeline executor equals the plain loop over the blocks (pipe.pipeline), on CPU."""

import contextlib
import copy

import pytest
import torch
from torch import nn

from lightning_pipetransformer import devices as dev
from lightning_pipetransformer.devices.handover import _Hop
from lightning_pipetransformer.pipe.pipeline import Pipeline, clock_cycles
from lightning_pipetransformer.stack.interception import install_pipeline, pipelined, remove_pipeline
from lightning_pipetransformer.stack.stack_call import hidden_of
from tests.helpers.block_runs import ForwardRuns
from tests.unit.pipe.stand_in_streams import Timeline

pytestmark = pytest.mark.usefixtures("one_thread")


BATCH, SEQ, WIDTH, DEPTH = 10, 4, 8, 8
BALANCES = {1: (8,), 2: (4, 4), 3: (3, 3, 2), 4: (2, 2, 2, 2)}
BALANCES_4 = {1: (4,), 2: (2, 2)}


class Block(nn.Module):
    """A residual MLP block taking a batch-shaped mask and non-batch extras, like a layer."""

    def __init__(self, tuple_out: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.ff = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Dropout(0.0), nn.Linear(2 * WIDTH, WIDTH))
        self.tuple_out = tuple_out

    def forward(self, x, mask=None, bias=None, *, scale=1.0):
        h = self.ff(self.norm(x)) * scale
        if mask is not None:
            h = h * mask[..., None]
        if bias is not None:
            h = h + bias
        # Deterministic train/eval difference: the executor must not change modes.
        out = x + (h if self.training else 0.5 * h)
        return (out, None, out.mean(-1)) if self.tuple_out else out


def make_blocks(tuple_out=False, depth=DEPTH, seed=0):
    torch.manual_seed(seed)
    return [Block(tuple_out) for _ in range(depth)]


def plain(blocks, hidden, *args, **kwargs):
    """The loop the pipeline stands for."""
    out = hidden
    for block in blocks:
        out = block(hidden, *args, **kwargs)
        hidden = hidden_of(out)
    return out


def loss_of(out):
    hidden = hidden_of(out)
    weight = torch.linspace(-1, 1, hidden.numel()).reshape(hidden.shape)
    loss = (hidden * weight).sum()
    if isinstance(out, tuple):
        loss = loss + (out[2] ** 2).sum()
    return loss


def grads(params):
    return [None if p.grad is None else p.grad.clone() for p in params]


def run_both(blocks, pipe, hidden, *args, **kwargs):
    """(output, grads) of the plain loop and of the pipeline; grads None under no_grad."""
    params = [p for b in blocks for p in b.parameters()]
    results = []
    for fn in (lambda *a, **k: plain(blocks, *a, **k), pipe):
        for p in params:
            p.grad = None
        out = fn(hidden, *args, **kwargs)
        if torch.is_grad_enabled():
            loss_of(out).backward()
        results.append((out, grads(params)))
    return results


def assert_same(a, b):
    if a is None or b is None:
        assert a is None and b is None
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)


def inputs(requires_grad=False):
    torch.manual_seed(1)
    hidden = torch.randn(BATCH, SEQ, WIDTH, requires_grad=requires_grad)
    mask = (torch.rand(BATCH, SEQ) > 0.3).float()
    bias = torch.randn(WIDTH)
    return hidden, mask, bias


@pytest.mark.parametrize("num_frozen", [0, 5])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("chunks", [1, 2, 3, 8])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_equals_plain_loop(stages, chunks, train, num_frozen):
    blocks = make_blocks()
    for block in blocks:
        block.train(train)
    for block in blocks[:num_frozen]:
        block.requires_grad_(False)
    pipe = Pipeline(blocks, BALANCES[stages], ["cpu"] * stages, chunks, num_frozen)
    hidden, mask, bias = inputs()
    calls = []
    hooks = [
        b.register_forward_hook(lambda *_, i=i: calls.append((i, torch.is_grad_enabled())))
        for i, b in enumerate(blocks)
    ]
    (ref, ref_grads), (out, out_grads) = run_both(blocks, pipe, hidden, mask, bias=bias, scale=0.7)
    for h in hooks:
        h.remove()
    assert_same(ref, out)
    assert_same(ref_grads, out_grads)
    frozen_params = [p for b in blocks[:num_frozen] for p in b.parameters()]
    assert all(p.grad is None for p in frozen_params)
    assert all(g is not None for g in out_grads[len(frozen_params) :])
    # The pipeline's calls: every block once per micro-batch; frozen ones without a graph.
    pipe_calls = calls[DEPTH:]
    assert sorted(pipe_calls) == sorted((i, i >= num_frozen) for i in range(DEPTH) for _ in range(chunks))


@pytest.mark.parametrize("stages,chunks", [(1, 3), (3, 1), (4, 8), (2, 3)])
def test_eval_under_no_grad(stages, chunks):
    blocks = make_blocks()
    for block in blocks:
        block.eval()
    pipe = Pipeline(blocks, BALANCES[stages], ["cpu"] * stages, chunks)
    hidden, mask, bias = inputs()
    with torch.no_grad():
        (ref, _), (out, _) = run_both(blocks, pipe, hidden, mask, bias=bias)
    assert not out.requires_grad
    assert_same(ref, out)


@pytest.mark.parametrize("stages,chunks", [(1, 1), (2, 3), (4, 8)])
def test_tuple_outputs_keep_their_structure(stages, chunks):
    blocks = make_blocks(tuple_out=True)
    pipe = Pipeline(blocks, BALANCES[stages], ["cpu"] * stages, chunks)
    hidden, mask, bias = inputs()
    (ref, ref_grads), (out, out_grads) = run_both(blocks, pipe, hidden, mask, bias)
    assert isinstance(out, tuple) and out[1] is None and out[2].shape == (BATCH, SEQ)
    assert_same(ref, out)
    assert_same(ref_grads, out_grads)


def test_model_output_and_an_output_without_a_hidden_state():
    from transformers.modeling_outputs import BaseModelOutput

    class DictBlock(Block):
        def forward(self, x, mask=None):
            return {"h": super().forward(x, mask), "unused": None}

    class ModelOutputBlock(Block):
        def forward(self, x, mask=None):
            out = super().forward(x, mask)
            return BaseModelOutput(last_hidden_state=out, hidden_states=(out,))

    hidden, mask, _ = inputs()
    torch.manual_seed(0)
    blocks = [ModelOutputBlock() for _ in range(4)]
    out = Pipeline(blocks, (1, 3), ["cpu"] * 2, 3)(hidden, mask)
    ref = plain(blocks, hidden, mask)
    assert isinstance(out, BaseModelOutput)
    assert_same(ref.last_hidden_state, out.last_hidden_state)
    assert_same(ref.hidden_states, out.hidden_states)

    # A dict has no first element: which entry is the hidden state is unknown, refused with the way out.
    blocks = [DictBlock() for _ in range(4)]
    with pytest.raises(TypeError, match=r"type dict.*use pipe_len=1, chunks=1 and cache=False"):
        Pipeline(blocks, (2, 2), ["cpu"] * 2, 3)(hidden, mask)


def test_whole_arguments_reach_every_block_unsplit_and_accumulate_grads():
    blocks = make_blocks(depth=4)
    hidden, mask, bias = inputs()
    bias.requires_grad_(True)
    seen = []
    blocks[3].register_forward_pre_hook(lambda m, a, k: seen.append((a[0].shape[0], a[1].shape[0], k["bias"])), with_kwargs=True)
    pipe = Pipeline(blocks, (2, 2), ["cpu"] * 2, 3)
    out = pipe(hidden, mask, bias=bias)
    assert [(n, m) for n, m, _ in seen] == [(4, 4), (3, 3), (3, 3)]
    assert all(b is bias for _, _, b in seen)  # passed whole, not even copied on CPU
    (pipe_grad,) = torch.autograd.grad(loss_of(out), bias)
    (ref_grad,) = torch.autograd.grad(loss_of(plain(blocks, hidden, mask, bias=bias)), bias)
    torch.testing.assert_close(pipe_grad, ref_grad)


def test_a_square_non_batch_tensor_with_batch_rows_is_refused_loudly():
    class SquareMix(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)

        def forward(self, x, mix):  # mix: (seq, seq), not batch-shaped
            return x + torch.einsum("st,btw->bsw", mix, self.lin(x))

    torch.manual_seed(0)
    blocks = [SquareMix() for _ in range(4)]
    hidden, mix = torch.randn(SEQ, SEQ, WIDTH), torch.randn(SEQ, SEQ)  # batch == seq
    with pytest.raises(RuntimeError):  # the heuristic cuts 'mix': the shapes no longer fit, never a wrong result
        Pipeline(blocks, (2, 2), ["cpu"] * 2, 2)(hidden, mix)
    assert_same(plain(blocks, hidden, mix), Pipeline(blocks, (2, 2), ["cpu"] * 2, 1)(hidden, mix))  # chunks=1 runs it


class BiasOut(nn.Module):
    """Returns (hidden, a broadcastable (1, WIDTH) bias, a per-sample (batch,) statistic), like T5's position bias."""

    def __init__(self, extra=False):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.bias = nn.Parameter(torch.randn(1, WIDTH))
        self.extra = extra

    def forward(self, x):
        h = x + self.lin(x) + self.bias
        out = (h, self.bias * 2, h.mean((1, 2)))
        return (*out, self.bias[:, :2]) if self.extra else out


def test_a_broadcast_output_on_one_sample_micro_batches_is_returned_as_the_plain_loop_does():
    torch.manual_seed(0)
    blocks = [BiasOut() for _ in range(4)]
    hidden = torch.randn(4, SEQ, WIDTH)  # 4 samples in 4 micro-batches: one each
    ref = plain(blocks, hidden)
    assert ref[1].shape == (1, WIDTH) and ref[2].shape == (4,)
    pipe = Pipeline(blocks, (2, 2), ["cpu"] * 2, 4)
    first = pipe(hidden)  # nothing seen on more samples yet: one micro-batch, the plain loop's result
    assert pipe.stats.micro_batches == 1
    again = pipe(hidden)  # the first pass showed the bias is (1, ...) on 4 samples: not per-sample
    assert pipe.stats.micro_batches == 1 + 4
    for out in (first, again):
        assert [t.shape for t in out] == [t.shape for t in ref]  # the bias was (4, WIDTH) before
        assert_same(ref, out)
    # A pipeline that saw micro-batches of two samples knows at once.
    pipe = Pipeline(blocks, (2, 2), ["cpu"] * 2, 4)
    pipe(torch.randn(8, SEQ, WIDTH))
    out = pipe(hidden)
    assert pipe.stats.micro_batches == 4 + 4 and out[1].shape == (1, WIDTH)
    assert_same(ref, out)


def test_an_output_never_seen_on_more_samples_is_joined_with_a_warning():
    torch.manual_seed(0)
    blocks = [BiasOut() for _ in range(2)]
    pipe = Pipeline(blocks, (1, 1), ["cpu"] * 2, 4)
    pipe(torch.randn(8, SEQ, WIDTH))
    for block in blocks:
        block.extra = True  # a fourth output, (1, 2), only on the next call
    with pytest.warns(UserWarning, match=r"output path \[3\].*joined as per-sample"):
        out = pipe(torch.randn(4, SEQ, WIDTH))
    assert out[1].shape == (1, WIDTH) and out[3].shape == (4, 2)


class InPlaceFirst(Block):
    """ReLU(inplace=True) on its input, as the first op of the first block."""

    def forward(self, x, mask=None, bias=None, *, scale=1.0):
        return super().forward(x.relu_(), mask, bias, scale=scale)


@pytest.mark.parametrize("streams", [False, True], ids=["cpu", "stand-in-streams"])
@pytest.mark.parametrize("stages,chunks", [(1, 1), (2, 1), (1, 2), (2, 3)])
def test_in_place_ops_on_the_stack_input(stages, chunks, streams):
    """Pinned (docs/executor.md, "In-place operations on the stack's input"): the caller's tensor
    changes with one micro-batch only; a leaf that requires grad is refused at every K and M."""
    torch.manual_seed(0)
    blocks = [InPlaceFirst()] + make_blocks(depth=3)
    with dev.stand_in_streams(Timeline()) if streams else contextlib.nullcontext():
        pipe = Pipeline(blocks, BALANCES_4[stages], ["cpu"] * stages, chunks)
        leaf = torch.randn(BATCH, SEQ, WIDTH, requires_grad=True)
        hidden = leaf * 1  # not a leaf: the in-place op is allowed
        before = hidden.detach().clone()
        out = pipe(hidden)
        ref = plain(blocks, before.clone())
        assert_same(ref, out)  # the result is the plain loop's either way
        assert torch.equal(hidden, before) == (chunks > 1)  # with M >= 2 block 0 modifies a copy
        hidden.sum().backward()  # the caller can still use its tensor
        with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in an in-place"):
            pipe(leaf)
        with torch.no_grad():  # ... which no_grad allows, as in the plain loop
            pipe(leaf)
        assert torch.equal(leaf, before.relu()) == (chunks == 1)


def test_trainable_upstream_keeps_frozen_blocks_in_the_graph():
    blocks = make_blocks()
    for block in blocks[:5]:
        block.requires_grad_(False)
    torch.manual_seed(2)
    embed = nn.Linear(3, WIDTH)
    tokens = torch.randn(BATCH, SEQ, 3)
    frozen_grad_mode = []
    for block in blocks[:5]:
        block.register_forward_hook(lambda *_: frozen_grad_mode.append(torch.is_grad_enabled()))

    def embed_grad(fn):
        embed.zero_grad()
        loss_of(fn(embed(tokens))).backward()
        return embed.weight.grad.clone()

    ref = embed_grad(lambda h: plain(blocks, h))
    pipe = Pipeline(blocks, BALANCES[4], ["cpu"] * 4, 3, num_frozen=5)
    frozen_grad_mode.clear()
    out = embed_grad(pipe)
    assert frozen_grad_mode and all(frozen_grad_mode)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert all(p.grad is None for b in blocks[:5] for p in b.parameters())


def graph_size(t):
    seen, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        todo.extend(f for f, _ in fn.next_functions)
    return len(seen)


def test_one_stage_one_chunk_is_the_plain_loop():
    blocks = make_blocks()
    hidden, mask, bias = inputs(requires_grad=True)
    received = []
    blocks[0].register_forward_pre_hook(lambda m, a, k: received.append((a[0], a[1], k["bias"])), with_kwargs=True)
    out = Pipeline(blocks, (DEPTH,), ["cpu"], 1)(hidden, mask, bias=bias)
    ref = plain(blocks, hidden, mask, bias=bias)
    (x, m, b), _ = received
    assert x is hidden and m is mask and b is bias  # no split, no copy
    assert type(out.grad_fn) is type(ref.grad_fn)
    assert graph_size(out) == graph_size(ref)  # no extra autograd node
    assert_same(ref, out)


def test_schedule_is_clock_cycle_order():
    # Last stage first within a cycle (why: clock_cycles' docstring; the timing: test_makespan.py).
    assert list(clock_cycles(3, 3)) == [
        [(0, 0)],
        [(0, 1), (1, 0)],
        [(0, 2), (1, 1), (2, 0)],
        [(1, 2), (2, 1)],
        [(2, 2)],
    ]
    for chunks, stages in [(1, 4), (4, 1), (2, 5), (8, 3)]:
        cycles = list(clock_cycles(chunks, stages))
        assert len(cycles) == chunks + stages - 1
        pairs = [(i, j, k) for k, cycle in enumerate(cycles) for i, j in cycle]
        assert sorted((i, j) for i, j, _ in pairs) == [(i, j) for i in range(chunks) for j in range(stages)]
        assert all(k == i + j for i, j, k in pairs)


def test_stages_run_in_clock_cycle_order():
    blocks = make_blocks(depth=6)
    calls = []
    for stage, first in enumerate((0, 2, 4)):
        blocks[first].register_forward_pre_hook(lambda m, a, s=stage: calls.append((a[0].shape[0], s)))
    hidden, _, _ = inputs()
    Pipeline(blocks, (2, 2, 2), ["cpu"] * 3, 3)(hidden[:9])  # micro-batches of 3, all the same size
    assert [s for _, s in calls] == [j for cycle in clock_cycles(3, 3) for _, j in cycle]


def test_errors_are_clear():
    blocks = make_blocks(depth=4)
    with pytest.raises(ValueError, match=r"covers 5 blocks, but the stack has 4"):
        Pipeline(blocks, (2, 3), ["cpu", "cpu"])
    with pytest.raises(ValueError, match=r"empty stage"):
        Pipeline(blocks, (4, 0), ["cpu", "cpu"])
    with pytest.raises(ValueError, match=r"3 devices for 2 stages"):
        Pipeline(blocks, (2, 2), ["cpu"] * 3)
    with pytest.raises(ValueError, match=r"positive integer, got 0"):
        Pipeline(blocks, (2, 2), ["cpu"] * 2, chunks=0)
    with pytest.raises(ValueError, match=r"num_frozen must be in 0..4, got 5"):
        Pipeline(blocks, (2, 2), ["cpu"] * 2, num_frozen=5)
    with pytest.raises(ValueError, match=r"Block 0 is declared frozen .* requires grad"):
        Pipeline(blocks, (2, 2), ["cpu"] * 2, num_frozen=1)
    for stages in (1, 2):
        with pytest.raises(TypeError, match="hidden state"):
            Pipeline(blocks, BALANCES_4[stages], ["cpu"] * stages, chunks=1)(None)
        with pytest.raises(TypeError, match="hidden state"):
            Pipeline(blocks, BALANCES_4[stages], ["cpu"] * stages, chunks=2)([torch.randn(3, WIDTH)])


def test_place_moves_blocks_and_inputs_follow_the_stage_device():
    blocks = make_blocks(depth=2)
    pipe = Pipeline(blocks, (1, 1), ["cpu", torch.device("cpu")], 2).place()
    assert pipe.devices == (torch.device("cpu"),) * 2 and "chunks=2" in repr(pipe)


def test_hop_autograd_function_passes_gradients_on_cpu():
    # The CUDA path's autograd function, exercised with CPU "streams" (None).
    x = torch.randn(3, 2, dtype=torch.double, requires_grad=True)
    cpu = torch.device("cpu")
    torch.autograd.gradcheck(lambda t: _Hop.apply(None, None, cpu, t) * 2, (x,))
    assert dev.hop(x, None, None, cpu) is x
    assert dev.new_stream(cpu) is None and dev.current_stream(cpu) is None
    dev.wait(None, None)
    dev.record(x, None)


# -- installing the pipeline into a model's own loop ---------------------------------------


class LoopModel(nn.Module):
    """An encoder that loops over a ModuleList the Hugging Face way."""

    def __init__(self):
        super().__init__()
        self.layer = nn.ModuleList(make_blocks(depth=4))

    def forward(self, x, mask):
        for i, layer_module in enumerate(self.layer):
            x = layer_module(x, mask, scale=0.5)
        return x


def param_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_installed(model, container, pipe, call, out_of=lambda o: o):
    """Same outputs, same gradients, unchanged container API, every block run once per micro-batch;
    then removal restores the blocks' own classes."""
    keys, n, first = list(model.state_dict()), len(container), container[0]
    children = list(container.children())
    classes = [type(b) for b in children]
    model.zero_grad(set_to_none=True)
    ref = out_of(call())
    loss_of(ref).backward()
    ref_grads = param_grads(model)
    runs = ForwardRuns(children)
    with pipelined(container, pipe):
        assert len(container) == n and container[0] is first and list(container.children()) == children
        assert list(model.state_dict()) == keys
        assert all(isinstance(b, c) for b, c in zip(children, classes))
        call()  # the first pass also runs each block once, without a graph, to learn what it returns
        assert runs == [1 + pipe.chunks] * n
        runs.reset()
        model.zero_grad(set_to_none=True)
        out = out_of(call())
        # Engaged: every block ran once per micro-batch (a bypassed pipeline would run each once).
        assert runs == [pipe.chunks] * n
    runs.remove()
    loss_of(out).backward()
    assert_same(ref, out)
    assert param_grads(model).keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(param_grads(model)[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    assert [type(b) for b in container.children()] == classes


def test_install_into_module_list_loop():
    model = LoopModel()
    hidden, mask, _ = inputs()
    pipe = Pipeline(list(model.layer), (1, 3), ["cpu"] * 2, 3)
    check_installed(model, model.layer, pipe, lambda: model(hidden, mask))


def test_install_into_sequential():
    model = nn.Sequential(*make_blocks(depth=6))
    hidden, _, _ = inputs()
    pipe = Pipeline(list(model), (2, 2, 2), ["cpu"] * 3, 8)
    check_installed(model, model, pipe, lambda: model(hidden))


def test_install_into_transformer_encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    x = torch.randn(6, 5, 16)
    padding = torch.zeros(6, 5, dtype=torch.bool)
    padding[:, -1] = True
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)  # (seq, seq): passed whole
    pipe = Pipeline(list(model.layers), (2, 1, 1), ["cpu"] * 3, 4)
    check_installed(model, model.layers, pipe, lambda: model(x, mask=causal, src_key_padding_mask=padding))


def test_install_into_bert_with_frozen_prefix_and_trainable_embeddings():
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=16,
    )
    torch.manual_seed(0)
    model = BertModel(config)
    ids = torch.randint(0, 50, (5, 7))
    attention = torch.ones(5, 7, dtype=torch.long)
    attention[1, 4:] = 0
    layers = model.encoder.layer
    for block in layers[:2]:
        block.requires_grad_(False)
    pipe = Pipeline(list(layers), (1, 2, 1), ["cpu"] * 3, 2, num_frozen=2)
    check_installed(model, layers, pipe, lambda: model(ids, attention_mask=attention), out_of=lambda o: o.last_hidden_state)
    assert model.embeddings.word_embeddings.weight.grad is not None


def test_install_into_vit():
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
        intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = ViTModel(config)
    pixels = torch.randn(5, 3, 8, 8)
    pipe = Pipeline(list(model.layers), (2, 2), ["cpu"] * 2, 3)
    check_installed(model, model.layers, pipe, lambda: model(pixel_values=pixels), out_of=lambda o: o.pooler_output)


def test_install_details():
    model = LoopModel()
    layers = model.layer
    pipe = Pipeline(list(layers), (4,), ["cpu"])
    with pytest.raises(ValueError, match="not the 3 children"):
        install_pipeline(nn.ModuleList(list(layers)[:3]), pipe)
    with pytest.raises(ValueError, match="in order"):
        install_pipeline(nn.ModuleList(list(layers)[::-1]), pipe)
    install_pipeline(layers, pipe)
    install_pipeline(layers, pipe)  # installing twice replaces the runner, it does not stack subclasses
    assert type(layers) is nn.ModuleList and all(type(b).__bases__ == (Block,) for b in layers)
    assert "_pipetransformer_interceptor" not in layers._modules  # not registered as a submodule
    assert list(layers[1:3]) == list(layers._modules.values())[1:3]  # a slice holds the same blocks
    copy.deepcopy(model)  # a deep copy works while installed
    remove_pipeline(layers)
    remove_pipeline(layers)  # idempotent
    assert all(type(b) is Block for b in layers) and len(list(layers)) == 4
    with pytest.raises(RuntimeError, match="boom"):
        with pipelined(layers, pipe):
            raise RuntimeError("boom")
    assert all(type(b) is Block for b in layers)
    shared = nn.ModuleList([layers[0], layers[0], layers[1], layers[1]])
    with pytest.raises(ValueError, match="shared blocks"):
        install_pipeline(shared, Pipeline(list(shared), (4,), ["cpu"]))


# -- the stream protocol, checked on CPU with stand-in streams -----------------------------


def test_stream_protocol_with_stand_in_streams():
    """What the CUDA path does, step by step, observed through stand-in streams.

    Every handover waits on the producer's stream and records the tensor on both; blocks compute
    on their stage's stream; gradients wait the other way round.
    """
    timeline = Timeline()
    log = timeline.log
    cpu = torch.device("cpu")
    blocks = make_blocks(depth=3)
    for index, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda m, a, i=index: log.append(("compute", i, timeline.current_stream(cpu))))
    hidden, mask, _ = inputs()
    with dev.stand_in_streams(timeline):
        caller = timeline.current_stream(cpu)
        pipe = Pipeline(blocks, (1, 1, 1), ["cpu"] * 3, 2)
        out = pipe(hidden.requires_grad_(True), mask)
        s0, s1, s2 = streams = timeline.made
        assert pipe._streams == streams

        expected = [("wait", s, caller) for s in streams]  # stages see the caller's earlier work
        for cycle in clock_cycles(2, 3):
            for _, j in cycle:
                src = caller if j == 0 else streams[j - 1]
                expected += [("wait", streams[j], src), ("record", src), ("record", streams[j])]  # the hidden state
                expected += [("wait", streams[j], caller), ("record", caller), ("record", streams[j])]  # its mask chunk
                expected += [("compute", j, streams[j])]
        expected += [("wait", caller, s2), ("record", s2), ("record", caller)] * 2  # outputs back to the caller
        assert log == expected

        log.clear()
        out.sum().backward()
    waits = sorted((str(e[1]), str(e[2])) for e in log if e[0] == "wait")
    # Each handover's gradient goes back: consumer's stream -> producer's stream, per micro-batch.
    assert waits == sorted([("s2", "caller:cpu"), ("s1", "s2"), ("s0", "s1"), ("caller:cpu", "s0")] * 2)
    assert hidden.grad is not None


def test_a_reason_is_said_once_per_pipeline_and_once_for_pipelines_that_share_a_warn_once():
    import warnings

    from lightning_pipetransformer.warn_once import WarnOnce

    blocks = make_blocks(depth=4)
    small = torch.randn(3, SEQ, WIDTH)  # 3 samples for chunks=4: capped

    def capped(*pipes):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for pipe in pipes:
                for _ in range(2):
                    pipe(small)
        return sum("chunks=4 but the batches have 3 samples" in str(w.message) for w in caught)

    assert capped(Pipeline(blocks, (2, 2), ["cpu"] * 2, 4)) == 1  # not once per batch
    assert capped(Pipeline(blocks, (2, 2), ["cpu"] * 2, 4), Pipeline(blocks, (2, 2), ["cpu"] * 2, 4)) == 2
    shared = WarnOnce()  # the chunk tuner's candidates share one
    assert capped(*(Pipeline(blocks, (2, 2), ["cpu"] * 2, 4, say=shared) for _ in range(3))) == 1
