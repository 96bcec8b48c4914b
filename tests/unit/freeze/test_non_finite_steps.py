"""Steps with non-finite gradients (what AMP's GradScaler skips) decide no freeze.

The callback is driven directly, step by step, with gradients set by hand: the sums a rule decides
on must equal the sums over the finite steps alone, and a non-finite norm must not end training.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_pipetransformer import AutoFreeze
from lightning_pipetransformer.freeze.rules import autofreeze_num_frozen
from lightning_pipetransformer.stack.declared import block_stack_of
from tests.helpers.models import TextClassifier


def test_the_autofreeze_rule_decides_nothing_on_non_finite_norms():
    # Before: |inf - inf| / inf is nan, the percentile is nan, and `next` raised StopIteration,
    # which Lightning's loops take for "out of data": the epoch (or the run) ended silently.
    assert autofreeze_num_frozen(0, [math.inf] * 4, [math.inf] * 4) == 0
    # Before: an inf ratio for block 2 made it the first "still changing" block, so 0-1 froze.
    assert autofreeze_num_frozen(0, [10, 10, 10, 10], [9, 9, math.inf, 15]) == 0
    # A frozen block's norm is not looked at.
    assert autofreeze_num_frozen(1, [math.inf, 10, 10, 10], [0, 9.9, 5, 9]) == 2


def callback_on(rule: str) -> tuple[AutoFreeze, list[list[torch.nn.Parameter]]]:
    freeze = AutoFreeze(rule=rule, alpha=0.5, freeze_interval=2)
    freeze.stack = block_stack_of(TextClassifier(num_layers=4))
    return freeze, [list(block.parameters()) for block in freeze.stack.blocks]


def one_step(freeze: AutoFreeze, blocks, scale: float, overflow_block: int | None = None) -> None:
    for index, params in enumerate(blocks):
        for p in params:
            p.grad = torch.full_like(p, scale * (index + 1))
            if index == overflow_block:
                p.grad.view(-1)[0] = math.inf
    freeze.on_before_optimizer_step(None, None, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("overflow_block", [0, 3])
def test_the_paper_rule_leaves_a_skipped_step_out_of_its_means(overflow_block):
    freeze, blocks = callback_on("paper")
    one_step(freeze, blocks, 1.0)
    one_step(freeze, blocks, 5.0, overflow_block=overflow_block)  # skipped by the scaler: not counted
    one_step(freeze, blocks, 3.0)
    reference, ref_blocks = callback_on("paper")
    one_step(reference, ref_blocks, 1.0)
    one_step(reference, ref_blocks, 3.0)
    # Before: the overflowed block's norm counted as 0 over 3 steps, the others' over 3 steps too.
    assert freeze.freeze_rule.statistics.mean() == pytest.approx(reference.freeze_rule.statistics.mean())
    assert freeze.state_dict()["norm_steps"] == 2


def test_the_autofreeze_rule_leaves_a_skipped_step_out_of_its_sums():
    freeze, blocks = callback_on("autofreeze")
    one_step(freeze, blocks, 1.0)
    one_step(freeze, blocks, 5.0, overflow_block=2)
    reference, ref_blocks = callback_on("autofreeze")
    one_step(reference, ref_blocks, 1.0)
    for sums, ref_sums in zip(freeze.freeze_rule.statistics.sums, reference.freeze_rule.statistics.sums):
        for s, r in zip(sums, ref_sums):
            assert torch.isfinite(s).all()
            torch.testing.assert_close(s, r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: on CPU every tensor is on the one device")
def test_restored_gradient_sums_follow_their_gradients_device():
    # Lightning loads callback state before the strategy moves the model: the sums come back on the
    # CPU, the gradients of the next step are on the GPU. Before: a device mismatch in _foreach_add_.
    freeze, blocks = callback_on("autofreeze")
    one_step(freeze, blocks, 1.0)
    restored, restored_blocks = callback_on("autofreeze")
    restored.load_state_dict(freeze.state_dict())
    restored.stack.container.to("cuda")
    one_step(restored, [list(b.parameters()) for b in restored.stack.blocks], 1.0)
    reference, ref_blocks = callback_on("autofreeze")
    one_step(reference, ref_blocks, 1.0)
    one_step(reference, ref_blocks, 1.0)
    for sums, ref_sums in zip(restored.freeze_rule.statistics.sums, reference.freeze_rule.statistics.sums):
        for s, r in zip(sums, ref_sums):
            assert s.device.type == "cuda"
            torch.testing.assert_close(s.cpu(), r)
