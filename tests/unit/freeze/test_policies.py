"""Freeze rules as policy objects, driven by hand: synthetic statistics in, decisions out, no Trainer.

Every expected value below is derived by hand from the documented rule (docs/autofreeze.md) in
the comment beside it; the same inputs gave the same decisions through the callback before the
rules became policy objects.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_pipetransformer import AutoFreeze
from lightning_pipetransformer.freeze.policies import (
    AutoFreezeRule,
    ExplicitPlan,
    FreezePoint,
    FreezeRule,
    GeometricSchedule,
    PaperRule,
    make_rule,
)
from lightning_pipetransformer.stack.discovery import BlockStack

L = 6


def point(index: int, num_frozen: int = 0, epoch: int | None = None, max_frozen: int = L - 1, untrainable: int = 0) -> FreezePoint:
    return FreezePoint(index, index if epoch is None else epoch, num_frozen, L, max_frozen, untrainable)


def scalar_stack() -> BlockStack:
    """Six blocks of one weight each: a block's gradient norm is the absolute value of its one gradient."""
    return BlockStack("blocks", nn.ModuleList(nn.Linear(1, 1, bias=False) for _ in range(L)))


def set_grads(stack: BlockStack, grads: list[float | None]) -> None:
    for block, g in zip(stack.blocks, grads):
        block.weight.grad = None if g is None else torch.full((1, 1), float(g))


def test_every_built_in_rule_is_a_freeze_rule():
    rules = [make_rule(name, 0.5, 50.0, None) for name in ("paper", "schedule", "autofreeze")] + [make_rule("paper", 0.5, 50.0, {1: 2})]
    assert [type(r) for r in rules] == [PaperRule, GeometricSchedule, AutoFreezeRule, ExplicitPlan]
    assert all(isinstance(r, FreezeRule) for r in rules)
    assert not isinstance("paper", FreezeRule)
    with pytest.raises(ValueError, match="FreezeRule object"):
        make_rule("median", 0.5, 50.0, None)


# ----------------------------------------------------------------------------- "paper"


def test_the_paper_rule_decides_from_the_mean_norms_of_the_interval():
    rule = PaperRule(alpha=0.5)
    rule.statistics.add(torch.tensor([3.0, 2, 1, 4, 5, 6]))
    rule.statistics.add(torch.tensor([3.0, 2, 3, 4, 5, 6]))
    assert rule.statistics.mean() == [3, 2, 2, 4, 5, 6]
    # Geometric bound ceil(0 + 0.5 * 6) = 3; the smallest mean norm is block 1 (first of the tie 1, 2): 1 + 1 = 2.
    assert rule.decide(point(1)) == 2
    assert rule.statistics.mean() is None  # the interval's statistics are spent on the decision
    assert rule.decide(point(2, num_frozen=2)) == 2  # no optimizer step since: nothing to go on


def test_the_paper_rule_reads_the_gradients_of_the_active_blocks_only():
    stack, rule = scalar_stack(), PaperRule(alpha=0.5)
    set_grads(stack, [9, 9, 4, 1, 5, 6])
    rule.observe(stack, num_frozen=2)
    assert rule.statistics.mean() == [0, 0, 4, 1, 5, 6]  # frozen blocks 0 and 1 count as 0
    # Geometric bound ceil(2 + 0.5 * 4) = 4; the smallest active norm is block 3: 4. min(4, 4) = 4.
    assert rule.decide(point(2, num_frozen=2)) == 4


def test_a_non_finite_step_is_left_out_of_the_paper_rules_mean():
    rule = PaperRule(alpha=0.5)
    rule.statistics.add(torch.tensor([1.0, 1, 1, 1, 1, 1]))
    rule.statistics.add(torch.tensor([1.0, math.inf, 1, 1, 1, 1]))  # skipped by AMP's scaler
    rule.statistics.add(torch.tensor([3.0, 3, 3, 0.5, 3, 3]))
    assert rule.statistics.mean() == [2, 2, 2, 0.75, 2, 2]  # over the two finite steps
    assert rule.state_dict()["norm_steps"] == 2
    assert rule.decide(point(1)) == 3  # bound 3; smallest at block 3 -> 4; min = 3


# ----------------------------------------------------------------------------- "autofreeze"


def autofreeze_interval(rule: AutoFreezeRule, stack: BlockStack, num_frozen: int, *steps: list[float]) -> int:
    for grads in steps:
        set_grads(stack, grads)
        rule.observe(stack, num_frozen)
    return rule.decide(point(1, num_frozen=num_frozen))


def test_the_autofreeze_rule_compares_two_intervals():
    stack, rule = scalar_stack(), AutoFreezeRule(percentile=50)
    # Interval 1 sets the baseline, L1 = 1 per block (two steps of 0.5): no decision yet.
    assert autofreeze_interval(rule, stack, 0, [0.5] * 6, [0.5] * 6) == 0
    assert rule.previous_l1 == [1.0] * 6
    # Interval 2: L1 [1, 1, 2, 3, 1.5, 1.2]; changes |p - c| / p = [0, 0, 1, 2, 0.5, 0.2]; their median
    # (0.2 + 0.5) / 2 = 0.35; the first block that reaches it is block 2: blocks 0..1 freeze.
    assert autofreeze_interval(rule, stack, 0, [1, 1, 2, 3, 1.5, 1.2]) == 2
    # Interval 3 (blocks 0, 1 frozen: their gradients are not summed): L1 [0, 0, 2, 3.3, 3, 1.2];
    # changes [0, 0, 0, 0.1, 1, 0]; the median of the active four [0, 0.1, 1, 0] is 0.05: block 3.
    assert autofreeze_interval(rule, stack, 2, [7, 7, 2, 3.3, 3, 1.2]) == 3
    assert rule.previous_l1 == pytest.approx([0, 0, 2, 3.3, 3, 1.2])


def test_an_overflowed_interval_decides_nothing_and_drops_the_baseline():
    stack, rule = scalar_stack(), AutoFreezeRule()
    autofreeze_interval(rule, stack, 0, [1.0] * 6)  # the baseline
    set_grads(stack, [1.0] * 6)
    rule.observe(stack, 0)
    rule.statistics.sums[2][0].fill_(math.inf)  # sums that overflowed in the interval
    assert rule.decide(point(2)) == 0 and rule.previous_l1 is None
    assert autofreeze_interval(rule, stack, 0, [2.0] * 6) == 0  # a new baseline only
    assert rule.previous_l1 == [2.0] * 6


def test_the_autofreeze_rule_ships_its_sums_in_checkpoints_not_in_decisions():
    stack, rule = scalar_stack(), AutoFreezeRule()
    autofreeze_interval(rule, stack, 0, [1.0] * 6)
    set_grads(stack, [0.5] * 6)
    rule.observe(stack, 0)
    full, decisions = rule.state_dict(), rule.state_dict(full=False)
    assert set(full) == {"previous_l1", "grad_sums"} and set(decisions) == {"previous_l1"}
    restored = AutoFreezeRule()
    restored.load_state_dict(full, stack)
    assert restored.statistics.l1_norms(0) == [0.5] * 6 and restored.previous_l1 == [1.0] * 6


# ----------------------------------------------------------------------------- fixed plans


def test_the_geometric_schedule_knows_its_decisions_ahead():
    rule = GeometricSchedule(alpha=1 / 3)
    # 6 (1 - (2/3)^T) = 0, 2, 3.33, 4.22, 4.81, 5.21 -> ceil: 0, 2, 4, 5, 5, 6 (capped by the callback, not the rule).
    assert [rule.decide(point(t)) for t in range(6)] == [0, 2, 4, 5, 5, 6]
    assert [rule.ahead(point(t)) for t in range(6)] == [0, 2, 4, 5, 5, 6]
    assert rule.plans_ahead and not rule.per_epoch and rule.state_dict() == {}


def test_an_explicit_plan_is_followed_per_epoch_and_refused_when_it_cannot_be():
    rule = ExplicitPlan({1: 2, 3: 4})
    assert rule.per_epoch and rule.plans_ahead
    assert [rule.decide(point(e, num_frozen=min(e, 1) * 2 if e < 3 else 4)) for e in range(6)] == [0, 2, 2, 4, 4, 4]
    assert rule.decide(point(0, untrainable=3, num_frozen=3)) == 3  # blocks frozen before fit count, whatever the plan says
    with pytest.raises(ValueError, match="must not decrease"):
        rule.decide(point(1, num_frozen=3))
    assert rule.ahead(point(3, num_frozen=2)) == 4
    assert rule.ahead(point(3, num_frozen=4)) is None  # nothing new to anneal
    assert ExplicitPlan({1: 9}).ahead(point(1)) is None  # beyond the stack: refused at its epoch, not annealed
    with pytest.raises(ValueError, match="outside"):
        ExplicitPlan({1: 9}).check(max_frozen=5, num_epochs=None)


# ----------------------------------------------------------------------------- the callback's mechanism around a rule


def callback(**kwargs) -> AutoFreeze:
    freeze = AutoFreeze(**kwargs)
    freeze.stack = scalar_stack()
    return freeze


def test_the_callback_caps_the_rule_and_decides_once_per_point():
    freeze = callback(rule="paper", alpha=0.5, freeze_every_n_epochs=2)
    for grads in ([3, 2, 1, 4, 5, 6], [3, 2, 3, 4, 5, 6]):
        set_grads(freeze.stack, grads)
        freeze.on_before_optimizer_step(None, None, None)  # type: ignore[arg-type]
    assert freeze._epoch_index(1) is None  # freeze_every_n_epochs=2: epoch 1 is no point
    assert freeze._epoch_index(2) == 1
    freeze.num_frozen = freeze._decide(1, 2)
    assert freeze.num_frozen == 2  # as the rule decided above by hand
    assert freeze._epoch_index(2) is None  # a resumed epoch start does not decide twice
    greedy = callback(rule=GeometricSchedule(alpha=0.9))
    assert greedy._decide(3, 3) == L - 1  # 6 (1 - 0.1^3) -> 6, capped at L - min_active


# ----------------------------------------------------------------------------- checkpoints written before the rules were objects

#: What AutoFreeze.state_dict() wrote before the rules became policy objects: every rule's keys,
#: whatever the rule (the values: two steps of the paper test above; one step of 0.5 for the
#: autofreeze rule after a baseline of 1; an annealing of blocks 0..2 over steps 0..7).
OLD_COMMON = {"num_blocks": 6, "history": [], "decided_epoch": 0, "step_history": [], "pre_frozen": False, "pre": [], "post": []}
OLD_PAPER = {**OLD_COMMON, "num_frozen": 0, "norm_sum": [6.0, 4.0, 4.0, 8.0, 10.0, 12.0], "norm_steps": 2, "next_point": None,
             "points": 0, "previous_l1": None, "anneal": None, "grad_sums": None}  # fmt: skip
OLD_AUTOFREEZE = {**OLD_COMMON, "num_frozen": 0, "norm_sum": None, "norm_steps": 0, "next_point": 4, "points": 1,
                  "previous_l1": [1.0] * 6, "anneal": None, "grad_sums": [[torch.tensor([[0.5]])] for _ in range(6)]}  # fmt: skip
OLD_ANNEAL = {**OLD_COMMON, "num_frozen": 0, "norm_sum": None, "norm_steps": 0, "next_point": None, "points": 0,
              "previous_l1": None, "anneal": {"plan": {"source": 0, "target": 3, "start": 0, "end": 8}}, "grad_sums": None}  # fmt: skip


def test_a_paper_checkpoint_of_the_old_format_loads_and_decides_the_same():
    freeze = callback(rule="paper", alpha=0.5)
    freeze.load_state_dict(OLD_PAPER)
    assert freeze.freeze_rule.statistics.mean() == [3, 2, 2, 4, 5, 6]
    freeze.num_frozen = freeze._decide(freeze._epoch_index(1), 1)
    assert freeze.num_frozen == 2  # as test_the_paper_rule_decides_from_the_mean_norms_of_the_interval
    # Written again, the rule's keys keep their names and values.
    again = callback(rule="paper", alpha=0.5)
    again.load_state_dict(OLD_PAPER)
    # (The callback's own "last_rate", the last optimizer step's learning rate, came later: None before a step.)
    old = {k: v for k, v in OLD_PAPER.items() if k not in ("previous_l1", "grad_sums")}
    assert old | {"last_rate": None} == again.state_dict()


def test_an_autofreeze_checkpoint_of_the_old_format_loads_mid_interval():
    freeze = callback(rule="autofreeze", freeze_interval=2)
    freeze.load_state_dict(OLD_AUTOFREEZE)
    assert (freeze.clock.next_point, freeze.clock.points) == (4, 1)
    set_grads(freeze.stack, [0.5, 0.5, 1.5, 2.5, 1.0, 0.7])  # the interval's second step: sums [1, 1, 2, 3, 1.5, 1.2]
    freeze.on_before_optimizer_step(None, None, None)  # type: ignore[arg-type]
    assert freeze._decide(2, 0) == 2  # as test_the_autofreeze_rule_compares_two_intervals
    assert set(freeze.state_dict()) == set(OLD_AUTOFREEZE) - {"norm_sum", "norm_steps"} | {"last_rate"}


def test_an_annealing_checkpoint_of_the_old_format_restores_its_plan():
    freeze = callback(rule="schedule", alpha=0.5, anneal="cosine")
    freeze._setup_anneal(type("OneProcess", (), {"strategy": object(), "world_size": 1})())  # type: ignore[arg-type]
    freeze.load_state_dict(OLD_ANNEAL)
    plan = freeze._anneal.plan
    assert plan is not None and (plan.source, plan.target, plan.start, plan.end) == (0, 3, 0, 8)
    assert freeze.state_dict()["anneal"] == OLD_ANNEAL["anneal"]


def test_the_most_the_strategy_plans_for_is_what_the_plan_reaches_in_the_run():
    planned = callback(schedule={1: 2, 3: 4})
    # The plan reaches 2 within two epochs, 4 within five; unbounded: anything up to L - min_active = 5.
    assert [planned.most_frozen(2), planned.most_frozen(5), planned.most_frozen(None)] == [2, 4, 5]
    assert callback(rule="paper").most_frozen(2) == 5
