"""Cost model: closed forms it must get exactly, monotonicity, bad input, the CLI, the paper."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipetransformer.costmodel.model import (
    BlockCost,
    Cluster,
    ModelCost,
    VARIANTS,
    Training,
    bubble_fraction,
    flow_shop_time,
    geometric_freeze_schedule,
    greedy_partition,
    pipeline_step_time,
    ring_allreduce_time,
)
from lightning_pipetransformer.costmodel.presets import get_preset
from lightning_pipetransformer.costmodel.simulator import microbatch_profile, simulate

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
    assert geometric_freeze_schedule(12, 1 / 3, 10) == (0, 4, 7, 9, 10, 11, 11, 12, 12, 12)
    assert greedy_partition([1.0] * 12, 8) == (1, 1, 1, 1, 2, 2, 2, 2)


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
    balance = greedy_partition([1.0] * 12, k)
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


def test_missing_costs_and_schedule() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        ModelCost(())
    with pytest.raises(ValueError, match="forward_s"):
        BlockCost(float("nan"), 0, 0, 0)
    with pytest.raises(ValueError, match="No freeze schedule"):
        simulate(_uniform(), _cluster(), _train(frozen=None))
    with pytest.raises(ValueError, match="no entry for pipeline length"):
        simulate(_uniform(), _cluster(), _train(pipe_len=8, micro_batches={4: 2}, frozen=(0, 4, 6)))


# ----------------------------------------------------------------------------- the CLI


def test_cli_json_subprocess() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lightning_pipetransformer.plan", "--preset", "paper-vit-b16-imagenet", "--json"],
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
