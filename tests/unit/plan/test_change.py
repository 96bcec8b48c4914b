"""PlanChange: what a move between two plans takes, as data (no processes, no Trainer)."""

from __future__ import annotations

from lightning_pipetransformer.plan import Plan
from lightning_pipetransformer.plan.change import PlanChange


def plan(num_frozen: int, partition: tuple[int, ...], active: tuple[int, ...], devices_per_node: int = 4) -> Plan:
    k = len(partition)
    replicas = devices_per_node // k
    return Plan(
        num_frozen=num_frozen, pipe_len=k, chunks=1, partition=partition,
        devices=tuple(tuple(f"cuda:{j * k + s}" for s in range(k)) for j in range(replicas)), active_ranks=active,
    )


def test_the_first_plan_does_everything():
    first = plan(0, (2, 2, 2, 2), (0,))
    change = PlanChange.between(None, first)
    assert change.rebuild and change.regroup and change.resplit and change.joining == (0,) and change.boundary is None
    assert not change.is_empty


def test_the_same_plan_is_nothing_to_do():
    p = plan(2, (2, 2, 2, 2), (0,))
    change = PlanChange.between(p, plan(2, (2, 2, 2, 2), (0,)))
    assert change.is_empty and change.steps() == [] and str(change) == "PlanChange(nothing)"


def test_a_shrinking_pipeline_regroups_sends_to_joiners_resplits_and_moves_the_boundary():
    old, new = plan(2, (2, 2, 2, 2), (0,)), plan(4, (4, 4), (0, 2))
    change = PlanChange.between(old, new)
    assert change.rebuild and change.regroup and change.resplit
    assert change.joining == (2,) and change.leaving == () and change.boundary == (2, 4)
    assert change.steps() == [
        "rebuild: F=2 K=4 (2, 2, 2, 2) -> F=4 K=2 (4, 4)",
        "regroup: active ranks (0,) -> (0, 2)",
        "send state: rank 0 -> joining (2,)",
        "resplit: data over 2 replica(s)",
        "boundary: F 2 -> 4",
    ]
    assert str(change).startswith("PlanChange:\n  1. rebuild:")


def test_more_frozen_blocks_at_the_same_pipe_length_rebuild_but_keep_the_group():
    old, new = plan(2, (2, 2, 2, 2), (0,)), plan(3, (3, 2, 2, 1), (0,))
    change = PlanChange.between(old, new)
    assert change.rebuild and not change.regroup and not change.resplit and change.joining == ()
    assert change.boundary == (2, 3)


def test_a_repartition_without_a_new_freeze_moves_no_boundary():
    change = PlanChange.between(plan(2, (2, 2, 2, 2), (0,)), plan(2, (3, 2, 2, 1), (0,)))
    assert change.rebuild and change.boundary is None and not change.regroup


def test_ranks_that_leave_are_named():
    change = PlanChange.between(plan(4, (4, 4), (0, 2)), plan(4, (2, 2, 2, 2), (0,)))
    assert change.leaving == (2,) and change.joining == () and change.resplit and "idle: (2,)" in change.steps()
