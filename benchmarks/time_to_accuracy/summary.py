"""Aggregates over seeds: per-variant means, speed-ups, time to accuracy and the goal (issue 25)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from .variants import RunRecord, Variant

#: The goal of issue 25: at least this training speed-up over full fine-tuning (issues 8 and 17 asked 3x) ...
GOAL_SPEEDUP = 2.0
#: ... at a mean final accuracy no more than this many points below it (also the time-to-accuracy target).
GOAL_DROP = 0.3


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample sd; the sd is NaN for one value (one seed measures no spread, not a zero one)."""
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else math.nan)

def _mean_mb(values: Sequence[int | None]) -> float | None:
    """Mean of the known byte counts, in MB; ``None`` if none is known (a variant without a cache)."""
    known = [v for v in values if v is not None]
    return statistics.fmean(known) / 1e6 if known else None

def reference_of(variant: Variant, variants: Sequence[Variant], has_baseline: bool) -> Variant | None:
    """What a variant's speed-up is measured against: the full fine-tuning baseline when it ran;
    otherwise, for epoch-level freeze+cache, the freeze variant of the same alpha (the cache off vs on)."""
    if has_baseline:
        return Variant("full")
    if variant.kind == "cache" and not variant.sub_epoch:
        return next((v for v in variants if v.kind == "freeze" and not v.sub_epoch and v.alpha == variant.alpha), None)
    return None

def summarize(records: list[RunRecord], variants: list[Variant], target: float | None = None) -> tuple[list[dict[str, Any]], float | None]:
    """Per-variant aggregates and the time-to-accuracy target.

    The target is the baseline's mean accuracy at its last check (the end of training) minus 0.3 points,
    on what the checks measure (the fixed validation subset; the whole set in the older records), so that
    every check is compared with the baseline on the same snippets: a subset's own sampling offset (about a
    point for 1,000 snippets) would otherwise move the target. The goal compares final accuracies on the
    whole validation set. A ``target`` given (issue 34: the baseline's plateau minus 0.3 points, from
    :func:`.paired.plateau_target`) replaces that one.
    """
    ok = [r for r in records if r.error is None and r.epochs]
    baseline = [r for r in ok if r.variant == "full fine-tuning"]
    base = [r.final_acc for r in baseline if r.final_acc is not None]
    base_check = [r.final_check_acc for r in baseline if r.final_check_acc is not None]
    if target is None:
        target = statistics.fmean(base_check) - GOAL_DROP / 100 if base_check else None
    train_of = {v.name: [r.train_s for r in ok if r.variant == v.name] for v in variants}
    fit_of = {v.name: [r.fit_s for r in ok if r.variant == v.name] for v in variants}
    base_tta = None
    rows = []
    for v in variants:
        runs = [r for r in ok if r.variant == v.name]
        failed = [r for r in records if r.variant == v.name and r.error is not None]
        if not runs:
            rows.append({"variant": v.name, "kind": v.kind, "runs": 0, "failed": len(failed)})
            continue
        train = _mean_sd([r.train_s for r in runs])
        n_epochs = max(len(r.epochs) for r in runs)
        per_epoch = [statistics.fmean(r.epochs[e]["train_s"] for r in runs if len(r.epochs) > e) for e in range(n_epochs)]
        acc = _mean_sd([100 * r.final_acc for r in runs if r.final_acc is not None])
        ttas = [r.time_to(target) for r in runs] if target is not None else []
        reached = [t for t in ttas if t is not None]
        tta = _mean_sd(reached) if reached and len(reached) == len(runs) else (math.nan, math.nan)
        if v.kind == "full":
            base_tta = tta[0]
        ref = reference_of(v, variants, bool(base))
        ref_train = train_of.get(ref.name) if ref is not None else None
        ref_fit = fit_of.get(ref.name) if ref is not None else None
        fit = _mean_sd([r.fit_s for r in runs])
        levels = sorted({int(k) for r in runs for k in r.frozen_s}, key=int)
        rows.append({
            "variant": v.name, "kind": v.kind, "ours": v.autofreeze, "runs": len(runs), "failed": len(failed),
            "train": train, "per_epoch": per_epoch,
            "speedup": (statistics.fmean(ref_train) / train[0]) if ref_train else math.nan,
            "wall_speedup": (statistics.fmean(ref_fit) / fit[0]) if ref_fit and fit[0] > 0 else math.nan,
            "reference": ref.name if ref_train else None, "acc": acc,
            "tta": tta, "tta_reached": f"{len(reached)}/{len(runs)}" if target is not None else None,
            "val": _mean_sd([r.val_s for r in runs]),
            "fit": fit,
            "frozen": [runs[0].epochs[e]["frozen"] for e in range(len(runs[0].epochs))],
            "freezes": runs[0].freezes,
            "trainable_m": runs[0].trainable_params / 1e6,
            # Mean over seeds of the training seconds and steps spent with F blocks frozen.
            "frozen_s": {f: statistics.fmean(r.frozen_s.get(str(f), 0.0) for r in runs) for f in levels},
            "frozen_steps": {f: statistics.fmean(r.frozen_steps.get(str(f), 0) for r in runs) for f in levels},
            "cache_hits": [runs[0].epochs[e]["cache_hits"] for e in range(len(runs[0].epochs))],
            "per_epoch_acc": [statistics.fmean(100 * r.epochs[e]["metric"] for r in runs if len(r.epochs) > e) for e in range(n_epochs)],
            "check_acc": _mean_sd([100 * r.final_check_acc for r in runs if r.final_check_acc is not None]),
            "checks": min(len(r.points) for r in runs),
            # Cache footprint, MB, mean over seeds: the run's largest at an epoch end, and per epoch.
            "cache_peak_mb": (_mean_mb([r.cache_peak("cache_mem_bytes") for r in runs]),
                              _mean_mb([r.cache_peak("cache_disk_bytes") for r in runs])),
            "per_epoch_cache_mb": [
                (_mean_mb([r.epochs[e].get("cache_mem_bytes") for r in runs if len(r.epochs) > e]),
                 _mean_mb([r.epochs[e].get("cache_disk_bytes") for r in runs if len(r.epochs) > e]))
                for e in range(n_epochs)
            ],
        })  # fmt: skip
    base_acc = statistics.fmean(100 * a for a in base) if base else math.nan
    for row in rows:
        if "tta" in row:
            row["tta_speedup"] = (base_tta / row["tta"][0]) if base_tta and not math.isnan(row["tta"][0]) else math.nan
            row["delta"] = row["acc"][0] - base_acc
    return rows, target

def goal_status(row: dict[str, Any]) -> str:
    """The issue-17 goal for one row: ``met``, or what is missing (``speed``, ``accuracy``, ``both``)."""
    if row.get("kind") == "full" or not row.get("runs") or math.isnan(row.get("delta", math.nan)) or math.isnan(row["speedup"]):
        return "-"
    fast, accurate = row["speedup"] >= GOAL_SPEEDUP, row["delta"] >= -GOAL_DROP
    return "met" if fast and accurate else "speed" if accurate else "accuracy" if fast else "both"
