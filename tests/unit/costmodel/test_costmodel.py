"""Cost model: closed forms it must get exactly, monotonicity, bad input, the CLI, the paper,
and that its plans are the trainer's (AutoPipe's partition and compression, AutoFreeze's schedule)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pipetransformer.costmodel.model import (
    VARIANTS,
    BlockCost,
    Cluster,
    ModelCost,
    Training,
    bubble_fraction,
    flow_shop_time,
    pipeline_step_time,
    ring_allreduce_time,
)
from lightning_pipetransformer.costmodel.presets import get_preset
from lightning_pipetransformer.costmodel.simulator import microbatch_profile, simulate, simulate_variant
from lightning_pipetransformer.freeze.callback import AutoFreeze
from lightning_pipetransformer.pipe.partition import compress_pipe_len, optimal_partition, paper_greedy_partition
from lightning_pipetransformer.pipe.planner import AutoPipe
from lightning_pipetransformer.stack.discovery import BlockStack

GB = 1e9


def _uniform(n: int = 8, fwd: float = 1e-3, bwd: float = 2e-3, act: float = 1e6, params: float = 1e7) -> ModelCost:
    return ModelCost((BlockCost(fwd, bwd, act, params),) * n)


def _cluster(nodes: int = 1, gpus: int = 8, **kw) -> Cluster:
    base = dict(intra_node_bw=1e30, inter_node_bw=1e30)
    base.update(kw)
    return Cluster(nodes=nodes, gpus_per_node=gpus, **base)


def _train(**kw) -> Training:
    base = dict(dataset_size=1000, epochs=3, batch_size=40, pipe_len=1, micro_batches=1, frozen=(0, 0, 0))
    base.update(kw)
    return Training(**base)


# ----------------------------------------------------------------------------- closed forms


def test_one_stage_no_freezing_is_sum_of_block_times_times_batches() -> None:
    model = ModelCost(tuple(BlockCost(1e-3 * (i + 1), 2e-3 * (i + 1), 0, 0) for i in range(4)))
    train = _train(dataset_size=1000, batch_size=40, epochs=3)
    report = simulate(model, _cluster(nodes=1, gpus=1), train, {"baseline": VARIANTS["baseline"]})
    per_sample = sum(b.forward_s + b.backward_s for b in model.blocks)
    batches = math.ceil(1000 / 40)
    assert report.variants["baseline"].total_s == pytest.approx(3 * batches * 40 * per_sample, rel=1e-12)


@pytest.mark.parametrize("k,m", [(2, 1), (4, 4), (8, 16), (4, 32)])
def test_balanced_pipeline_bubble_fraction(k: int, m: int) -> None:
    model = _uniform(n=k)
    train = _train(batch_size=m * 10, pipe_len=k, micro_batches=m)
    step = pipeline_step_time(model, _cluster(), train, frozen=0, pipe_len=k, micro_batches=m, replicas=1).step_s
    ideal = train.batch_size * 3e-3  # one stage's work for the whole batch
    assert 1 - ideal / step == pytest.approx(bubble_fraction(k, m), rel=1e-12)
    assert bubble_fraction(k, m) == (k - 1) / (m + k - 1)


def test_ring_allreduce_closed_form() -> None:
    assert ring_allreduce_time(4e8, 16, 5e9) == pytest.approx(2 * 15 / 16 * 4e8 / 5e9)
    assert ring_allreduce_time(4e8, 1, 5e9) == 0.0
    # In the simulator: 2 single-stage replicas on 2 nodes reduce all params over the network.
    model = _uniform(n=2, params=5e8)
    t = pipeline_step_time(model, _cluster(nodes=2, gpus=1, inter_node_bw=5e9), _train(), frozen=0,
                           pipe_len=1, micro_batches=1, replicas=2)
    assert t.breakdown["allreduce"] == pytest.approx(ring_allreduce_time(1e9, 2, 5e9))


def test_flow_shop_and_schedule() -> None:
    assert flow_shop_time([1.0, 3.0, 2.0], 4) == 6.0 + 3 * 3.0
    # 12 * (1 - 2/3) is 4.000000000000001 in floats: the schedule must still say 4.
    frozen = lambda m: [e.frozen for e in simulate_variant(  # noqa: E731
        _uniform(12), _cluster(), _train(epochs=10, frozen=None, alpha=1 / 3, min_active=m), VARIANTS["freeze_only"])]
    assert frozen(0) == [0, 4, 7, 9, 10, 11, 11, 12, 12, 12]
    assert frozen(1) == [0, 4, 7, 9, 10, 11, 11, 11, 11, 11]  # AutoFreeze's default min_active=1


# ----------------------------------------------------------------------------- monotonicity


@settings(max_examples=40, deadline=None)
@given(
    intra=st.floats(1e9, 1e11), inter=st.floats(1e8, 1e10), factor=st.floats(1.0, 10.0),
    k=st.sampled_from([1, 2, 4]), m=st.integers(1, 8), nodes=st.integers(1, 3),
)
def test_more_bandwidth_never_slows_a_step(intra, inter, factor, k, m, nodes) -> None:
    model = _uniform(n=8)
    train = _train(pipe_len=k, micro_batches=m)
    kw = dict(frozen=2, pipe_len=k, micro_batches=m, replicas=nodes * 8 // k)
    slow = pipeline_step_time(model, _cluster(nodes, 8, intra_node_bw=intra, inter_node_bw=inter), train, **kw)
    fast_intra = pipeline_step_time(model, _cluster(nodes, 8, intra_node_bw=intra * factor, inter_node_bw=inter), train, **kw)
    fast_inter = pipeline_step_time(model, _cluster(nodes, 8, intra_node_bw=intra, inter_node_bw=inter * factor), train, **kw)
    assert fast_intra.step_s <= slow.step_s * (1 + 1e-12)
    assert fast_inter.step_s <= slow.step_s * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(f=st.integers(0, 11), extra=st.integers(1, 12), k=st.sampled_from([1, 2, 4, 8]), m=st.integers(1, 16))
def test_freezing_more_never_slows_the_compute(f, extra, k, m) -> None:
    g = min(f + extra, 12)
    model = _uniform(n=12)
    train = _train(pipe_len=k, micro_batches=m)
    # Fixed partition (no AutoPipe): freezing only removes backward work and gradient copies.
    balance = optimal_partition([1.0] * 12, k)
    kw = dict(pipe_len=k, micro_batches=m, replicas=1, fixed_balance=balance)
    less = pipeline_step_time(model, _cluster(), train, frozen=f, **kw)
    more = pipeline_step_time(model, _cluster(), train, frozen=g, **kw)
    assert more.step_s <= less.step_s * (1 + 1e-12)


def test_freeze_only_never_slower_than_baseline_without_transition_cost() -> None:
    p = get_preset("paper-vit-b16-imagenet")
    r = simulate(p.model, p.cluster, replace(p.train, transition_s=0.0))
    assert r.variants["freeze_only"].speedup >= 1.0


# ----------------------------------------------------------------------------- bad input


def test_inconsistent_device_counts() -> None:
    with pytest.raises(ValueError, match="must divide gpus_per_node"):
        simulate(_uniform(), _cluster(gpus=8), _train(pipe_len=3))
    with pytest.raises(ValueError, match="at least 1 node"):
        Cluster(nodes=0, gpus_per_node=8, intra_node_bw=1e9, inter_node_bw=1e9)


def test_schedule_longer_than_the_run() -> None:
    with pytest.raises(ValueError, match="only 3 epochs"):
        _train(epochs=3, frozen=(0, 1, 2, 3))


def test_schedule_checked_like_autofreeze() -> None:
    # AutoFreeze's checks: 0 < alpha < 1, no more than L - min_active frozen, never decreasing.
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        _train(frozen=None, alpha=0.0)
    with pytest.raises(ValueError, match="outside 0..7"):
        simulate(_uniform(8), _cluster(), _train(frozen=(0, 4, 8)))
    assert [e.frozen for e in simulate_variant(_uniform(8), _cluster(), _train(frozen=(0, 4, 8), min_active=0),
                                               VARIANTS["freeze_only"])] == [0, 4, 8]
    with pytest.raises(ValueError, match="decreases"):
        simulate(_uniform(8), _cluster(), _train(frozen=(0, 4, 2)))


def test_missing_costs_and_schedule() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        ModelCost(())
    with pytest.raises(ValueError, match="forward_s"):
        BlockCost(float("nan"), 0, 0, 0)
    with pytest.raises(ValueError, match="No freeze schedule"):
        simulate(_uniform(), _cluster(), _train(frozen=None))
    with pytest.raises(ValueError, match="no entry for pipeline length"):
        simulate(_uniform(), _cluster(), _train(pipe_len=8, micro_batches={4: 2}, frozen=(0, 4, 6)))


# ----------------------------------------------------------------------------- the trainer's rules


def _autofreeze_schedule(num_blocks: int, alpha: float, min_active: int, epochs: int) -> list[int]:
    """What AutoFreeze(rule="schedule") decides at the start of each epoch."""
    cb = AutoFreeze(alpha=alpha, rule="schedule", min_active=min_active)
    cb.stack = BlockStack("blocks", nn.ModuleList(nn.Identity() for _ in range(num_blocks)))
    out = []
    for epoch in range(epochs):
        index = cb._epoch_index(epoch)
        if index is not None:
            cb.num_frozen = cb._decide(index, epoch)
        out.append(cb.num_frozen)
    return out


@settings(max_examples=60, deadline=None)
@given(
    costs=st.lists(st.floats(0.05, 10.0), min_size=2, max_size=16),
    pre=st.floats(0.0, 5.0),
    post=st.floats(0.0, 5.0),
    g=st.sampled_from([1, 2, 4, 6, 8]),
    k0=st.sampled_from([1, 2, 3, 4, 8]),
    alpha=st.sampled_from([0.2, 1 / 3, 0.5, 0.9]),
    min_active=st.integers(0, 2),
    frozen_cost=st.sampled_from([0.0, 1 / 6, 0.5, 1.0]),
)
# Everything frozen: the head still weighs in full (AutoPipe's post_cost is never weighted), so K
# stops at 2 here; weighting it with the last block would give K = 1.
@example(costs=[1.0] * 12, pre=0.0, post=5.0, g=8, k0=8, alpha=0.9, min_active=0, frozen_cost=1 / 6)
def test_simulator_plans_like_autopipe_and_autofreeze(costs, pre, post, g, k0, alpha, min_active, frozen_cost) -> None:
    """Without a cache, every epoch's F is AutoFreeze's and (K, partition, replicas) AutoPipe's."""
    assume(g % k0 == 0 and k0 <= len(costs) and min_active <= len(costs))
    blocks = tuple(BlockCost(c / 3, 2 * c / 3, 1e3, 1e3) for c in costs)
    model = ModelCost(blocks, BlockCost(pre / 3, 2 * pre / 3, 1e3, 1e3), BlockCost(post / 3, 2 * post / 3, 0, 1e3))
    epochs = 8
    train = _train(epochs=epochs, pipe_len=k0, frozen=None, alpha=alpha, min_active=min_active,
                   frozen_cost=frozen_cost, partition="optimal", partition_by="time", frozen_placement="pipelined")
    plans = simulate_variant(model, _cluster(gpus=g), train, VARIANTS["autopipe_autodp"])

    assert [e.frozen for e in plans] == _autofreeze_schedule(len(costs), alpha, min_active, epochs)
    planner = AutoPipe(
        [b.forward_s + b.backward_s for b in blocks], devices_per_node=g, pipe_len=k0, frozen_cost=frozen_cost,
        pre_cost=model.embedding.forward_s + model.embedding.backward_s,
        post_cost=model.head.forward_s + model.head.backward_s,
    )
    for e in plans:
        plan = planner.plan(e.frozen)
        assert (e.pipe_len, e.balance, e.replicas) == (plan.pipe_len, plan.partition, len(plan.active_ranks)), e.epoch


@pytest.mark.parametrize("g", [6, 8, 12])
def test_pipeline_never_longer_than_what_it_holds(g: int) -> None:
    """Frozen blocks outside the pipeline: K fits the active blocks by AutoPipe.plan's rule (the
    largest divisor of G not above K and the block count), then halves as compress_pipe_len says."""
    train = _train(epochs=3, pipe_len=g, frozen=(0, 10, 11), frozen_placement="serial", partition="optimal")
    plans = simulate_variant(_uniform(12), _cluster(gpus=g), train, VARIANTS["autopipe_autodp"])
    for e in plans:
        assert e.pipe_len <= 12 - e.frozen and len(e.balance) == e.pipe_len and e.replicas == g // e.pipe_len


def test_paper_greedy_is_partition_paper_greedy() -> None:
    """partition="paper-greedy" is the planner module's greedy, empty stage included."""
    model = ModelCost(tuple(BlockCost(c, 0.0, 1e3, 0.0) for c in (4.0, 1.0, 1.0, 1.0, 1.0)))
    train = _train(pipe_len=3, partition="paper-greedy", partition_by="time", frozen=(0, 0, 0))
    plans = simulate_variant(model, _cluster(gpus=3), train, VARIANTS["autopipe_autodp"])
    assert plans[0].balance == paper_greedy_partition([4.0, 1.0, 1.0, 1.0, 1.0], 3) == (0, 1, 4)
    assert plans[0].step_s > 0


def test_paper_preset_runs_the_papers_greedy() -> None:
    """The paper preset partitions with partition.paper_greedy_partition (in millions of fp32
    parameters, the official code's unit) and compresses with partition.compress_pipe_len."""
    p = get_preset("paper-vit-b16-imagenet")
    m = p.model
    plans = simulate_variant(m, p.cluster, p.train, VARIANTS["autopipe_autodp"])
    assert [e.frozen for e in plans] == [0, 4, 7, 9, 10, 11, 11, 12, 12, 12]  # min_active=0, as the paper's code
    assert [e.pipe_len for e in plans] == [8, 4, 4, 2, 1, 1, 1, 1, 1, 1]

    def params(first: int) -> list[float]:  # frozen blocks run before the pipeline ("serial")
        out = [b.param_bytes / 4e6 for b in m.blocks[first:]]
        if out:
            out[0] += m.embedding.param_bytes / 4e6 if first == 0 else 0.0
            out[-1] += m.head.param_bytes / 4e6
        return out

    start = params(0)
    assert plans[0].balance == paper_greedy_partition(start, 8) == (1, 1, 1, 1, 2, 2, 2, 2)
    # In bytes the greedy's threshold (mean + variance) would put every block on stage 0.
    assert paper_greedy_partition([c * 4e6 for c in start], 8) == (12, 0, 0, 0, 0, 0, 0, 0)
    edges = [0, 1, 2, 3, 4, 6, 8, 10, 12]
    budget = max(sum(start[a:b]) for a, b in zip(edges[:-1], edges[1:]))
    k = 8
    for e in plans[1:]:
        active = params(e.frozen)
        if not active:
            assert (e.pipe_len, e.balance) == (1, ())
            continue
        k = max(d for d in range(1, len(active) + 1) if 8 % d == 0 and d <= k)
        k = compress_pipe_len(active, k, 8, budget, partition=lambda c, n, a=active: paper_greedy_partition(a, n))
        assert (e.pipe_len, e.balance) == (k, paper_greedy_partition(active, k)), e.epoch


# ----------------------------------------------------------------------------- the CLI


def test_cli_json_subprocess() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lightning_pipetransformer.costmodel", "--preset", "paper-vit-b16-imagenet", "--json"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    data = json.loads(out.stdout)
    assert set(data["variants"]) == {"baseline", "freeze_only", "autopipe_autocache", "autopipe_autodp", "all"}
    for v in data["variants"].values():
        assert isinstance(v["speedup"], float)
        assert len(v["epochs"]) == 10
    assert data["variants"]["baseline"]["speedup"] == 1.0


# ----------------------------------------------------------------------------- the paper


# Paper Fig. 9 (ViT-B/16, ImageNet, 2 x 8 RTX 5000). Rows the model reproduces within 15%; the
# other two are known misses, explained in docs/cost_model.md, pinned here so a change shows.
PAPER = {"freeze_only": 0.95, "autopipe_autocache": 1.26, "autopipe_autodp": 2.27, "all": 2.83}
MATCHED = ("autopipe_autocache", "all")
PINNED = {"freeze_only": 1.37, "autopipe_autodp": 2.82}


@pytest.fixture(scope="module")
def paper_report():
    p = get_preset("paper-vit-b16-imagenet")
    return simulate(p.model, p.cluster, p.train)


@pytest.mark.parametrize("row", MATCHED)
def test_paper_breakdown_within_15_percent(paper_report, row: str) -> None:
    predicted = paper_report.variants[row].speedup
    assert abs(predicted - PAPER[row]) / PAPER[row] <= 0.15, (row, predicted)


@pytest.mark.parametrize("row", sorted(PINNED))
def test_paper_breakdown_known_misses_are_pinned(paper_report, row: str) -> None:
    assert paper_report.variants[row].speedup == pytest.approx(PINNED[row], abs=0.02)


def test_paper_breakdown_shape(paper_report) -> None:
    s = {n: v.speedup for n, v in paper_report.variants.items()}
    assert s["all"] > s["autopipe_autodp"] > s["autopipe_autocache"] > 1.0
    # AutoCache's gain is amplified by AutoDP (paper takeaway 2).
    assert s["all"] - s["autopipe_autodp"] > s["autopipe_autocache"] - 1.0 - 0.1


def test_paper_microbatch_profile_peaks_at_two_k() -> None:
    """Fig. 11: at K=8 throughput peaks at 'M=2' (in units of K: 16 micro-batches)."""
    p = get_preset("paper-vit-b16-imagenet")
    prof = microbatch_profile(p.model, p.cluster, p.train, 8, [8 * x for x in range(1, 7)])
    assert max(prof, key=prof.get) == 16
    paper = {8: 368, 16: 410, 24: 386, 32: 340, 40: 298, 48: 286}
    for m, v in paper.items():
        assert abs(prof[m] - v) / v <= 0.10
