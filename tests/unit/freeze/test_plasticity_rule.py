"""The ``"plasticity"`` rule (issue 41): its arithmetic against hand-computed values, its statistic (how far
each block moved from the weights fine-tuning started from), the two-point agreement and its checkpoints."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_pipetransformer import AutoFreeze
from lightning_pipetransformer.freeze.policies import FreezePoint, FreezeRule, PlasticityRule, make_rule
from lightning_pipetransformer.freeze.rules import plasticity_num_frozen, validate_ratio
from lightning_pipetransformer.freeze.statistics import Displacement
from lightning_pipetransformer.stack.discovery import BlockStack

L = 6


def point(index: int, num_frozen: int = 0, lr: float | None = None, last: float | None = None) -> FreezePoint:
    """A point whose coming optimizer step runs at ``lr`` and whose last one ran at ``last``."""
    return FreezePoint(index, 0, num_frozen, L, L - 1, learning_rate=lr, previous_learning_rate=last)


def weight_stack(start: list[float]) -> BlockStack:
    """Six blocks of one weight each, the weight of block i at ``start[i]``: its displacement is |w - w0| / |w0|."""
    blocks = nn.ModuleList(nn.Linear(1, 1, bias=False) for _ in range(L))
    with torch.no_grad():
        for block, w in zip(blocks, start):
            block.weight.fill_(w)
    return BlockStack("blocks", blocks)


def move(stack: BlockStack, by: list[float]) -> None:
    with torch.no_grad():
        for block, d in zip(stack.blocks, by):
            block.weight.add_(d)


# ----------------------------------------------------------------------------- the arithmetic


def test_the_leading_blocks_below_the_share_of_the_most_moved_freeze():
    # Most moved: 0.9 (block 5); the line is 2/3 * 0.9 = 0.6. Blocks 0..2 (0.1, 0.3, 0.5) are below it, block 3
    # (0.6) is on it: 3 freeze. Block 4 (0.2) is below the line too, but above a block that moves: it keeps training.
    assert plasticity_num_frozen(0, [0.1, 0.3, 0.5, 0.6, 0.2, 0.9], 2 / 3) == 3
    # A lower share draws the line lower: 0.5 * 0.9 = 0.45: blocks 0 and 1.
    assert plasticity_num_frozen(0, [0.1, 0.3, 0.5, 0.6, 0.2, 0.9], 0.5) == 2


def test_frozen_blocks_are_left_out_and_the_most_moved_block_never_freezes():
    # F = 2: the active blocks are 2..5 (0.5, 0.6, 0.2, 0.3); most moved 0.6 (block 3): 0.4. Block 2 (0.5) is above it.
    assert plasticity_num_frozen(2, [9.0, 9.0, 0.5, 0.6, 0.2, 0.3], 2 / 3) == 2
    # Block 2 at 0.3 is below 0.4: one more. The frozen blocks' large values do not raise the line.
    assert plasticity_num_frozen(2, [9.0, 9.0, 0.3, 0.6, 0.2, 0.3], 2 / 3) == 3
    # Even with every block below the line but one, the most moved (the last) stays: at most L - 1.
    assert plasticity_num_frozen(0, [0.0, 0.0, 0.0, 0.0, 0.0, 1.0], 0.99) == 5
    # Equal displacements: nothing is below 2/3 of the largest.
    assert plasticity_num_frozen(0, [0.4] * 6, 2 / 3) == 0


def test_nothing_moved_or_a_non_finite_value_decides_nothing():
    assert plasticity_num_frozen(1, [0.0] * 6, 2 / 3) == 1
    assert plasticity_num_frozen(0, [0.1, math.nan, 0.5, 0.5, 0.5, 0.5], 2 / 3) == 0
    assert plasticity_num_frozen(6, [0.1] * 6, 2 / 3) == 6  # everything frozen already
    with pytest.raises(ValueError, match="prev_frozen"):
        plasticity_num_frozen(7, [0.1] * 6, 2 / 3)


@pytest.mark.parametrize("ratio", [0, 1, -0.5, 1.5, True, "2/3", None])
def test_the_share_must_lie_strictly_between_0_and_1(ratio):
    with pytest.raises(ValueError, match="ratio"):
        validate_ratio(ratio)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- the statistic


def test_the_displacement_is_measured_from_the_weights_at_the_first_step():
    stack = weight_stack([2.0, 1.0, -4.0, 1.0, 1.0, 1.0])
    moved = Displacement()
    assert moved.relative(stack, 0) is None  # before the first step
    moved.observe(stack, num_frozen=0)  # the copy: the weights fine-tuning starts from
    move(stack, [0.2, 0.5, 1.0, 0.0, -0.3, 0.1])
    moved.observe(stack, num_frozen=0)  # a later step copies nothing
    move(stack, [0.2, 0.0, 0.0, 0.0, 0.0, 0.1])
    # |w - w0| / |w0| per block: 0.4/2, 0.5/1, 1/4, 0, 0.3/1, 0.2/1.
    assert moved.relative(stack, 0) == pytest.approx([0.2, 0.5, 0.25, 0.0, 0.3, 0.2])
    assert moved.relative(stack, 2) == pytest.approx([0.0, 0.0, 0.25, 0.0, 0.3, 0.2])  # frozen blocks read 0


def test_the_copy_of_a_frozen_block_is_dropped_and_blocks_frozen_before_are_never_copied():
    stack = weight_stack([1.0] * 6)
    moved = Displacement()
    moved.observe(stack, num_frozen=2)
    assert moved.reference is not None and moved.reference[:2] == [None, None] and moved.reference[2] is not None
    moved.observe(stack, num_frozen=4)
    assert moved.reference[:4] == [None] * 4 and all(c is not None for c in moved.reference[4:])


def test_the_displacement_is_relative_to_each_blocks_size():
    blocks = nn.ModuleList([nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False)])
    with torch.no_grad():
        blocks[0].weight.copy_(torch.tensor([[3.0, 0.0], [0.0, 4.0]]))  # norm 5
        blocks[1].weight.copy_(torch.tensor([[30.0, 0.0], [0.0, 40.0]]))  # norm 50
    stack, moved = BlockStack("blocks", blocks), Displacement()
    moved.observe(stack, 0)
    with torch.no_grad():
        blocks[0].weight.add_(torch.tensor([[0.3, 0.0], [0.0, 0.4]]))  # moved 0.5 of 5
        blocks[1].weight.add_(torch.tensor([[0.3, 0.0], [0.0, 0.4]]))  # the same step, of 50
    assert moved.relative(stack, 0) == pytest.approx([0.1, 0.01], rel=1e-5)  # float32 weights


# ----------------------------------------------------------------------------- the policy


def test_a_candidate_freezes_once_two_points_in_a_row_agree():
    stack, rule = weight_stack([1.0] * 6), PlasticityRule()  # weights of 1: a block's displacement is how far it moved
    assert isinstance(rule, FreezeRule) and isinstance(make_rule("plasticity", 0.5, 50.0, None), PlasticityRule)
    assert rule.decide(point(1)) == 0  # no step yet: nothing to go on
    rule.observe(stack, 0)
    move(stack, [0.1, 0.1, 0.1, 0.7, 0.8, 0.9])  # line 2/3 * 0.9 = 0.6: blocks 0..2 below, block 3 above: candidate 3
    assert rule.decide(point(1)) == 0 and rule.previous == 3  # the first point only records its candidate
    move(stack, [0.0, 0.0, 0.0, 0.0, 0.4, 0.3])  # 0.1, 0.1, 0.1, 0.7, 1.2, 1.2: line 0.8, block 3 below: candidate 4
    assert rule.decide(point(2)) == 3  # the smaller of 3 and 4
    rule.observe(stack, 3)
    move(stack, [0.0, 0.0, 0.0, 0.0, 0.0, 0.3])  # active 3..5: 0.7, 1.2, 1.5; line 1.0: block 3 below, block 4 above
    assert rule.decide(point(3, num_frozen=3)) == 4  # candidates 4 (before) and 4 (now)
    move(stack, [0.0, 0.0, 0.0, 0.0, 0.0, 1.0])  # active 4..5: 1.2, 2.5; line 1.67: block 4 below: candidate 5
    assert rule.decide(point(4, num_frozen=4)) == 4  # the smaller of 4 and 5
    assert rule.decide(point(5, num_frozen=4)) == 5  # 5 twice in a row; block 5, the most moved, is never a candidate


def test_nothing_is_read_while_the_learning_rate_rises():
    stack, rule = weight_stack([1.0] * 6), PlasticityRule()
    rule.observe(stack, 0)
    move(stack, [0.1, 0.1, 0.1, 0.7, 0.8, 0.9])  # candidate 3 whenever it is read
    assert rule.decide(point(1, lr=2e-5, last=1e-5)) == 0 and rule.previous is None  # warming up: not read
    assert rule.decide(point(2, lr=2e-5, last=2e-5)) == 0 and rule.previous == 3  # flat: read, recorded
    assert rule.decide(point(3, lr=1.5e-5, last=1.6e-5)) == 3  # falling: read again, the two agree
    assert rule.decide(point(4, num_frozen=3, lr=3e-5, last=1e-5)) == 3 and rule.previous is None  # a rise (a restart) resets
    assert rule.decide(point(5, num_frozen=3, lr=1e-5)) == 3 and rule.previous == 3  # no step yet: the rate gates nothing


def test_the_rule_checkpoints_its_copy_and_its_last_candidate():
    stack, rule = weight_stack([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), PlasticityRule(ratio=0.5)
    rule.observe(stack, 0)
    move(stack, [0.1, 0.1, 0.1, 0.1, 0.1, 3.0])
    rule.decide(point(1))
    full, decisions = rule.state_dict(), rule.state_dict(full=False)
    assert set(full) == {"plasticity_previous", "plasticity_reference"} and set(decisions) == {"plasticity_previous"}
    restored = PlasticityRule(ratio=0.5)
    restored.load_state_dict(full, stack)  # a resumed run: the copy of the starting weights comes back
    assert restored.previous == rule.previous == 5
    assert restored.candidate(0) == rule.candidate(0) == 5
    follower = PlasticityRule(ratio=0.5)
    follower.load_state_dict(decisions, stack)  # an agree message carries no copy
    assert follower.previous == 5 and follower.statistics.reference is None


def test_autofreeze_takes_the_rule_by_name_with_points_every_sixteenth_of_an_epoch():
    freeze = AutoFreeze(rule="plasticity")
    assert isinstance(freeze.freeze_rule, PlasticityRule) and freeze.freeze_interval == 0.0625
    assert AutoFreeze(rule="plasticity", freeze_interval=5).freeze_interval == 5  # a given interval wins
    assert AutoFreeze(rule=PlasticityRule(ratio=0.5)).freeze_rule.ratio == 0.5  # type: ignore[attr-defined]
    assert AutoFreeze(rule="paper").freeze_interval is None  # the other rules keep epoch-level points
