"""A Lightning callback that records what PipeTransformer did each epoch, as a table and a plot.

Per epoch: frozen blocks (from an :class:`~lightning_pipetransformer.AutoFreeze` among the
trainer's callbacks), pipeline length, replicas, cache hits and the cache's bytes in host memory
and on disk (read from the strategy's ``plan`` and ``cache_stats`` when it has them, else ``-``),
training throughput, its ratio to epoch 0's ("speed vs epoch 0": epoch 0 trains every block),
epoch time and the validation metric. At the end of ``fit``, rank 0 prints the table and, if asked, writes a PNG
(and a JSON file) of the same timeline::

    callbacks:
      - class_path: timeline.Timeline
        init_args: {plot_path: outputs/timeline.png}
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

__all__ = ["EpochRecord", "Timeline", "format_table"]

MISSING = "-"


@dataclass
class EpochRecord:
    """One row of the timeline. Strategy-dependent fields hold ``"-"`` when unknown."""

    epoch: int
    frozen: str  # "F/L"
    pipe_len: str
    replicas: str
    cache_hits: str
    samples_per_s: float
    train_s: float  # the epoch's training part (validation excluded)
    epoch_s: float  # the whole epoch, validation included
    total_s: float  # since the start of the first epoch
    metric: float | None
    # The cache's footprint at the epoch's end: the current frozen boundary's store (the previous
    # boundary's entries are dropped when it moves). None: no cache, or no store yet (nothing frozen).
    # Defaults keep rows saved before these fields existed loadable.
    cache_mem_bytes: int | None = None
    cache_disk_bytes: int | None = None  # the store's directory, every process's files
    # samples_per_s over epoch 0's (nothing frozen yet): 1.0 for epoch 0; None without an epoch-0 row.
    speed_vs_epoch0: float | None = None


def _batch_size(batch: Any) -> int:
    """Samples in a batch: the first dimension of its labels, or of its first tensor."""
    if isinstance(batch, Mapping):
        for key in ("labels", "label", "y"):
            if isinstance(batch.get(key), torch.Tensor):
                return int(batch[key].shape[0])
        batch = list(batch.values())
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)):
        for item in batch:
            n = _batch_size(item)
            if n:
                return n
    return 0


def _frozen(trainer: pl.Trainer) -> str:
    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        if hasattr(cb, "num_frozen") and hasattr(cb, "num_blocks"):
            return f"{cb.num_frozen}/{cb.num_blocks}"
    return MISSING


def _plan_fields(trainer: pl.Trainer) -> tuple[str, str]:
    """(pipe length, replicas) from the strategy's plan; ``-`` for strategies without one."""
    plan = getattr(trainer.strategy, "plan", None)
    if plan is None:
        return MISSING, MISSING
    pipe_len = getattr(plan, "pipe_len", None)
    ranks = getattr(plan, "active_ranks", None)
    return (
        str(pipe_len) if pipe_len is not None else MISSING,
        str(len(ranks)) if ranks is not None else MISSING,
    )


def _cache_stats(trainer: pl.Trainer) -> dict[str, Any] | None:
    """The strategy's cache statistics under plain names (``hits``, ``bytes_in_memory``, ...); ``None`` without."""
    stats = getattr(trainer.strategy, "cache_stats", None)
    if callable(stats):
        try:
            stats = stats()
        except Exception:  # a report, not a reason to fail training
            return None
    if stats is None:
        return None
    if not isinstance(stats, Mapping):
        names = ("hits", "misses", "hit_rate", "bytes_in_memory", "bytes_on_disk")
        stats = {k: getattr(stats, k) for k in names if hasattr(stats, k)}
        return stats or None
    # The strategy reports logger-ready names ("autocache/hits"); plain names work too.
    return {str(k).rsplit("/", 1)[-1]: v for k, v in stats.items()}


def _cache_hits(stats: Mapping[str, Any] | None) -> str:
    """The cache statistics in one short cell: ``hits/lookups (rate)`` if it can."""
    if stats is None:
        return MISSING
    hits, misses = stats.get("hits"), stats.get("misses")
    if isinstance(hits, (int, float)) and isinstance(misses, (int, float)) and hits + misses > 0:
        return f"{int(hits)}/{int(hits + misses)} ({hits / (hits + misses):.0%})"
    rate = stats.get("hit_rate")
    if isinstance(rate, (int, float)):
        return f"{rate:.0%}"
    return str(hits) if hits is not None else MISSING


def _cache_bytes(stats: Mapping[str, Any] | None, name: str) -> int | None:
    """One byte count of the stats as an int (the logger-ready metrics are floats); ``None`` if absent."""
    value = stats.get(name) if stats is not None else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return int(value)


def _mb_cell(mem: int | None, disk: int | None) -> str:
    """``"mem/disk"`` in MB (one decimal), ``-`` for an unknown part; ``-`` alone if both are unknown."""
    if mem is None and disk is None:
        return MISSING
    return "/".join(MISSING if b is None else f"{b / 1e6:.1f}" for b in (mem, disk))


def _metric(trainer: pl.Trainer, key: str) -> float | None:
    value = trainer.callback_metrics.get(key)
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


def format_table(rows: list[EpochRecord], metric_name: str = "val/acc") -> str:
    """The timeline as a fixed-width text table."""
    head = ("epoch", "frozen", "pipe", "replicas", "cache hits", "cache MB (mem/disk)", "samples/s", "speed vs epoch 0",
            "train s", "epoch s", "total s", metric_name)  # fmt: skip
    body = [
        (
            str(r.epoch), r.frozen, r.pipe_len, r.replicas, r.cache_hits, _mb_cell(r.cache_mem_bytes, r.cache_disk_bytes),
            f"{r.samples_per_s:.1f}", MISSING if r.speed_vs_epoch0 is None else f"{r.speed_vs_epoch0:.2f}x",
            f"{r.train_s:.1f}", f"{r.epoch_s:.1f}", f"{r.total_s:.1f}",
            MISSING if r.metric is None else f"{r.metric:.4f}",
        )
        for r in rows
    ]  # fmt: skip
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in (head, *body)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


class Timeline(Callback):
    """Record one :class:`EpochRecord` per training epoch; report them at the end of ``fit``.

    Args:
        plot_path: where rank 0 writes a PNG of the timeline (needs matplotlib); ``None``: no plot.
        json_path: where rank 0 writes the rows as JSON; ``None``: not written.
        monitor: the logged validation metric to record (``trainer.callback_metrics`` key).
        print_table: print the table on rank 0 at the end of ``fit``.

    Throughput counts the samples this process trained on, times the number of data-parallel
    replicas (the plan's active ranks, else the world size): every replica trains equal shares.

    List it before :class:`~lightning_pipetransformer.AutoFreeze`: callbacks run in list order, and
    an epoch-level freeze (re-plan, cache advance over every stored sample) happens in AutoFreeze's
    ``on_train_epoch_start``; listed after it, that work falls outside the epoch's time (it warns).
    """

    def __init__(
        self,
        plot_path: str | None = None,
        json_path: str | None = None,
        monitor: str = "val/acc",
        print_table: bool = True,
    ) -> None:
        super().__init__()
        self.plot_path = plot_path
        self.json_path = json_path
        self.monitor = monitor
        self.print_table = print_table
        self.rows: list[EpochRecord] = []
        self._start: float | None = None
        self._epoch_start = 0.0
        self._val_start: float | None = None
        self._val_s = 0.0
        self._samples = 0

    # -------------------------------------------------------------- hooks, in loop order

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_pipetransformer import AutoFreeze

        callbacks = list(trainer.callbacks)  # type: ignore[attr-defined]
        mine = next(i for i, cb in enumerate(callbacks) if cb is self)
        # Freeze work at epoch starts: epoch-level points, or sub-epoch points deferred there (AutoDP).
        before = [
            type(cb).__name__ for cb in callbacks[:mine]
            if isinstance(cb, AutoFreeze) and (cb.freeze_interval is None or getattr(trainer, "world_size", 1) > 1)
        ]  # fmt: skip
        if before:
            rank_zero_warn(
                f"Timeline is listed after {before[0]}: the freeze work at epoch starts (re-plan, cache advance) "
                "runs before Timeline starts the epoch's clock and is left out of its train time. List Timeline first."
            )

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_start = time.perf_counter()
        if self._start is None:
            self._start = self._epoch_start
        self._val_s, self._samples = 0.0, 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._samples += _batch_size(batch)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._val_start is not None:
            self._val_s += time.perf_counter() - self._val_start
            self._val_start = None

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning validates at the end of an epoch *before* this hook: the metric is this epoch's.
        now = time.perf_counter()
        epoch_s = now - self._epoch_start
        train_s = max(epoch_s - self._val_s, 1e-9)
        pipe_len, replicas = _plan_fields(trainer)
        n_replicas = int(replicas) if replicas.isdigit() else trainer.world_size
        cache = _cache_stats(trainer)
        samples_per_s = self._samples * n_replicas / train_s
        # The ratio needs epoch 0's row (a run resumed without the Timeline's state has none: None).
        first = samples_per_s if trainer.current_epoch == 0 else next((r.samples_per_s for r in self.rows if r.epoch == 0), None)
        self.rows.append(
            EpochRecord(
                epoch=trainer.current_epoch,
                frozen=_frozen(trainer),
                pipe_len=pipe_len,
                replicas=replicas,
                cache_hits=_cache_hits(cache),
                samples_per_s=samples_per_s,
                train_s=train_s,
                epoch_s=epoch_s,
                total_s=now - (self._start or self._epoch_start),
                metric=_metric(trainer, self.monitor),
                cache_mem_bytes=_cache_bytes(cache, "bytes_in_memory"),
                cache_disk_bytes=_cache_bytes(cache, "bytes_on_disk"),
                speed_vs_epoch0=samples_per_s / first if first else None,
            )
        )

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero or not self.rows:
            return
        if self.print_table:
            print("\nPipeTransformer timeline\n" + format_table(self.rows, self.monitor), flush=True)
        if self.json_path:
            path = Path(self.json_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps([asdict(r) for r in self.rows], indent=2))
        if self.plot_path:
            write_plot(self.rows, Path(self.plot_path), self.monitor)
            print(f"timeline plot: {Path(self.plot_path).resolve()}", flush=True)

    # -------------------------------------------------------------- checkpointing

    def state_dict(self) -> dict[str, Any]:
        return {"rows": [asdict(r) for r in self.rows]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rows = [EpochRecord(**r) for r in state_dict.get("rows", [])]


def write_plot(rows: list[EpochRecord], path: Path, metric_name: str = "val/acc") -> None:
    """Write the timeline as a PNG: throughput (labelled with its speed vs epoch 0) and frozen blocks
    per epoch; metric over time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("The timeline plot needs matplotlib: pip install matplotlib (or set plot_path: null).") from err

    epochs = [r.epoch for r in rows]
    fig, (ax_speed, ax_metric) = plt.subplots(1, 2, figsize=(10, 3.8))
    bars = ax_speed.bar(epochs, [r.samples_per_s for r in rows], color="tab:blue", alpha=0.7)
    ax_speed.bar_label(bars, labels=["" if r.speed_vs_epoch0 is None else f"{r.speed_vs_epoch0:.2f}x" for r in rows], fontsize=8)
    ax_speed.set_xlabel("epoch")
    ax_speed.set_ylabel("training samples/s", color="tab:blue")
    ax_speed.set_xticks(epochs)
    frozen = [int(r.frozen.split("/")[0]) if r.frozen != MISSING else None for r in rows]
    if any(f is not None for f in frozen):
        ax_frozen = ax_speed.twinx()
        ax_frozen.step(epochs, [f or 0 for f in frozen], where="mid", color="tab:red", marker="o")
        ax_frozen.set_ylabel("frozen blocks", color="tab:red")
        ax_frozen.set_ylim(bottom=0, top=max(int(rows[0].frozen.split("/")[1]), 1) + 0.5)
    ax_speed.set_title("throughput and freezing per epoch")

    points = [(r.total_s, r.metric) for r in rows if r.metric is not None]
    if points:
        ax_metric.plot([0.0] + [t for t, _ in points], [float("nan")] + [m for _, m in points], marker="o")
    ax_metric.set_xlim(left=0)
    ax_metric.set_xlabel("training wall time (s)")
    ax_metric.set_ylabel(metric_name)
    ax_metric.set_title(f"{metric_name} over time")
    ax_metric.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
