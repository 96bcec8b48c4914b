"""The first-batch self-check (stack/self_check.py) on a small stack, without a Trainer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipetransformer.pipe.pipeline import Pipeline
from lightning_pipetransformer.stack.observers import Observer
from lightning_pipetransformer.stack.self_check import SelfCheck, SelfCheckError, value_tolerance
from lightning_pipetransformer.stack.stack_call import StackCall
from lightning_pipetransformer.stack.tolerance import precisions_in_play


class Said(list):
    """What the check announced, each message's wrapping undone (it wraps to the terminal's width)."""

    def append_flat(self, message: str) -> None:
        self.append(" ".join(message.split()))


def stack(dropout=0.0):
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(dropout), nn.Tanh()) for _ in range(4))


def call(blocks, batch=6):
    return StackCall(torch.randn(batch, 4, requires_grad=True), (((), {}),) * len(blocks))


def test_a_pipeline_passes_and_the_check_leaves_no_trace():
    """Same output and graph as the pipeline alone; random state and buffers as the pipeline left them."""
    blocks = stack()
    pipeline = Pipeline(blocks, (2, 2), ["cpu", "cpu"], chunks=1)
    c = call(blocks)
    state, buffers = torch.get_rng_state(), [b.clone() for b in blocks.buffers()]
    alone = pipeline.run(c)
    after_alone = [b.clone() for b in blocks.buffers()]
    torch.set_rng_state(state)
    with torch.no_grad():
        for b, saved in zip(blocks.buffers(), buffers):
            b.copy_(saved)
    checked = SelfCheck(blocks)(pipeline, c)
    torch.testing.assert_close(checked, alone)
    assert checked.requires_grad
    for b, want in zip(blocks.buffers(), after_alone):
        torch.testing.assert_close(b, want)  # BatchNorm's running statistics: updated once, by the pipeline


class Shifted:
    def __init__(self, blocks, shift=0.0, drop_last_row=False):
        self.blocks, self.shift, self.drop_last_row = tuple(blocks), shift, drop_last_row

    def run(self, c):
        h = c.hidden
        for block in self.blocks:
            h = block(h)
        return h[:-1] if self.drop_last_row else h + self.shift


def test_other_values_and_other_shapes_are_named():
    blocks = stack()
    with pytest.raises(SelfCheckError, match="the hidden state differs by up to"):
        SelfCheck(blocks)(Shifted(blocks, shift=0.1), call(blocks))
    with pytest.raises(SelfCheckError, match=r"has shape \(5, 4\) .* gives \(6, 4\)"):
        SelfCheck(blocks)(Shifted(blocks, drop_last_row=True), call(blocks))


def test_values_are_not_compared_when_the_blocks_draw_random_numbers():
    """Dropout in training draws per micro-batch: two micro-batches differ from the whole batch by their draws."""
    blocks = stack(dropout=0.5)
    pipeline = Pipeline(blocks, (2, 2), ["cpu", "cpu"], chunks=2)
    SelfCheck(blocks)(pipeline, call(blocks))  # structure and shapes agree: passes


def test_an_observer_firing_per_micro_batch_is_named():
    blocks = stack()
    blocks[1].register_forward_hook(lambda m, a, o: None)
    observer = Observer(blocks[1], "block 1", "forward hook", "mine")
    c = call(blocks)
    c = StackCall(c.hidden, c.calls, observed=(observer,))
    micro_batched = Pipeline(blocks, (2, 2), ["cpu", "cpu"], chunks=2)
    micro_batched.run = lambda c, run=micro_batched.run: run(StackCall(c.hidden, c.calls))  # ignores the observer
    with pytest.raises(SelfCheckError, match=r"the forward hook mine on block 1 fired 2 time\(s\) where the plain loop fires it 1"):
        SelfCheck(blocks)(micro_batched, c)
    SelfCheck(blocks)(Pipeline(blocks, (2, 2), ["cpu", "cpu"], chunks=2), c)  # honours it: one micro-batch


def test_batch_statistics_per_micro_batch_are_refused():
    """BatchNorm in training normalises each micro-batch by its own statistics: not what the plain loop does."""
    blocks = stack()
    with pytest.raises(SelfCheckError, match="the hidden state differs"):
        SelfCheck(blocks)(Pipeline(blocks, (2, 2), ["cpu", "cpu"], chunks=2), call(blocks))
    blocks.eval()  # running statistics: the same for any micro-batch
    SelfCheck(blocks)(Pipeline(blocks, (2, 2), ["cpu", "cpu"], chunks=2), call(blocks))


def test_a_passed_check_says_so():
    blocks, said = stack(), Said()
    SelfCheck(blocks, announce=said.append_flat)(Pipeline(blocks, (2, 2), ["cpu", "cpu"], chunks=1), call(blocks))
    assert len(said) == 1 and "self-check passed: the pipeline" in said[0] and "values within" in said[0], said
    blocks, said = stack(dropout=0.5), Said()
    SelfCheck(blocks, announce=said.append_flat)(Pipeline(blocks, (2, 2), ["cpu", "cpu"], chunks=2), call(blocks))
    assert "values not compared: the blocks draw random numbers" in said[0], said


@pytest.mark.parametrize("kind", ["forward hook", "forward pre-hook"])
def test_a_hook_that_replaces_a_blocks_output_is_not_taken_for_a_difference(kind):
    """The plain run silences the hooks (each must fire once): it lacks a replacing hook's effect, so values are not
    compared (was: refused an exact pipeline). Structure and firing counts still are, and the hooks are back after."""
    blocks, said = stack(), Said()
    scale = torch.linspace(0.5, 2.0, 4)
    if kind == "forward hook":
        blocks[1].register_forward_hook(lambda m, a, o: o * scale)
    else:
        blocks[1].register_forward_pre_hook(lambda m, a: (a[0] * scale,))
    blocks.eval()  # no batch statistics: only the hook could make a difference
    observer = Observer(blocks[1], "block 1", kind, "scale")
    c = call(blocks)
    c = StackCall(c.hidden, c.calls, observed=(observer,))
    out = SelfCheck(blocks, announce=said.append_flat)(Pipeline(blocks, (2, 2), ["cpu", "cpu"], chunks=2), c)
    assert len(said) == 1 and f"values not compared: the {kind} " in said[0] and "on block 1" in said[0], said
    with torch.no_grad():  # the runner's output kept the hook's effect, and the hook is registered as before
        want = c.hidden
        for block in blocks:
            want = block(want)
    torch.testing.assert_close(out, want)
    assert all(type(h).__name__ == "function" and h.__module__ == __name__ for b in blocks for h in [*b._forward_hooks.values(), *b._forward_pre_hooks.values()])
    # A hook that returns nothing leaves the values compared.
    blocks, said = stack(), Said()
    blocks[1].register_forward_hook(lambda m, a, o: None)
    blocks.eval()
    check = SelfCheck(blocks, announce=said.append_flat)
    check(Pipeline(blocks, (2, 2), ["cpu", "cpu"], chunks=2), StackCall(c.hidden, c.calls, observed=(observer,)))
    assert "values within" in said[0], said


# ---------------------------------------------------------------------------- non-finite values (issue 40)


def rows_stack():
    """Blocks that keep each row to itself (no batch statistics): a NaN stays in its sample's row."""
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4))


class Edited:
    """The blocks in one pass, then ``edit`` applied to the output (what a wrong runner would give)."""

    def __init__(self, blocks, edit):
        self.blocks, self.edit = tuple(blocks), edit

    def run(self, c):
        h = c.hidden
        for block in self.blocks:
            h = block(h)
        return self.edit(h)


def nan_call(blocks):
    c = call(blocks)
    with torch.no_grad():
        c.hidden[1, 2] = float("nan")  # one feature of one sample: NaN through that row
        c.hidden[4, 0] = float("inf")
    return c


def test_nan_at_the_same_places_is_equal_and_a_nan_on_one_side_is_a_difference():
    """A NaN in the data gives NaN on both sides, at the same places: equal (was: refused, naming the runner).
    A NaN or inf where the plain loop has a finite value, or the reverse, is still a difference."""
    blocks, said = rows_stack(), Said()
    out = SelfCheck(blocks, announce=said.append_flat)(Pipeline(blocks, (2, 2), ["cpu", "cpu"], chunks=3), nan_call(blocks))
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2, 3, 5]]).all() and "values within" in said[0], said

    def put(value, row=0):
        def edit(h):
            h = h.clone()
            h[row, 3] = value
            return h

        return edit

    # NaN or inf where the plain loop is finite, a finite value where it is NaN, an infinity for its NaN.
    for edit in (put(float("nan")), put(float("-inf")), put(0.5, row=1), put(float("inf"), row=1)):
        with pytest.raises(SelfCheckError, match=r"the hidden state holds another non-finite value \(NaN/inf\) than the plain loop's at 1 place"):
            SelfCheck(blocks)(Edited(blocks, edit), nan_call(blocks))
    # Finite values are still compared, the non-finite rows aside.
    with pytest.raises(SelfCheckError, match="the hidden state differs by up to"):
        SelfCheck(blocks)(Edited(blocks, lambda h: h + 0.1), nan_call(blocks))


# ---------------------------------------------------------------------------- the precision in play (issue 40)


class Residual(nn.Module):
    """A Transformer block's shape of math: the matmul in autocast's dtype, the residual sum (the output) in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.linear(x)


def off_by(relative):
    """A runner off by ``relative`` of the largest magnitude: rounding at a lower precision, or a real difference."""
    return lambda blocks: Edited(blocks, lambda h: h + relative * h.abs().max())


@pytest.fixture
def matmul_precision():
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


def test_the_tolerance_follows_autocast_and_the_fp32_matmul_precision(matmul_precision):
    """The output is fp32 (the residual) while the matmuls ran in bf16 or TF32: the two sides agree only to that
    precision, which the output's dtype does not show (was: fp32's 1e-3, refusing exact runs on a real-size model)."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(Residual() for _ in range(3))
    rounding, real = off_by(1e-2), off_by(0.2)  # a few bf16/TF32 ulps, and a real difference
    with pytest.raises(SelfCheckError, match="differs by up to"):
        SelfCheck(blocks)(rounding(blocks), call(blocks))  # full fp32: refused
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert SelfCheck(blocks)(rounding(blocks), call(blocks)).dtype == torch.float32
        with pytest.raises(SelfCheckError, match="differs by up to"):
            SelfCheck(blocks)(real(blocks), call(blocks))
    for precision in ("high", "medium"):  # TF32 matmuls, bf16 matmuls
        matmul_precision(precision)
        SelfCheck(blocks)(rounding(blocks), call(blocks))
        with pytest.raises(SelfCheckError, match="differs by up to"):
            SelfCheck(blocks)(real(blocks), call(blocks))


def test_the_tolerance_widens_for_tf32_on_a_cuda_device_only(matmul_precision, monkeypatch):
    """cuDNN's TF32 (on by default) counts for convolutions on CUDA; on CPU, and for blocks without one, fp32 stays fp32."""
    convolving = [nn.Sequential(nn.Conv1d(4, 4, 1), nn.Tanh())]
    matmuls_only = [nn.Sequential(nn.Linear(4, 4), nn.Tanh())]
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    assert value_tolerance(torch.float32, precisions_in_play(cuda, convolving)) == value_tolerance(torch.float16) == 3e-2
    assert value_tolerance(torch.float32, precisions_in_play(cpu, convolving)) == 1e-3
    assert value_tolerance(torch.float32, precisions_in_play(cuda, matmuls_only)) == 1e-3
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert value_tolerance(torch.float32, precisions_in_play(cuda, convolving)) == 1e-3
    # The output's own lower precision still counts, and the lowest of all wins.
    assert value_tolerance(torch.bfloat16) == value_tolerance(torch.float32, (None, torch.bfloat16)) == 6e-2
    assert value_tolerance(torch.float16, (torch.bfloat16, None)) == 6e-2
