"""Statistics that pair every row with full fine-tuning on the same seed (issue 34).

Every row of a seed trains on the same data, in the same order, from the same head initialisation as
the baseline of that seed, so the seed-to-seed spread that both share (which batch order, which head)
cancels in the per-seed difference. Reported per row:

- the per-seed difference of final accuracy (points) and a 95% t-interval of its mean;
- the per-seed training speed-up (baseline seconds / row seconds) and a 95% interval of its geometric
  mean (a t-interval of the mean log ratio, exponentiated: ratios multiply, and 2x faster and 2x slower
  should be symmetric);
- the per-seed time-to-accuracy speed-up against a target derived from the baseline's plateau
  (:func:`plateau_target`), with the same kind of interval when every seed reached it;
- the frontier: for each row, the best validation accuracy reached by training time ``t`` (mean over
  seeds), and where a row of ours falls behind the best peer on it (:func:`frontier_lead`).

Pure functions on :class:`~.variants.RunRecord` lists: no training, unit-testable on made-up records.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from .variants import RunRecord

__all__ = [
    "BASELINE", "Interval", "PairedRow", "best_by_time", "frontier", "frontier_lead", "geometric_interval",
    "mean_interval", "paired_row", "plateau", "plateau_target", "t_critical",
]  # fmt: skip

BASELINE = "full fine-tuning"

#: Two-sided 95% critical values of Student's t by degrees of freedom (standard tables).
_T95 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
    11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086,
    21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042,
}  # fmt: skip


def t_critical(df: int) -> float:
    """The two-sided 95% critical value of Student's t with ``df`` degrees of freedom (``df >= 1``).

    Tabulated up to 30; beyond, ``1.96 + 2.4 / df`` (within 0.003 of the exact value from 30 on).
    """
    if df < 1:
        raise ValueError(f"a t-interval needs at least 1 degree of freedom (2 seeds), got df={df}.")
    return _T95[df] if df in _T95 else 1.96 + 2.4 / df


@dataclass(frozen=True)
class Interval:
    """A mean and its 95% interval; ``low``/``high`` are NaN with one value (one seed measures no spread)."""

    mean: float
    low: float
    high: float
    n: int

    def text(self, digits: int = 2, unit: str = "", signed: bool = False) -> str:
        sign = "+" if signed else ""
        if math.isnan(self.mean):
            return "-"
        if math.isnan(self.low):
            return f"{self.mean:{sign}.{digits}f}{unit} (1 seed: no interval)"
        return f"{self.mean:{sign}.{digits}f}{unit} [{self.low:{sign}.{digits}f}, {self.high:{sign}.{digits}f}]"


def mean_interval(values: Sequence[float]) -> Interval:
    """The mean of ``values`` and its 95% t-interval (``mean ± t * sd / sqrt(n)``)."""
    n = len(values)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    mean = statistics.fmean(values)
    if n == 1:
        return Interval(mean, math.nan, math.nan, 1)
    half = t_critical(n - 1) * statistics.stdev(values) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def geometric_interval(ratios: Sequence[float]) -> Interval:
    """The geometric mean of positive ``ratios`` and its 95% interval (a t-interval of the logs, exponentiated)."""
    if any(r <= 0 or math.isnan(r) for r in ratios):
        raise ValueError(f"ratios must be positive numbers, got {list(ratios)}.")
    logs = mean_interval([math.log(r) for r in ratios])
    return Interval(math.exp(logs.mean) if logs.n else math.nan, math.exp(logs.low), math.exp(logs.high), logs.n)


def plateau(record: RunRecord, share: float = 0.5) -> float | None:
    """The accuracy a run holds once it has plateaued: the mean of its checks in the last ``share`` of its
    optimizer steps (the end-of-training point included). One check moves by 1-2 points from the next on
    1,000 snippets; a mean over the second half's checks does not."""
    if not record.checks:
        points = record.points
        return statistics.fmean(a for _, a in points[-max(1, round(share * len(points))) :]) if points else None
    last = max(c["step"] for c in record.checks)
    tail = [c["acc"] for c in record.checks if c["acc"] is not None and c["step"] >= (1 - share) * last]
    return statistics.fmean(tail) if tail else None


def plateau_target(baseline: Sequence[RunRecord], drop_points: float, share: float = 0.5) -> float | None:
    """The time-to-accuracy target: the baseline's plateau (mean over seeds of :func:`plateau`), minus
    ``drop_points`` points. On what the checks measure (the fixed validation subset)."""
    values = [p for p in (plateau(r, share) for r in baseline if r.error is None) if p is not None]
    return statistics.fmean(values) - drop_points / 100 if values else None


@dataclass(frozen=True)
class PairedRow:
    """One row against the baseline of the same seeds."""

    variant: str
    seeds: tuple[int, ...]
    acc_diff: tuple[float, ...]  # points, row - baseline, per seed
    speedup: tuple[float, ...]  # baseline train_s / row train_s, per seed
    tta_speedup: tuple[float | None, ...]  # baseline TTA / row TTA per seed; None: one of them never reached it
    acc: Interval
    speed: Interval
    tta: Interval  # NaN unless every seed's row and baseline reached the target


def _by_seed(records: Sequence[RunRecord], variant: str) -> dict[int, RunRecord]:
    return {r.seed: r for r in records if r.variant == variant and r.error is None and r.epochs and r.final_acc is not None}


def paired_row(records: Sequence[RunRecord], variant: str, target: float | None, baseline: str = BASELINE) -> PairedRow:
    """Pair ``variant``'s runs with the baseline's on the seeds both ran without error."""
    base, row = _by_seed(records, baseline), _by_seed(records, variant)
    seeds = tuple(sorted(set(base) & set(row)))
    diff = tuple(100 * (row[s].final_acc - base[s].final_acc) for s in seeds)  # type: ignore[operator]
    speed = tuple(base[s].train_s / row[s].train_s for s in seeds if row[s].train_s > 0)
    tta: list[float | None] = []
    for s in seeds:
        b, r = (base[s].time_to(target), row[s].time_to(target)) if target is not None else (None, None)
        tta.append(b / r if b is not None and r is not None and r > 0 else None)
    reached = [t for t in tta if t is not None]
    tta_interval = geometric_interval(reached) if reached and len(reached) == len(seeds) else Interval(math.nan, math.nan, math.nan, len(reached))
    speed_interval = geometric_interval(speed) if speed else Interval(math.nan, math.nan, math.nan, 0)
    return PairedRow(variant, seeds, diff, speed, tuple(tta), mean_interval(diff), speed_interval, tta_interval)


def best_by_time(record: RunRecord, times: Sequence[float]) -> list[float]:
    """The best check accuracy ``record`` reached by each training time (NaN before its first check). A run
    that ended keeps its best: what a user stopping at ``t`` could have had."""
    points = sorted(record.points)
    out, best, i = [], math.nan, 0
    for t in times:
        while i < len(points) and points[i][0] <= t:
            best = points[i][1] if math.isnan(best) else max(best, points[i][1])
            i += 1
        out.append(best)
    return out


def frontier(records: Sequence[RunRecord], variant: str, times: Sequence[float]) -> list[float]:
    """Mean over seeds of :func:`best_by_time`; NaN at a time where a seed has no check yet."""
    runs = [r for r in records if r.variant == variant and r.error is None and r.points]
    if not runs:
        return [math.nan] * len(times)
    curves = [best_by_time(r, times) for r in runs]
    return [math.nan if any(math.isnan(c[i]) for c in curves) else statistics.fmean(c[i] for c in curves) for i in range(len(times))]


def frontier_lead(ours: Sequence[float], peers: dict[str, Sequence[float]], times: Sequence[float]) -> tuple[float, float | None, str | None]:
    """Where a row of ours stands against the best peer at each time on the frontier.

    Counted over the times where both ours and some peer have a value. Returns the share of those times
    at which ours is at or above every peer, the largest shortfall in points (``None`` if never behind),
    and the peer and time of that shortfall as text.
    """
    ahead = total = 0
    worst, where = 0.0, None
    for i, t in enumerate(times):
        values = {name: curve[i] for name, curve in peers.items() if not math.isnan(curve[i])}
        if math.isnan(ours[i]) or not values:
            continue
        total += 1
        name, best = max(values.items(), key=lambda kv: kv[1])
        if ours[i] >= best:
            ahead += 1
        elif 100 * (best - ours[i]) > worst:
            worst, where = 100 * (best - ours[i]), f"{name} at {t:.0f} s"
    return (ahead / total if total else math.nan), (worst if where else None), where
