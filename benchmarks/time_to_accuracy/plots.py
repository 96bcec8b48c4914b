"""The report's PNGs: accuracy against training time, and speed-up against final accuracy."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from .summary import GOAL_DROP, GOAL_SPEEDUP
from .variants import RunRecord, Variant


def plot_path_for(docs: Path) -> Path:
    """The PNG next to a report: docs/benchmarks.md -> docs/benchmarks_time_to_accuracy.png (the historic
    name); docs/cache_benchmark.md -> docs/cache_benchmark_time_to_accuracy.png, never the other's."""
    return docs.with_name(f"{docs.stem}_time_to_accuracy.png")

def write_plot(records: list[RunRecord], variants: list[Variant], target: float | None, path: Path, title: str = "MiniLM-L6") -> None:
    """Validation accuracy at every check against the training time up to it, one line per variant (mean over
    seeds of each check: the checks fall on the same optimizer steps in every run of a variant)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11.5, 5.0))
    for v in variants:
        runs = [r for r in records if r.variant == v.name and r.error is None and r.epochs]
        if not runs:
            continue
        curves = [r.points for r in runs]
        n = min(len(c) for c in curves)
        times = [statistics.fmean(c[i][0] for c in curves) for i in range(n)]
        accs = [[100 * c[i][1] for c in curves] for i in range(n)]
        mean = [statistics.fmean(a) for a in accs]
        sd = [statistics.stdev(a) if len(a) > 1 else 0.0 for a in accs]
        ax.errorbar(times, mean, yerr=sd, marker="o" if n <= 8 else ".", markersize=4, capsize=2, label=v.name, linestyle=_style(v))
    if target is not None:
        ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1, label=f"target (baseline - {GOAL_DROP:g} pt)")
    ax.set_xlim(left=0)
    ax.set_xlabel("training wall-clock (s, validation excluded)")
    ax.set_ylabel("validation accuracy at each check (%)")
    ax.set_title(f"{title} on Rotten Tomatoes: accuracy vs training time (mean ± sd over seeds)", fontsize=10)
    _save(fig, ax, path)


def _style(v: Variant) -> str:
    if v.kind in ("full", "llrd", "lora", "bft", "es"):
        return "-"
    if v.kind in ("bftc", "lorac"):
        return "--"
    return ":" if v.kind == "freeze" else "-" if v.anneal or v.kind == "early" else "--" if v.sub_epoch else "-."


def speedup_plot_path_for(docs: Path) -> Path:
    """The speed-up vs accuracy PNG next to a report: docs/benchmarks.md -> docs/benchmarks_speedup_vs_accuracy.png."""
    return docs.with_name(f"{docs.stem}_speedup_vs_accuracy.png")


def write_speedup_plot(rows: list[dict[str, Any]], path: Path, title: str = "MiniLM-L6") -> None:
    """Every variant as a point: mean training speed-up over the baseline (x) and mean final accuracy with its
    spread over seeds (y); the goal (issue 25: >= 2x, >= baseline - 0.3 points) drawn as a shaded corner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next((r for r in rows if r["kind"] == "full" and r.get("runs")), None)
    fig, ax = plt.subplots(figsize=(11.5, 5.5))
    points = [r for r in rows if r.get("runs") and (r["kind"] == "full" or not math.isnan(r["speedup"]))]
    markers = {"full": "s", "es": "^", "llrd": "X", "freeze": "v", "cache": "o", "lora": "D", "bft": "P"}
    for r in points:
        x = 1.0 if r["kind"] == "full" else r["speedup"]
        sd = 0.0 if math.isnan(r["acc"][1]) else r["acc"][1]
        ax.errorbar([x], [r["acc"][0]], yerr=[sd], marker=markers.get(r["kind"], "o"), capsize=3, linestyle="none",
                    label=f"{r['variant']} ({r['runs']} seed{'s' if r['runs'] != 1 else ''})")  # fmt: skip
    if base is not None:
        target = base["acc"][0] - GOAL_DROP
        xmax = max([GOAL_SPEEDUP * 1.25] + [r["speedup"] * 1.1 for r in points if r["kind"] != "full"])
        ax.axvline(GOAL_SPEEDUP, color="tab:green", linestyle="--", linewidth=1)
        ax.axhline(target, color="tab:green", linestyle="--", linewidth=1)
        ax.axhline(base["acc"][0], color="grey", linestyle=":", linewidth=1)
        top = max([r["acc"][0] + (0 if math.isnan(r["acc"][1]) else r["acc"][1]) for r in points] + [target]) + 0.3
        ax.fill_between([GOAL_SPEEDUP, xmax], target, top, color="tab:green", alpha=0.08,
                        label=f"goal: >= {GOAL_SPEEDUP:g}x and >= baseline - {GOAL_DROP:g} pt")  # fmt: skip
        xmin = min([0.8] + [r["speedup"] * 0.9 for r in points if r["kind"] != "full"])  # slower peers stay in view
        ax.set_xlim(xmin, xmax)
        ax.set_ylim(top=top)
    ax.set_xlabel("training speed-up over full fine-tuning (mean train time ratio, validation excluded)")
    ax.set_ylabel("final validation accuracy (%), mean ± sd over seeds")
    ax.set_title(f"{title} on Rotten Tomatoes: speed-up vs final accuracy", fontsize=10)
    _save(fig, ax, path)


def frontier_plot_path_for(docs: Path) -> Path:
    """The frontier PNG next to a report: docs/benchmarks_34.md -> docs/benchmarks_34_frontier.png."""
    return docs.with_name(f"{docs.stem}_frontier.png")


def write_frontier_plot(
    times: list[float], curves: dict[str, list[float]], variants: list[Variant], target: float | None, path: Path, title: str
) -> None:
    """The frontier: for each row, the best check accuracy reached by training time t (mean over seeds of each
    run's best so far; :func:`.paired.frontier`), one step line per row on one plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11.5, 5.0))
    for v in variants:
        curve = curves.get(v.name)
        if curve is None or all(math.isnan(c) for c in curve):
            continue
        ax.step(times, [100 * c for c in curve], where="post", label=v.name, linestyle=_style(v))
    if target is not None:
        ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1, label="time-to-accuracy target")
    ax.set_xlim(left=0)
    ax.set_xlabel("training wall-clock t (s, validation excluded)")
    ax.set_ylabel("best validation-check accuracy reached by t (%)")
    ax.set_title(f"{title} on Rotten Tomatoes: the frontier (mean over seeds of the best so far)", fontsize=10)
    _save(fig, ax, path)


def _save(fig: Any, ax: Any, path: Path) -> None:
    """The finish both plots share: grid, legend outside the axes, PNG at 110 dpi."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
