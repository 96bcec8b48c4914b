"""Issue 41's verdict, read from the paired statistics: the goal against every peer, which rows needed a hand-chosen
number, and, where the goal is not met, by how much and what bounds it.

The goal: a row of ours at a mean final accuracy no more than 0.3 points below full fine-tuning's (paired by seed)
that trains at least 2.0x faster than full fine-tuning AND at least 1.2x faster than every peer row within 0.3
points; and the automatic rule (no hand-chosen count) within 0.3 points at no less than the best peer's speed-up.
"Every peer row within 0.3 points" and "the best peer" are read among the peers that keep the accuracy (a peer
that loses more than 0.3 points, EarlyStopping on issue 34's records, is no competitor at equal accuracy); the
peers' rows are named, with their numbers, so that a reader can apply another reading.
Pure functions on records and :class:`~.paired.PairedRow`: tested on made-up records.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from .paired import BASELINE, PairedRow
from .summary import GOAL_DROP, GOAL_SPEEDUP
from .variants import RunRecord, Variant

__all__ = ["AHEAD_OF_PEERS", "Verdict", "issue41_verdict", "verdict_text"]

#: A row of ours must train at least this much faster than every peer row within 0.3 points.
AHEAD_OF_PEERS = 1.2


@dataclass(frozen=True)
class Verdict:
    """The goal read from the paired rows. ``need``: the speed-up a row of ours must reach (2.0x, or 1.2x the fastest
    peer within 0.3 points if that is more); ``winners``: rows of ours that meet part 1; ``auto_met``: part 2."""

    need: float
    best_peer: PairedRow | None  # the fastest peer within 0.3 points
    winners: tuple[str, ...]
    auto: tuple[str, ...]  # the rows of ours without a hand-chosen number
    auto_met: bool

    @property
    def met(self) -> bool:
        return bool(self.winners) and self.auto_met


def _within(row: PairedRow) -> bool:
    """Mean accuracy no more than 0.3 points below full fine-tuning's (a rounding's worth of slack: -0.3 is within)."""
    return not math.isnan(row.acc.mean) and row.acc.mean >= -GOAL_DROP - 1e-9


def issue41_verdict(rows: Sequence[PairedRow], variants: Sequence[Variant]) -> Verdict:
    """Part 1 and part 2 of the goal on the paired means (see the module docstring)."""
    kind = {v.name: v for v in variants}
    ours = [r for r in rows if r.variant in kind and kind[r.variant].ours]
    peers = [r for r in rows if r.variant in kind and not kind[r.variant].ours and kind[r.variant].kind not in ("llrd", "full")]
    within = [r for r in peers if _within(r) and not math.isnan(r.speed.mean)]
    best = max(within, key=lambda r: r.speed.mean, default=None)
    need = max(GOAL_SPEEDUP, AHEAD_OF_PEERS * best.speed.mean) if best is not None else GOAL_SPEEDUP
    winners = tuple(r.variant for r in ours if _within(r) and r.speed.mean >= need)
    auto = tuple(r.variant for r in ours if kind[r.variant].hand_chosen is None)
    floor = best.speed.mean if best is not None else 1.0
    auto_met = any(_within(r) and r.speed.mean >= floor for r in ours if r.variant in auto)
    return Verdict(need, best, winners, auto, auto_met)


def _row_text(r: PairedRow, need: float) -> str:
    acc = f"{r.acc.text(2, signed=True)} pt"
    speed = f"{r.speed.text(2, unit='x')}"
    gaps = []
    if not _within(r):
        gaps.append(f"{-GOAL_DROP - r.acc.mean:.2f} pt short of -{GOAL_DROP:g}")
    if r.speed.mean < need:
        gaps.append(f"{need / r.speed.mean:.2f}x short of {need:.2f}x")
    side = "above" if r.acc.low >= -GOAL_DROP else "below" if r.acc.high < -GOAL_DROP else "across"
    resolved = "" if math.isnan(r.acc.low) else f"; the accuracy interval is {side} -{GOAL_DROP:g}"
    return f"accuracy {acc}, speed-up {speed}" + (f" ({'; '.join(gaps)})" if gaps else " (meets both)") + resolved


def bound_lines(records: Sequence[RunRecord], variants: Sequence[Variant]) -> list[str]:
    """What bounds each row of ours, from its records: for the cache rows, the training seconds of the first epoch
    (the prefix runs forward and is stored) against the later ones (served); the speed-up if every epoch cost what a
    served one did; for AutoFreeze's rule, when it first froze, how much it froze and the share of training before."""
    base = [r for r in records if r.variant == BASELINE and r.error is None and r.epochs]
    if not base:
        return []
    full = statistics.fmean(r.train_s for r in base)
    lines = []
    for v in (v for v in variants if v.ours):
        runs = [r for r in records if r.variant == v.name and r.error is None and len(r.epochs) > 1]
        if not runs:
            continue
        first = statistics.fmean(r.epochs[0]["train_s"] for r in runs)
        later = statistics.fmean(statistics.fmean(e["train_s"] for e in r.epochs[1:]) for r in runs)
        epochs = statistics.fmean(len(r.epochs) for r in runs)
        text = (f"- **{v.name}**: first epoch {first:.0f} s, later epochs {later:.0f} s each (mean); were every epoch "
                f"as cheap as a later one, {full / (later * epochs):.2f}x")  # fmt: skip
        froze = [r for r in runs if r.freezes]
        if v.kind in ("early", "cache") and froze:
            steps = [r.freezes[0][0] for r in froze]
            before = [r.frozen_s.get("0", 0.0) / r.train_s for r in froze if r.train_s > 0]
            last = [r.freezes[-1][1] for r in froze]
            text += (f"; first freeze at step {statistics.fmean(steps):.0f} (mean; {min(steps)}-{max(steps)}), "
                     f"{100 * statistics.fmean(before):.0f}% of the training time before it, {statistics.fmean(last):.1f} "
                     f"blocks frozen at the end ({min(last)}-{max(last)})")  # fmt: skip
            if len(froze) < len(runs):
                text += f"; {len(runs) - len(froze)} of {len(runs)} runs froze nothing"
        elif v.kind in ("early", "cache"):
            text += "; it froze nothing"
        lines.append(text + ".")
    return lines


def verdict_text(rows: Sequence[PairedRow], variants: Sequence[Variant], records: Sequence[RunRecord]) -> str:
    """The markdown of issue 41's verdict: the goal, which rows needed a hand-chosen number, each row's distance
    from the goal and what bounds it."""
    v = issue41_verdict(rows, variants)
    kind = {x.name: x for x in variants}
    by_name = {r.variant: r for r in rows}
    best = v.best_peer
    peer_text = (f"the fastest peer within {GOAL_DROP:g} points is **{best.variant}** at {best.speed.text(2, unit='x')}"
                 if best is not None else f"no peer row is within {GOAL_DROP:g} points")  # fmt: skip
    lines = [
        "### The goal (issue 41)",
        "",
        f"A row of ours at a mean final accuracy no more than {GOAL_DROP:g} points below full fine-tuning's (paired by seed) "
        f"that trains at least {GOAL_SPEEDUP:g}x faster than full fine-tuning and at least {AHEAD_OF_PEERS:g}x faster than "
        f"every peer row within {GOAL_DROP:g} points; and the automatic rule (no hand-chosen count) within {GOAL_DROP:g} points "
        f"at no less than the best peer's speed-up. On these records {peer_text}, so a row of ours needs **{v.need:.2f}x** "
        "(means over seeds; the intervals are in the table above).",
        "",
        f"**{'The goal is met' if v.met else 'The goal is not met'}.** Part 1 (a row of ours at {v.need:.2f}x within "
        f"{GOAL_DROP:g} points): " + (f"met by {', '.join(v.winners)}." if v.winners else "not met.")
        + " Part 2 (the automatic rule within " + f"{GOAL_DROP:g} points at >= "
        + (f"{v.best_peer.speed.mean:.2f}x" if v.best_peer is not None else "1x") + "): "
        + ("met." if v.auto_met else "not met." if v.auto else "no automatic row ran."),
        "",
        "| row | hand-chosen number | accuracy and speed against the goal |",
        "|---|---|---|",
    ]
    for name, variant in kind.items():
        if name == BASELINE or name not in by_name:
            continue
        who = "ours" if variant.ours else "peer"
        chosen = variant.hand_chosen or ("none (the automatic rule)" if variant.ours else "none")
        lines.append(f"| {name} ({who}) | {chosen} | {_row_text(by_name[name], v.need if variant.ours else GOAL_SPEEDUP)} |")
    bounds = bound_lines(records, variants)
    if bounds:
        lines += ["", "What bounds the rows of ours (training seconds per epoch from the records):", "", *bounds]
    return "\n".join(lines)
