"""AutoPipe planner: compression as blocks freeze, frozen_cost, M per K, Plan round-trip, ranks."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipetransformer.pipe.chunks import chunk_candidates, fastest_chunks
from lightning_pipetransformer.pipe.costs import weighted_costs
from lightning_pipetransformer.pipe.planner import AutoPipe, Plan
from tests.helpers.partitions import brute_min_max

# BERT-base (transformers BertConfig() defaults): every encoder layer has 7,087,872 parameters,
# the embeddings 23,837,184 and the pooler 590,592.
BERT_LAYER, BERT_EMB, BERT_POOLER = 7_087_872.0, 23_837_184.0, 590_592.0


def expected_sequence(costs: list[float], pre: float, post: float, fc: float, k0: int, g: int) -> list[int]:
    """K for F = 0..L, by the paper's rule, computed independently of the code under test."""
    def items(f: int) -> list[float]:
        w = [c * fc if i < f else c for i, c in enumerate(costs)]
        w[0] += pre * (fc if f > 0 else 1.0)
        w[-1] += post
        return w

    budget = brute_min_max(items(0), k0)
    k, out = k0, []
    for f in range(len(costs) + 1):
        while f > 0 and k % 2 == 0 and g % (k // 2) == 0 and brute_min_max(items(f), k // 2) <= budget:
            k //= 2
        out.append(k)
    return out


# --- the compression sequence ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("frozen_cost", "expected"),
    [
        # By hand, 12 equal blocks, K0 = 8: budget = 2 blocks. K=4 fits once the frozen prefix
        # plus the active blocks fit four stages of 2: 6 + floor(2 - F*fc) >= 12 - F.
        (1 / 6, [8] * 5 + [4] * 5 + [2] * 2 + [1]),  # K=4 at F=5, K=2 at F=10, K=1 at F=12
        (0.0, [8] * 4 + [4] * 4 + [2] * 2 + [1] * 3),  # frozen blocks are free: earlier halvings
        (1.0, [8] * 13),  # frozen blocks cost as much as active ones: nothing ever fits
    ],
)
def test_compression_sequence_equal_blocks(frozen_cost: float, expected: list[int]) -> None:
    planner = AutoPipe([1.0] * 12, devices_per_node=8, frozen_cost=frozen_cost)
    assert planner.budget == 2.0
    assert [planner.plan(f).pipe_len for f in range(13)] == expected


def test_compression_sequence_bert_base() -> None:
    costs = [BERT_LAYER] * 12
    planner = AutoPipe(costs, devices_per_node=8, pre_cost=BERT_EMB, post_cost=BERT_POOLER)
    got = [planner.plan(f) for f in range(13)]
    expected = expected_sequence(costs, BERT_EMB, BERT_POOLER, 1 / 6, 8, 8)
    assert [p.pipe_len for p in got] == expected
    # The embeddings dominate stage 0 at K=8 (30.9M), so the first freeze already halves K;
    # written out so a change in the rule shows up here in plain numbers.
    assert expected == [8, 4, 4, 4, 4, 4, 2, 2, 2, 2, 1, 1, 1]
    for f, plan in enumerate(got):
        assert plan.budget == pytest.approx(BERT_EMB + BERT_LAYER)
        w = list(weighted_costs(costs, f, 1 / 6))
        w[0] += BERT_EMB * (1 / 6 if f else 1)
        w[-1] += BERT_POOLER
        # Each plan's partition is optimal, and a compressed plan fits the budget.
        assert max(plan.stage_costs) == pytest.approx(brute_min_max(w, plan.pipe_len))
        if plan.pipe_len < 8:
            assert max(plan.stage_costs) <= plan.budget


def test_frozen_cost_orders_the_sequences() -> None:
    """Cheaper frozen blocks never leave a longer pipeline at any F."""
    seqs = {}
    for fc in (0.0, 1 / 6, 0.5, 1.0):
        planner = AutoPipe([BERT_LAYER] * 12, devices_per_node=8, frozen_cost=fc)
        seqs[fc] = [planner.plan(f).pipe_len for f in range(13)]
    assert all(a <= b for a, b in zip(seqs[0.0], seqs[1 / 6]))
    assert all(a <= b for a, b in zip(seqs[1 / 6], seqs[0.5]))
    assert all(a <= b for a, b in zip(seqs[0.5], seqs[1.0]))
    assert seqs[0.0] != seqs[1 / 6] != seqs[1.0]


def test_no_compression_without_a_freeze() -> None:
    # At F=0 the embeddings make K=8 wasteful, but the rule only compresses after a freeze.
    planner = AutoPipe([BERT_LAYER] * 12, devices_per_node=8, pre_cost=BERT_EMB)
    assert planner.plan(0).pipe_len == 8
    assert planner.plan(0).pipe_len == 8


def test_freeze_steps_can_skip() -> None:
    """AutoFreeze jumps (0 -> 4 -> 7 -> ...): the plan only depends on F, not on the path."""
    jumping = AutoPipe([1.0] * 12, devices_per_node=8)
    stepping = AutoPipe([1.0] * 12, devices_per_node=8)
    by_step = {f: stepping.plan(f) for f in range(13)}
    for f in (0, 4, 7, 10, 12):
        assert jumping.plan(f) == by_step[f]


@settings(max_examples=60, deadline=None)
@given(
    costs=st.lists(st.integers(min_value=1, max_value=50), min_size=8, max_size=12),
    g=st.sampled_from([1, 2, 4, 8]),
    fc=st.sampled_from([0.0, 1 / 6, 0.5, 1.0]),
    pin=st.booleans(),
    data=st.data(),
)
def test_pipe_len_never_grows(costs: list[int], g: int, fc: float, pin: bool, data: st.DataObject) -> None:
    steps = sorted(data.draw(st.lists(st.integers(min_value=0, max_value=len(costs)), max_size=6)))
    planner = AutoPipe(costs, devices_per_node=g, frozen_cost=fc, pin_frozen_prefix=pin)
    previous = g
    for f in steps:
        plan = planner.plan(f)
        assert plan.pipe_len <= previous and g % plan.pipe_len == 0
        assert sum(plan.partition) == len(costs) and len(plan.partition) == plan.pipe_len
        if pin:
            assert plan.partition[0] >= f  # the frozen prefix stays on the first device
        elif 0 < plan.pipe_len < g:
            assert max(plan.stage_costs) <= plan.budget * (1 + 1e-9)
        previous = plan.pipe_len


def test_pinned_prefix_forces_fewer_stages_when_too_few_remain() -> None:
    # frozen_cost=1 and the prefix pinned on stage 0: at F=6 only 7 items remain for 8 stages.
    planner = AutoPipe([1.0] * 12, devices_per_node=8, frozen_cost=1.0, pin_frozen_prefix=True)
    plans = [planner.plan(f) for f in range(13)]
    assert [p.pipe_len for p in plans] == [8] * 6 + [4] * 4 + [2] * 2 + [1]
    assert all(p.partition[0] >= p.num_frozen for p in plans)


# --- micro-batches ----------------------------------------------------------------------------


def test_auto_chunks_candidates_and_the_fastest_pick() -> None:
    """chunks="auto" lives in one place (pipe/chunks.py): candidates K..6K, the fastest M, ties to the fewest."""
    assert list(chunk_candidates(2)) == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert fastest_chunks({m: (m - 3 * 8) ** 2 + 1.0 for m in chunk_candidates(8)}) == 24
    assert fastest_chunks({4: 1.0, 2: 1.0, 3: 1.0}) == 2  # ties: the smallest M, whatever the order
    with pytest.raises(ValueError, match="No workable micro-batch count"):
        fastest_chunks({2: float("inf"), 3: float("inf")})


def test_planner_refuses_auto_chunks_and_points_to_the_strategy() -> None:
    with pytest.raises(ValueError, match=r"PipeTransformerStrategy\(chunks='auto'\)"):
        AutoPipe([1.0] * 4, devices_per_node=2, chunks="auto")


def test_given_chunks() -> None:
    assert AutoPipe([1.0] * 4, devices_per_node=2, chunks=5).plan(0).chunks == 5
    per_k = AutoPipe([1.0] * 4, devices_per_node=2, chunks={2: 8, 1: 1}, frozen_cost=0.0)
    assert per_k.plan(0).chunks == 8
    assert per_k.plan(4).chunks == 1
    with pytest.raises(ValueError, match="no entry for pipe length 2"):
        AutoPipe([1.0] * 4, devices_per_node=2, chunks={1: 1}).plan(0)


# --- the plan ---------------------------------------------------------------------------------


def test_plan_json_round_trip() -> None:
    planner = AutoPipe([BERT_LAYER] * 12, devices_per_node=8, num_nodes=2, chunks=4, pre_cost=BERT_EMB)
    for f in (0, 3, 6, 10):
        plan = planner.plan(f)
        data = json.loads(json.dumps(plan.to_dict()))
        assert Plan.from_dict(data) == plan
        assert hash(Plan.from_dict(data)) == hash(plan)
    with pytest.raises(ValueError, match="missing keys \\['chunks'\\]"):
        Plan.from_dict({k: v for k, v in data.items() if k != "chunks"})
    with pytest.raises(ValueError, match="unknown keys \\['pipe_length'\\]"):
        Plan.from_dict({**data, "pipe_length": 2})
    with pytest.raises(ValueError, match="non-empty stages"):
        Plan.from_dict({**data, "partition": [6, 0]})


def test_active_ranks_two_nodes_of_eight() -> None:
    planner = AutoPipe([1.0] * 12, devices_per_node=8, num_nodes=2, frozen_cost=0.0)
    plans = {p.pipe_len: p for p in (planner.plan(f) for f in range(13))}
    assert sorted(plans) == [1, 2, 4, 8]
    assert plans[8].active_ranks == (0, 8)
    assert plans[4].active_ranks == (0, 4, 8, 12)
    assert plans[2].active_ranks == (0, 2, 4, 6, 8, 10, 12, 14)
    assert plans[1].active_ranks == tuple(range(16))
    assert plans[8].devices == (tuple(f"cuda:{i}" for i in range(8)),)
    # Each replica's first stage is its own process's device (local rank j*K -> cuda:j*K).
    assert plans[4].devices_for(4) == ("cuda:4", "cuda:5", "cuda:6", "cuda:7")
    assert plans[2].devices_for(6) == ("cuda:6", "cuda:7")
    for k, plan in plans.items():
        for rank in plan.active_ranks:
            assert plan.devices_for(rank % 8)[0] == f"cuda:{rank % 8}"
    assert plans[4].num_replicas == 4 and plans[4].replica_index(12) == 3
    assert not plans[4].is_active(2)
    with pytest.raises(ValueError, match="idle"):
        plans[4].replica_index(2)
    with pytest.raises(ValueError, match="only local ranks 0, 4 are active"):
        plans[4].devices_for(2)


def test_virtual_cpu_devices() -> None:
    planner = AutoPipe([1.0] * 6, devices_per_node=4, pipe_len=2, node_devices=["cpu"] * 4)
    plan = planner.plan(0)
    assert plan.devices == (("cpu", "cpu"), ("cpu", "cpu"))
    assert plan.active_ranks == (0, 2) and plan.boundaries == (0, 3, 6)


def test_state_dict_resumes_the_same_plans() -> None:
    first = AutoPipe([1.0] * 12, devices_per_node=8)
    for f in range(8):
        first.plan(f)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = AutoPipe([1.0] * 12, devices_per_node=8)
    resumed.load_state_dict(state)
    assert resumed.pipe_len == first.pipe_len == 4
    assert [resumed.plan(f) for f in range(8, 13)] == [first.plan(f) for f in range(8, 13)]
    with pytest.raises(ValueError, match="does not fit"):
        resumed.load_state_dict({"pipe_len": 3, "num_frozen": 0})


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pipe_len": 3}, r"must divide the 8 devices per node: use one of \[1, 2, 4, 8\]"),
        ({"costs": [1.0] * 4}, "Cannot split 4 blocks into 8 stages: pass pipe_len <= 4"),
        ({"frozen_cost": -0.1}, r"frozen_cost must be in \[0, 1\]"),
        ({"frozen_cost": 1.5}, r"frozen_cost must be in \[0, 1\]"),
        ({"chunks": 0}, "chunks .* must be >= 1"),
        ({"chunks": "auto"}, "measured on real batches"),
        ({"chunks": "many"}, "an int >= 1 or a mapping"),
        ({"node_devices": ["cpu"] * 4}, "names 4 devices, but devices_per_node is 8"),
        ({"costs": [1.0, -1.0] * 6}, "non-negative"),
        ({"costs": []}, "non-empty"),
    ],
)
def test_bad_planner_input(kwargs: dict, match: str) -> None:
    args = {"costs": [1.0] * 12, "devices_per_node": 8, **kwargs}
    costs = args.pop("costs")
    with pytest.raises(ValueError, match=match):
        AutoPipe(costs, **args)


def test_bad_num_frozen() -> None:
    planner = AutoPipe([1.0] * 12, devices_per_node=8)
    for f in (-1, 13):
        with pytest.raises(ValueError, match=r"num_frozen must be in 0..12"):
            planner.plan(f)


def test_a_thaw_keeps_the_pipe_length_and_rebalances() -> None:
    # Something unfroze blocks (the strategy's plan follows the model): K never grows back, the partition follows F.
    planner = AutoPipe([1.0] * 12, devices_per_node=8, pipe_len=8)
    compressed = planner.plan(10)
    thawed = planner.plan(2)
    assert thawed.pipe_len == compressed.pipe_len < 8
    assert thawed.num_frozen == 2 and sum(thawed.partition) == 12
    assert thawed.stage_costs != compressed.stage_costs  # the active blocks weigh more again


# --- costs ------------------------------------------------------------------------------------


def test_weighted_costs() -> None:
    assert weighted_costs([6.0, 6.0, 6.0], 2, 1 / 6) == (1.0, 1.0, 6.0)
    assert weighted_costs([6.0, 6.0], 0, 0.0) == (6.0, 6.0)
    assert weighted_costs([6.0, 6.0], 2, 0.0) == (0.0, 0.0)
    with pytest.raises(ValueError, match="num_frozen must be in 0..2"):
        weighted_costs([6.0, 6.0], 3, 0.5)
    with pytest.raises(ValueError, match=r"frozen_cost must be in \[0, 1\]"):
        weighted_costs([6.0, 6.0], 1, 2.0)
