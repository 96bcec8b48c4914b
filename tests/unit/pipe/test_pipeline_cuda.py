"""The pipeline executor on CUDA: per-stage streams, event ordering, memory safety.

Stages may share one GPU: each still computes on its own stream, so a missing event or a
missing ``record_stream`` shows up as a wrong result. Slow kernels (``torch.cuda._sleep``)
widen the race windows so such bugs cannot hide behind timing luck. Nothing here synchronizes
before the final comparison, except where said.
"""

import pytest
import torch
from torch import nn

from lightning_pipetransformer.pipe.pipeline import Pipeline
from lightning_pipetransformer.stack.interception import pipelined
from lightning_pipetransformer.stack.stack_call import hidden_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (streams and events)")

CUDA = "cuda:0"
SLEEP = 2_000_000  # GPU clock cycles: about a millisecond, long against the tiny kernels here


class Block(nn.Module):
    def __init__(self, width=16, sleep=0):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.lin = nn.Linear(width, width)
        self.sleep = sleep
        self.streams = []

    def forward(self, x, mask=None):
        self.streams.append(torch.cuda.current_stream())
        if self.sleep:
            # Delay this block's reads of 'x': a consumer that does not wait, or memory reused
            # too early by the producer's stream, now reads the wrong values.
            torch.cuda._sleep(self.sleep)
        h = self.lin(self.norm(x))
        if mask is not None:
            h = h * mask[..., None]
        return x + torch.tanh(h)


def make_blocks(n=8, sleep_every=0, seed=0):
    torch.manual_seed(seed)
    blocks = [Block(sleep=SLEEP if sleep_every and i % sleep_every == 0 else 0) for i in range(n)]
    return [b.to(CUDA) for b in blocks]


def plain(blocks, hidden, *args):
    for block in blocks:
        hidden = hidden_of(block(hidden, *args))
    return hidden


def loss_and_grads(blocks, fn, hidden, *args):
    params = [p for b in blocks for p in b.parameters() if p.requires_grad]
    out = fn(hidden, *args)
    weight = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)
    grads = torch.autograd.grad((out * weight).sum(), params)
    return out, grads


@pytest.mark.parametrize("num_frozen", [0, 3])
@pytest.mark.parametrize("chunks", [1, 3, 8])
@pytest.mark.parametrize("stages,balance", [(1, (8,)), (2, (3, 5)), (4, (2, 2, 2, 2))])
def test_equals_plain_with_one_sync_at_the_end(stages, balance, chunks, num_frozen):
    blocks = make_blocks(sleep_every=3)
    for block in blocks[:num_frozen]:
        block.requires_grad_(False)
    torch.manual_seed(1)
    hidden = torch.randn(10, 5, 16, device=CUDA)
    mask = (torch.rand(10, 5, device=CUDA) > 0.3).float()
    ref, ref_grads = loss_and_grads(blocks, lambda *a: plain(blocks, *a), hidden, mask)
    torch.cuda.synchronize()
    pipe = Pipeline(blocks, balance, [CUDA] * stages, chunks, num_frozen)
    out, grads = loss_and_grads(blocks, pipe, hidden, mask)
    torch.cuda.synchronize()  # the only synchronisation: everything else is ordered by events
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_each_stage_computes_on_its_own_stream():
    blocks = make_blocks(6)
    pipe = Pipeline(blocks, (2, 2, 2), [CUDA] * 3, 2)
    caller = torch.cuda.current_stream()
    pipe(torch.randn(4, 5, 16, device=CUDA))
    streams = pipe._streams
    assert len(set(streams)) == 3 and caller not in streams
    for j, stream in enumerate(streams):
        for block in blocks[2 * j : 2 * j + 2]:
            assert block.streams == [stream, stream]  # both micro-batches
    # One stage, one micro-batch: the plain loop, on the caller's stream.
    fast = Pipeline(blocks, (6,), [CUDA], 1)
    blocks[0].streams.clear()
    fast(torch.randn(4, 5, 16, device=CUDA))
    assert blocks[0].streams == [caller]


def test_backward_runs_on_the_stage_streams():
    seen = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(torch.cuda.current_stream())
            return g

    class SpyBlock(Block):
        def forward(self, x, mask=None):
            return super().forward(Spy.apply(x), mask)

    torch.manual_seed(0)
    blocks = [SpyBlock().to(CUDA) for _ in range(2)]
    pipe = Pipeline(blocks, (1, 1), [CUDA] * 2, 2)
    pipe(torch.randn(4, 3, 16, device=CUDA, requires_grad=True)).sum().backward()
    assert set(seen) == set(pipe._streams)


def test_caller_on_a_side_stream_and_parameters_updated_just_before():
    blocks = make_blocks(4, sleep_every=1)
    pipe = Pipeline(blocks, (2, 2), [CUDA] * 2, 4)
    hidden = torch.randn(8, 5, 16, device=CUDA)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        # A slow parameter update on the caller's stream: stages must wait for it.
        torch.cuda._sleep(SLEEP)
        with torch.no_grad():
            for block in blocks:
                block.lin.weight.mul_(-1.0)
        out = pipe(hidden)
        result = out * 1.0  # used on the caller's stream straight away
    torch.cuda.synchronize()
    with torch.no_grad():
        ref = plain(blocks, hidden)
    torch.testing.assert_close(result, ref, rtol=1e-4, atol=1e-5)


def test_freed_activations_are_not_reused_while_another_stream_reads_them():
    # Under no_grad intermediate outputs are freed as soon as Python drops them; stage 1 reads
    # each one late (it sleeps first). Without record_stream, stage 0's next micro-batch would
    # get the same memory from the allocator and overwrite it before stage 1 reads it.
    torch.manual_seed(0)
    blocks = [Block().to(CUDA), Block(sleep=4 * SLEEP).to(CUDA)]
    pipe = Pipeline(blocks, (1, 1), [CUDA] * 2, 8)
    hidden = torch.randn(16, 5, 16, device=CUDA)
    with torch.no_grad():
        ref = plain(blocks, hidden)
        torch.cuda.synchronize()
        outs = [pipe(hidden) for _ in range(3)]
    torch.cuda.synchronize()
    for out in outs:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_bert_installed_on_two_streams():
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=16,
    )
    torch.manual_seed(0)
    model = BertModel(config).to(CUDA)
    ids = torch.randint(0, 50, (6, 7), device=CUDA)
    attention = torch.ones(6, 7, dtype=torch.long, device=CUDA)
    attention[1, 4:] = 0
    ref = model(ids, attention_mask=attention).last_hidden_state
    ref_grads = torch.autograd.grad(ref.square().sum(), list(model.parameters()), allow_unused=True)
    pipe = Pipeline(list(model.encoder.layer), (2, 2), [CUDA] * 2, 3)
    with pipelined(model.encoder.layer, pipe):
        out = model(ids, attention_mask=attention).last_hidden_state
    grads = torch.autograd.grad(out.square().sum(), list(model.parameters()), allow_unused=True)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        assert (g is None) == (r is None)
        if g is not None:
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_stages_on_two_devices():
    blocks = make_blocks(4, sleep_every=2)
    for block in blocks[2:]:
        block.to("cuda:1")
    hidden = torch.randn(9, 5, 16, device=CUDA)

    def ref_fn(h):
        h = plain(blocks[:2], h)
        return plain(blocks[2:], h.to("cuda:1"))

    ref, ref_grads = loss_and_grads(blocks, ref_fn, hidden)
    pipe = Pipeline(blocks, (2, 2), [CUDA, "cuda:1"], 3)
    out, grads = loss_and_grads(blocks, pipe, hidden)
    torch.cuda.synchronize()
    assert out.device == torch.device("cuda:1")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_llama_installed_on_two_streams():
    # A decoder: each block gets its own arguments (causal mask, rotary embeddings) through the
    # block-level interception; an in-place op on the pipeline's output must work (no view).
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, max_position_embeddings=32, use_cache=False,
    )
    torch.manual_seed(0)
    model = LlamaModel(config).to(CUDA)
    ids = torch.randint(0, 50, (6, 7), device=CUDA)
    attention = torch.ones(6, 7, dtype=torch.long, device=CUDA)
    attention[1, 4:] = 0

    def run():
        out = model(ids, attention_mask=attention).last_hidden_state
        out.mul_(2.0)
        return out, torch.autograd.grad(out.square().sum(), list(model.parameters()), allow_unused=True)

    ref, ref_grads = run()
    for chunks in (1, 3):
        pipe = Pipeline(list(model.layers), (2, 2), [CUDA] * 2, chunks)
        with pipelined(model.layers, pipe):
            out, grads = run()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        for g, r in zip(grads, ref_grads):
            assert (g is None) == (r is None)
            if g is not None:
                torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
