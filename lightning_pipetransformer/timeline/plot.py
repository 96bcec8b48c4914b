"""The timeline as a PNG: throughput and frozen blocks per epoch, AutoCache's hits per epoch beside them,
and the metric over training time.

matplotlib is an optional dependency (``pip install "lightning-pipetransformer[plot]"``):
:func:`matplotlib_missing` says why a plot cannot be drawn, so the callback can skip it with that
message instead of failing a finished fit.
"""

from __future__ import annotations

import importlib.util
from itertools import accumulate
from pathlib import Path
from typing import Any

from lightning_pipetransformer.timeline.records import EpochRecord

__all__ = ["matplotlib_missing", "write_plot"]


def matplotlib_missing() -> str | None:
    """Why the plot cannot be drawn (matplotlib is not installed), or ``None`` when it can."""
    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a stand-in module without a spec (tests set sys.modules entries to None)
        found = False
    if found:
        return None
    return (
        "the timeline plot needs matplotlib, which is not installed: pip install matplotlib "
        '(or "lightning-pipetransformer[plot]"); the table and the JSON file are written without it.'
    )


def write_plot(rows: list[EpochRecord], path: Path, metric_name: str | None = None) -> None:
    """Write ``path`` (PNG). Left: training samples/s per epoch, each bar labelled with its speed vs
    epoch 0, and the frozen blocks. Middle, when the run had AutoCache: each epoch's lookups and the
    hits among them (the cache is what makes an epoch after a freeze fast or not, so it sits beside
    the speed). Right: the metric against the cumulative training time, validation excluded (the
    x-axis says so)."""
    reason = matplotlib_missing()
    if reason is not None:
        raise ImportError(reason)
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    cached = any(r.cache_lookups is not None for r in rows)
    fig, axes = plt.subplots(1, 3 if cached else 2, figsize=(14.5, 3.8) if cached else (10, 3.8))
    ax_speed, ax_metric = axes[0], axes[-1]
    _speed_panel(ax_speed, rows)
    if cached:
        _hits_panel(axes[1], rows)
    _metric_panel(ax_metric, rows, metric_name)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _speed_panel(ax_speed: Any, rows: list[EpochRecord]) -> None:
    """Samples/s bars labelled with the speed vs epoch 0, frozen blocks as a step line on a second axis."""
    epochs = [r.epoch for r in rows]
    bars = ax_speed.bar(epochs, [r.samples_per_s for r in rows], color="tab:blue", alpha=0.7)
    ax_speed.bar_label(bars, labels=["" if r.speed_vs_epoch0 is None else f"{r.speed_vs_epoch0:.2f}x" for r in rows], fontsize=8)
    ax_speed.set_xlabel("epoch (bar labels: samples/s over epoch 0's)")
    ax_speed.set_ylabel("training samples/s", color="tab:blue")
    ax_speed.set_xticks(epochs)
    frozen = [r.num_frozen for r in rows]
    if any(f is not None for f in frozen):
        ax_frozen = ax_speed.twinx()
        ax_frozen.step(epochs, [f or 0 for f in frozen], where="mid", color="tab:red", marker="o")
        ax_frozen.set_ylabel("frozen blocks", color="tab:red")
        blocks = max((int(r.frozen.split("/")[1]) for r in rows if "/" in r.frozen), default=1)
        ax_frozen.set_ylim(bottom=0, top=max(blocks, 1) + 0.5)
    ax_speed.set_title("throughput and freezing per epoch")


def _hits_panel(ax_hits: Any, rows: list[EpochRecord]) -> None:
    """Per epoch, the cache's lookups (light bar) and hits (dark bar over it); the hit rate on top of the lookups.

    An epoch without a store (epoch 0: nothing frozen yet) has no bar and is labelled ``-``, as in the table.
    """
    epochs = [r.epoch for r in rows]
    lookups = [r.cache_lookups or 0 for r in rows]
    hits = [r.cache_hit_count or 0 for r in rows]
    bars = ax_hits.bar(epochs, lookups, color="tab:green", alpha=0.25, label="lookups")
    ax_hits.bar(epochs, hits, color="tab:green", alpha=0.8, label="hits")
    labels = [
        "-" if r.cache_lookups is None else "0/0" if not r.cache_lookups else f"{(r.cache_hit_count or 0) / r.cache_lookups:.0%}"
        for r in rows
    ]
    ax_hits.bar_label(bars, labels=labels, fontsize=8)
    ax_hits.set_xticks(epochs)
    ax_hits.set_xlabel("epoch (bar labels: hits / lookups)")
    ax_hits.set_ylabel("cache lookups, training + validation")
    ax_hits.set_ylim(bottom=0, top=max([1, *lookups]) * 1.15)
    ax_hits.legend(loc="upper left", fontsize=8, frameon=False)
    ax_hits.set_title("AutoCache hits per epoch")


def _metric_panel(ax_metric: Any, rows: list[EpochRecord], metric_name: str | None) -> None:
    """The metric after each epoch against the cumulative training time (validation excluded)."""
    elapsed = list(accumulate(r.train_s for r in rows))
    points = [(t, r.metric) for t, r in zip(elapsed, rows) if r.metric is not None]
    if points:
        ax_metric.plot([t for t, _ in points], [m for _, m in points], marker="o")
    ax_metric.set_xlim(left=0)
    ax_metric.set_xlabel("training time, validation excluded (s)")
    ax_metric.set_ylabel(metric_name or "metric")
    ax_metric.set_title(f"{metric_name or 'metric'} after each epoch")
    ax_metric.grid(alpha=0.3)
