"""The first-batch self-check (stack/self_check.py) on a small stack, without a Trainer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipetransformer.pipe.pipeline import Pipeline
from lightning_pipetransformer.stack.interception import StackCall
from lightning_pipetransformer.stack.observers import Observer
from lightning_pipetransformer.stack.self_check import SelfCheck, SelfCheckError


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
    blocks, said = stack(), []
    SelfCheck(blocks, announce=said.append)(Pipeline(blocks, (2, 2), ["cpu", "cpu"], chunks=1), call(blocks))
    assert len(said) == 1 and "self-check passed: the pipeline" in said[0] and "values within" in said[0], said
    blocks, said = stack(dropout=0.5), []
    SelfCheck(blocks, announce=said.append)(Pipeline(blocks, (2, 2), ["cpu", "cpu"], chunks=2), call(blocks))
    assert "values not compared: the blocks draw random numbers" in said[0], said


@pytest.mark.parametrize("kind", ["forward hook", "forward pre-hook"])
def test_a_hook_that_replaces_a_blocks_output_is_not_taken_for_a_difference(kind):
    """The plain run silences the hooks (each must fire once): it lacks a replacing hook's effect, so values are not
    compared (was: refused an exact pipeline). Structure and firing counts still are, and the hooks are back after."""
    blocks, said = stack(), []
    scale = torch.linspace(0.5, 2.0, 4)
    if kind == "forward hook":
        blocks[1].register_forward_hook(lambda m, a, o: o * scale)
    else:
        blocks[1].register_forward_pre_hook(lambda m, a: (a[0] * scale,))
    blocks.eval()  # no batch statistics: only the hook could make a difference
    observer = Observer(blocks[1], "block 1", kind, "scale")
    c = call(blocks)
    c = StackCall(c.hidden, c.calls, observed=(observer,))
    out = SelfCheck(blocks, announce=said.append)(Pipeline(blocks, (2, 2), ["cpu", "cpu"], chunks=2), c)
    assert len(said) == 1 and f"values not compared: the {kind} " in said[0] and "on block 1" in said[0], said
    with torch.no_grad():  # the runner's output kept the hook's effect, and the hook is registered as before
        want = c.hidden
        for block in blocks:
            want = block(want)
    torch.testing.assert_close(out, want)
    assert all(type(h).__name__ == "function" and h.__module__ == __name__ for b in blocks for h in [*b._forward_hooks.values(), *b._forward_pre_hooks.values()])
    # A hook that returns nothing leaves the values compared.
    blocks, said = stack(), []
    blocks[1].register_forward_hook(lambda m, a, o: None)
    blocks.eval()
    SelfCheck(blocks, announce=said.append)(Pipeline(blocks, (2, 2), ["cpu", "cpu"], chunks=2), StackCall(c.hidden, c.calls, observed=(observer,)))
    assert "values within" in said[0], said
