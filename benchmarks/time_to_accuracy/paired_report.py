"""The paired section of the report (issue 34): per-seed differences against full fine-tuning, their 95%
intervals, time to accuracy against the baseline's plateau, the frontier and the goal read from them."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .paired import BASELINE, PairedRow, frontier, frontier_lead, paired_row
from .summary import GOAL_DROP, GOAL_SPEEDUP
from .variants import RunRecord, Variant

__all__ = ["frontier_curves", "frontier_times", "paired_goal_text", "paired_rows", "paired_table"]


def paired_rows(records: Sequence[RunRecord], names: Sequence[str], target: float | None) -> list[PairedRow]:
    """One :class:`PairedRow` per row name other than the baseline's (rows with no paired seed left out)."""
    rows = [paired_row(records, n, target) for n in names if n != BASELINE]
    return [r for r in rows if r.seeds]


def _per_seed(values: Sequence[float | None], digits: int, signed: bool = False, unit: str = "") -> str:
    sign = "+" if signed else ""
    return ", ".join("-" if v is None else f"{v:{sign}.{digits}f}{unit}" for v in values)


def paired_table(rows: Sequence[PairedRow]) -> str:
    """The markdown table: per-seed values and the mean with its 95% interval, for accuracy, speed and TTA."""
    head = ["variant", "seeds", "final acc - baseline, per seed (pt)", "mean [95% CI] (pt)", "train speed-up, per seed",
            "geo-mean [95% CI]", "TTA speed-up, per seed", "geo-mean [95% CI]"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r.variant, ",".join(map(str, r.seeds)), _per_seed(r.acc_diff, 2, signed=True), r.acc.text(2, signed=True),
            _per_seed(r.speedup, 2, unit="x"), r.speed.text(2, unit="x"), _per_seed(r.tta_speedup, 2, unit="x"),
            r.tta.text(2, unit="x") if not math.isnan(r.tta.mean) else f"not reached by every seed ({r.tta.n}/{len(r.seeds)})",
        ]) + " |")  # fmt: skip
    return "\n".join(lines)


def frontier_times(records: Sequence[RunRecord], points: int = 200) -> list[float]:
    """An even grid from 0 to the longest run's training time."""
    end = max((r.train_s for r in records if r.error is None and r.epochs), default=0.0)
    return [end * i / (points - 1) for i in range(points)] if end > 0 else []


def frontier_curves(records: Sequence[RunRecord], variants: Sequence[Variant], times: Sequence[float]) -> dict[str, list[float]]:
    return {v.name: frontier(records, v.name, times) for v in variants}


def paired_goal_text(
    rows: Sequence[PairedRow], variants: Sequence[Variant], curves: dict[str, list[float]], times: Sequence[float]
) -> str:
    """The goal read from the paired statistics, per row of ours: speed, accuracy, time to accuracy and the
    frontier against every peer row (the baseline, EarlyStopping, LoRA, BaseFinetuning), and whether 3
    seeds resolve the accuracy part (the interval clear of the -0.3-point line)."""
    ours = {v.name for v in variants if v.ours}
    peers = {v.name: curves[v.name] for v in variants if not v.ours and v.kind != "llrd" and v.name in curves}
    lines = [f"Goal (issue 34), per row of ours: training speed-up >= {GOAL_SPEEDUP:g}x, mean final accuracy no more than "
             f"{GOAL_DROP:g} points below full fine-tuning's (paired by seed), time to accuracy >= {GOAL_SPEEDUP:g}x shorter, "
             "and at or above every peer row at every time on the frontier.", ""]  # fmt: skip
    met_any = False
    for r in rows:
        if r.variant not in ours:
            continue
        fast = r.speed.mean >= GOAL_SPEEDUP
        accurate = r.acc.mean >= -GOAL_DROP
        tta = not math.isnan(r.tta.mean) and r.tta.mean >= GOAL_SPEEDUP
        share, worst, where = frontier_lead(curves.get(r.variant, []), peers, times) if peers and times else (math.nan, None, None)
        ahead = share == 1.0
        met = fast and accurate and tta and ahead
        met_any |= met
        if math.isnan(r.acc.low):
            resolved = "one seed: no interval"
        elif r.acc.low >= -GOAL_DROP:
            resolved = f"resolved: the whole interval is above -{GOAL_DROP:g}"
        elif r.acc.high < -GOAL_DROP:
            resolved = f"resolved: the whole interval is below -{GOAL_DROP:g}"
        else:
            resolved = f"not resolved by {len(r.seeds)} seeds: the interval spans -{GOAL_DROP:g}"
        frontier_part = (
            "no peer to compare" if math.isnan(share)
            else "ahead of every peer at every time" if ahead
            else f"at or above every peer at {100 * share:.0f}% of the times; furthest behind by {worst:.2f} pt ({where})"
        )  # fmt: skip
        lines.append(
            f"- **{r.variant}**: {'**met**' if met else 'not met'}. Speed-up {r.speed.text(2, unit='x')} "
            f"({'>=' if fast else '<'} {GOAL_SPEEDUP:g}x); accuracy {r.acc.text(2, signed=True)} pt "
            f"({'within' if accurate else 'beyond'} -{GOAL_DROP:g}; {resolved}); time to accuracy "
            + (r.tta.text(2, unit="x") if not math.isnan(r.tta.mean) else f"not reached by every seed ({r.tta.n}/{len(r.seeds)})")
            + f"; frontier: {frontier_part}."
        )
    lines.insert(1, f"\n**{'The goal is met' if met_any else 'The goal is not met'}** by "
                    f"{'at least one row of ours' if met_any else 'any row of ours'} on these records.")  # fmt: skip
    return "\n".join(lines)
