"""The timeline's rows and how they read: one record per epoch, a table that fits 80 columns, a summary.

Pure Python (no torch, no Lightning): the callback fills the records, this module words them, so
the table, the JSON and the summary can be tested from hand-made rows. What "speed" compares is
said wherever it is shown: an epoch's training samples/s over epoch 0's *of the same run* (epoch 0
trains every block, like plain fine-tuning, but under the same strategy and settings); it is not
a comparison with a separate plain fine-tuning run.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["COLUMNS", "MISSING", "EpochRecord", "format_table", "freeze_summary", "hits_cell", "to_json"]

#: What a cell shows when the run has no such thing (no AutoFreeze, no plan, no cache).
MISSING = "-"

#: Each field of :class:`EpochRecord`, described (written into the JSON file beside the rows).
COLUMNS = {
    "epoch": "the training epoch (0-based)",
    "frozen": "frozen blocks / blocks at the epoch's end, as 'F/L' (AutoFreeze's count; '-' without AutoFreeze)",
    "num_frozen": "frozen blocks at the epoch's end (null without AutoFreeze)",
    "pipe_len": "pipeline stages per replica in the plan at the epoch's end ('-' without strategy='pipetransformer')",
    "replicas": "data-parallel pipeline replicas in that plan ('-' without strategy='pipetransformer')",
    "cache_hits": "AutoCache lookups this epoch that the cache served, as 'hits/lookups (rate)'; training and "
    "validation together, counted from the later of the epoch's start and the boundary's last move ('-': no cache)",
    "cache_hit_count": "the hits of cache_hits as a number (null: no cache or no store yet)",
    "cache_lookups": "the lookups of cache_hits as a number (null: no cache or no store yet)",
    "samples": "training samples this epoch, over every replica",
    "samples_per_s": "training samples per second, over every replica; validation time excluded",
    "speed_vs_epoch0": "samples_per_s over epoch 0's samples_per_s in this run (epoch 0 trains every block); "
    "null without an epoch-0 row. Not a comparison with a separate plain fine-tuning run",
    "train_s": "the epoch's training seconds, validation excluded (epoch-start freeze work included)",
    "epoch_s": "the whole epoch in seconds, validation included",
    "total_s": "seconds since the first epoch started, validation included",
    "metric": "the monitored metric at the epoch's end (null if not logged)",
    "cache_mem_bytes": "bytes of the current boundary's cache entries in host memory at the epoch's end",
    "cache_disk_bytes": "bytes of its files on disk (every process's)",
}


@dataclass
class EpochRecord:
    """One row of the timeline (see :data:`COLUMNS`). Fields added later have defaults, so rows saved
    by an earlier version still load."""

    epoch: int
    frozen: str
    pipe_len: str
    replicas: str
    cache_hits: str
    samples_per_s: float
    train_s: float
    epoch_s: float
    total_s: float
    metric: float | None
    cache_mem_bytes: int | None = None
    cache_disk_bytes: int | None = None
    speed_vs_epoch0: float | None = None
    num_frozen: int | None = None
    samples: int = 0
    cache_hit_count: int | None = None
    cache_lookups: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EpochRecord:
        """A row from its JSON form (unknown keys are ignored: rows from a later version load too)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def compact(n: int) -> str:
    """A count in at most 6 characters: ``2500``, ``12.3k``, ``4.5M``."""
    if n < 10_000:
        return str(n)
    if n < 99_950:
        return f"{n / 1e3:.1f}k"
    if n < 999_500:
        return f"{n / 1e3:.0f}k"
    return f"{n / 1e6:.1f}M" if n < 99_950_000 else f"{n / 1e6:.0f}M"


def hits_cell(hits: int | None, lookups: int | None) -> str:
    """``hits/lookups (rate)`` for the JSON row; ``-`` without a count."""
    if hits is None or lookups is None:
        return MISSING
    if lookups == 0:
        return "0/0"
    return f"{hits}/{lookups} ({hits / lookups:.0%})"


def _short_hits(r: EpochRecord) -> str:
    if r.cache_hit_count is None or r.cache_lookups is None:
        return r.cache_hits if r.cache_hits == MISSING else r.cache_hits.split(" ")[0]
    return f"{compact(r.cache_hit_count)}/{compact(r.cache_lookups)}"


def _seconds(s: float) -> str:
    return f"{s:.1f}" if s < 1000 else f"{s:.0f}"


def _rate(x: float) -> str:
    return f"{x:.1f}" if x < 10_000 else compact(int(x))


def format_table(rows: list[EpochRecord], metric_name: str | None = "val/acc", width: int = 80) -> str:
    """The timeline as a text table no wider than ``width`` (80 by default: a terminal's).

    Columns that hold nothing in this run (pipe and replicas without the strategy, the cache
    without AutoCache) are left out and named under the table, and a long metric name is cut,
    so the rows never wrap. The cache bytes and the epoch times with validation are in the JSON.
    """
    metric_head = (metric_name or "metric")[:12]
    columns: list[tuple[str, list[str]]] = [
        ("epoch", [str(r.epoch) for r in rows]),
        ("frozen", [r.frozen for r in rows]),
        ("pipe", [r.pipe_len for r in rows]),
        ("replicas", [r.replicas for r in rows]),
        ("cache hits", [_short_hits(r) for r in rows]),
        ("samples/s", [_rate(r.samples_per_s) for r in rows]),
        ("speed*", [MISSING if r.speed_vs_epoch0 is None else f"{r.speed_vs_epoch0:.2f}x" for r in rows]),
        ("train s", [_seconds(r.train_s) for r in rows]),
        (metric_head, [MISSING if r.metric is None or math.isnan(r.metric) else f"{r.metric:.4f}" for r in rows]),
    ]
    optional = {"pipe", "replicas", "cache hits", "frozen"}
    empty = [head for head, cells in columns if head in optional and rows and all(c == MISSING for c in cells)]
    columns = [(head, cells) for head, cells in columns if head not in empty]
    widths = [max([len(head), *(len(c) for c in cells)]) for head, cells in columns]
    gap = 2 if sum(widths) + 2 * (len(widths) - 1) <= width else 1
    lines = [(" " * gap).join(head.rjust(w) for (head, _), w in zip(columns, widths))]
    lines.append((" " * gap).join("-" * w for w in widths))
    for i in range(len(rows)):
        lines.append((" " * gap).join(cells[i].rjust(w) for (_, cells), w in zip(columns, widths)))
    notes = [f"speed: samples/s over epoch 0's in this run ({_epoch0_words(rows)}), not a comparison with a "
             "separate plain fine-tuning run. train s: validation excluded."]  # fmt: skip
    if "cache hits" not in empty:
        notes.append("cache hits: hits/lookups this epoch, training and validation together.")
    if empty:
        notes.append(f"Not shown (nothing to show in this run): {', '.join(empty)}.")
    wrapped = textwrap.wrap(" ".join(notes), width, initial_indent="* ", subsequent_indent="  ")
    return "\n".join(lines + wrapped)


def _epoch0_words(rows: list[EpochRecord]) -> str:
    """What epoch 0 trained, from its row: the reference the speed column is relative to."""
    first = next((r for r in rows if r.epoch == 0), None)
    if first is None:
        return "no epoch-0 row in this fit: no speed"
    if first.num_frozen == 0:
        return "epoch 0 trains every block"
    if first.num_frozen is None:
        return "epoch 0 as the reference"
    return f"epoch 0 already had {first.frozen} blocks frozen"


def freeze_summary(rows: list[EpochRecord], freezes: list[tuple[int, int]], num_blocks: int | None) -> str:
    """One sentence: what was frozen when, and what it saved against epoch 0's throughput.

    ``freezes``: ``(epoch, frozen blocks after)`` for each freeze event (AutoFreeze's ``history``).
    The saving is the training time the same samples would have taken at epoch 0's samples/s, minus
    the time they took: what freezing (and the cache) bought in this run, not a comparison with a
    separate plain fine-tuning run.
    """
    if not rows:
        return "Timeline: no training epoch ran."
    of = f"/{num_blocks}" if num_blocks else ""
    if num_blocks is None:
        frozen = "nothing frozen (no AutoFreeze among the callbacks)"
    elif not freezes:
        frozen = f"nothing frozen (0{of} blocks)"
    else:
        frozen = "froze " + ", ".join(f"{n}{of} blocks in epoch {e}" for e, n in freezes)
    train_s = sum(r.train_s for r in rows)
    first = next((r for r in rows if r.epoch == 0), None)
    if first is None or first.samples_per_s <= 0 or len(rows) < 2:
        return f"Timeline: {frozen}; training {train_s:.0f} s (validation excluded)."
    at_epoch0 = sum(r.samples for r in rows) / first.samples_per_s
    saved = at_epoch0 - train_s
    verdict = f"saved {saved:.0f} s" if saved >= 0 else f"cost {-saved:.0f} s more"
    return (
        f"Timeline: {frozen}; training {train_s:.0f} s (validation excluded) against {at_epoch0:.0f} s at epoch 0's "
        f"samples/s: {verdict} ({at_epoch0 / train_s:.2f}x over the run; {_epoch0_words(rows)})."
    )


def to_json(rows: list[EpochRecord], metric_name: str | None, summary: str) -> dict[str, Any]:
    """The JSON file's content: the rows, what each field means, the monitored metric and the summary."""
    return {"monitor": metric_name, "summary": summary, "columns": COLUMNS, "rows": [asdict(r) for r in rows]}
