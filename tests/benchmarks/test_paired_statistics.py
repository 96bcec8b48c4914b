"""The paired statistics of the 12-layer setting (issue 34) on made-up records: per-seed differences,
t-intervals, the plateau target, time-to-accuracy ratios and the frontier."""

from __future__ import annotations

import math
import statistics

import pytest

from benchmarks.time_to_accuracy.paired import (
    best_by_time,
    frontier,
    frontier_lead,
    geometric_interval,
    mean_interval,
    paired_row,
    plateau,
    plateau_target,
    t_critical,
)
from benchmarks.time_to_accuracy.variants import RunRecord


def run(variant: str, seed: int, checks: list[tuple[float, float]], final: float, error: str | None = None) -> RunRecord:
    epochs = [{"train_s": checks[-1][0], "epoch_s": checks[-1][0] + 1.0, "metric": checks[-1][1]}]
    return RunRecord(
        variant=variant, seed=seed, epochs=epochs, error=error, final_full_acc=final,
        checks=[{"step": 10 * (i + 1), "train_s": t, "acc": a} for i, (t, a) in enumerate(checks)],
    )  # fmt: skip


def test_t_critical_values_and_the_interval_by_hand():
    assert t_critical(2) == pytest.approx(4.303) and t_critical(4) == pytest.approx(2.776)
    assert t_critical(60) == pytest.approx(2.000, abs=0.003) and t_critical(120) == pytest.approx(1.980, abs=0.003)
    with pytest.raises(ValueError, match="2 seeds"):
        t_critical(0)
    values = [-0.2, 0.4, 0.1]
    got = mean_interval(values)
    half = 4.303 * statistics.stdev(values) / math.sqrt(3)  # the textbook formula, df = 2
    assert got.mean == pytest.approx(0.1) and got.low == pytest.approx(0.1 - half) and got.high == pytest.approx(0.1 + half)
    one = mean_interval([0.5])
    assert one.mean == 0.5 and math.isnan(one.low) and "no interval" in one.text()


def test_geometric_interval_is_symmetric_in_log_space():
    got = geometric_interval([2.0, 2.0, 2.0])
    assert got.mean == pytest.approx(2.0) and got.low == pytest.approx(2.0) and got.high == pytest.approx(2.0)
    spread = geometric_interval([1.0, 4.0])  # geometric mean 2, not the arithmetic 2.5
    assert spread.mean == pytest.approx(2.0)
    assert spread.low * spread.high == pytest.approx(4.0)  # symmetric around log 2
    with pytest.raises(ValueError):
        geometric_interval([1.0, 0.0])


def test_pairing_cancels_what_the_seeds_share():
    # Seeds differ by 2 points overall; the row is always 0.5 below its own seed's baseline.
    base = [run("full fine-tuning", s, [(10.0, 0.80), (100.0, 0.80 + s / 50)], final=0.80 + s / 50) for s in range(3)]
    row = [run("fast", s, [(5.0, 0.79), (40.0, 0.795 + s / 50)], final=0.795 + s / 50) for s in range(3)]
    got = paired_row(base + row, "fast", target=None)
    assert got.seeds == (0, 1, 2)
    assert got.acc_diff == pytest.approx((-0.5, -0.5, -0.5))
    assert got.acc.low == pytest.approx(-0.5) and got.acc.high == pytest.approx(-0.5)  # paired: no spread left
    unpaired_sd = statistics.stdev(100 * r.final_acc for r in row)  # what a mean +- sd table would show
    assert unpaired_sd > 1.9
    assert got.speedup == pytest.approx((2.5, 2.5, 2.5)) and got.speed.mean == pytest.approx(2.5)
    assert math.isnan(got.tta.mean)  # no target, no time to accuracy


def test_only_seeds_both_ran_without_error_are_paired():
    base = [run("full fine-tuning", s, [(10.0, 0.8)], final=0.8) for s in range(3)]
    row = [run("x", 0, [(5.0, 0.8)], final=0.81), run("x", 1, [(5.0, 0.8)], final=0.0, error="boom"), run("x", 3, [(5.0, 0.8)], final=0.8)]
    got = paired_row(base + row, "x", target=None)
    assert got.seeds == (0,) and got.acc_diff == pytest.approx((1.0,)) and math.isnan(got.acc.low)


def test_plateau_is_the_mean_of_the_second_half_and_the_target_drops_from_it():
    r = run("full fine-tuning", 0, [(10.0, 0.70), (20.0, 0.80), (30.0, 0.83), (40.0, 0.81)], final=0.82)
    assert plateau(r) == pytest.approx((0.80 + 0.83 + 0.81) / 3)  # steps 20, 30, 40 of 40: the second half
    other = run("full fine-tuning", 1, [(10.0, 0.70), (20.0, 0.78), (30.0, 0.80), (40.0, 0.82)], final=0.8)
    assert plateau_target([r, other], drop_points=0.3) == pytest.approx(((0.8133333 + 0.8) / 2) - 0.003, abs=1e-6)
    assert plateau_target([], 0.3) is None


def test_time_to_accuracy_speedup_per_seed():
    base = [run("full fine-tuning", s, [(10.0, 0.70), (40.0, 0.80), (80.0, 0.81)], final=0.81) for s in range(2)]
    row = [run("fast", 0, [(10.0, 0.80), (20.0, 0.81)], final=0.8), run("fast", 1, [(20.0, 0.80)], final=0.8)]
    got = paired_row(base + row, "fast", target=0.80)
    assert got.tta_speedup == pytest.approx((4.0, 2.0))
    assert got.tta.mean == pytest.approx(math.sqrt(8.0))
    never = paired_row(base + [run("slow", 0, [(10.0, 0.5)], final=0.5)], "slow", target=0.80)
    assert never.tta_speedup == (None,) and math.isnan(never.tta.mean)


def test_the_frontier_keeps_the_best_so_far_and_a_finished_run_keeps_its_best():
    r = run("x", 0, [(10.0, 0.70), (20.0, 0.80), (30.0, 0.75)], final=0.75)
    assert best_by_time(r, [5.0, 10.0, 25.0, 30.0, 100.0])[1:] == [0.70, 0.80, 0.80, 0.80]
    assert math.isnan(best_by_time(r, [5.0])[0])
    two = [r, run("x", 1, [(15.0, 0.60), (20.0, 0.90)], final=0.9)]
    got = frontier(two, "x", [10.0, 20.0])
    assert math.isnan(got[0]) and got[1] == pytest.approx(0.85)  # seed 1 had no check at 10 s


def test_frontier_lead_names_the_worst_shortfall():
    times = [10.0, 20.0, 30.0, 40.0]
    ours = [0.80, 0.82, 0.83, 0.83]
    peers = {"LoRA": [0.70, 0.83, 0.82, 0.82], "EarlyStopping": [math.nan, 0.80, 0.835, 0.80]}
    share, worst, where = frontier_lead(ours, peers, times)
    assert share == pytest.approx(2 / 4)
    assert worst == pytest.approx(1.0) and where == "LoRA at 20 s"
    assert frontier_lead([0.9] * 4, peers, times)[1:] == (None, None)


def test_the_goal_per_row_needs_speed_accuracy_time_to_accuracy_and_the_frontier():
    from benchmarks.time_to_accuracy.paired_report import frontier_curves, frontier_times, paired_goal_text, paired_rows, paired_table
    from benchmarks.time_to_accuracy.variants import Variant

    full, ours, lora = Variant("full"), Variant("cache", 1 / 3, "1/3"), Variant("lora", detail="r=8")
    records = []
    for s, d in enumerate((-0.10, -0.20, -0.15)):
        records.append(run(full.name, s, [(25.0, 0.70), (50.0, 0.80), (75.0, 0.85), (100.0, 0.85)], final=0.85))
        records.append(run(ours.name, s, [(10.0, 0.80), (20.0, 0.85), (40.0, 0.85)], final=0.85 + d / 100))
        records.append(run(lora.name, s, [(30.0, 0.60), (60.0, 0.70), (90.0, 0.75)], final=0.75))
    target = plateau_target([r for r in records if r.variant == full.name], 0.3)
    rows = paired_rows(records, [full.name, ours.name, lora.name], target)
    assert [r.variant for r in rows] == [ours.name, lora.name]  # the baseline is not paired with itself
    times = frontier_times(records, points=11)
    curves = frontier_curves(records, [full, ours, lora], times)
    text = paired_goal_text(rows, [full, ours, lora], curves, times)
    assert "**The goal is met**" in text
    assert f"**{ours.name}**: **met**" in text and "resolved: the whole interval is above -0.3" in text
    assert "ahead of every peer at every time" in text
    assert lora.name not in text.split("\n\n", 2)[-1]  # the goal is for rows of ours only
    assert "| freeze+cache a=1/3 | 0,1,2 | -0.10, -0.20, -0.15 |" in paired_table(rows)
    # The same row, one point worse on one seed: no longer resolved, and not met.
    worse = [r if not (r.variant == ours.name and r.seed == 1) else run(ours.name, 1, [(10.0, 0.80), (20.0, 0.85), (40.0, 0.85)], final=0.84)
             for r in records]  # fmt: skip
    text = paired_goal_text(paired_rows(worse, [full.name, ours.name], target), [full, ours, lora], curves, times)
    assert "**The goal is not met**" in text and "not resolved by 3 seeds" in text
