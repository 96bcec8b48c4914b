"""PipeTransformerTimeline: a callback that records, per epoch, what freezing, the pipeline and the cache did.

It works in any script: with a plain Trainer and :class:`~lightning_pipetransformer.AutoFreeze`
(frozen blocks, throughput, the metric) and under ``strategy="pipetransformer"`` (also the plan's
pipe length and replicas, and the cache's hits). It reads the strategy duck-typed (``plan``,
``cache_stats``), so it never depends on the strategy's class.
"""

from __future__ import annotations

import json
import math
import textwrap
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn

from lightning_pipetransformer.freeze.callback import AutoFreeze
from lightning_pipetransformer.timeline.plot import matplotlib_missing, write_plot
from lightning_pipetransformer.timeline.records import MISSING, EpochRecord, format_table, freeze_summary, hits_cell, to_json

__all__ = ["PipeTransformerTimeline"]


class PipeTransformerTimeline(Callback):
    """Record one row per training epoch; at the end of ``fit`` print a table (80 columns), a summary
    line, and write ``timeline.json`` and ``timeline.png`` (the plot only when matplotlib is installed).

    Per epoch: frozen blocks, pipe length, replicas, cache hits / lookups, training samples/s, the
    speed vs epoch 0 (samples/s over epoch 0's in this run), training seconds without validation,
    and the monitored metric. ``rows`` holds them as :class:`~lightning_pipetransformer.timeline.records.EpochRecord`.

    Args:
        dirpath: folder for ``timeline.json`` and ``timeline.png``. Default: the logger's ``log_dir``
            (``trainer.log_dir``), else ``trainer.default_root_dir``.
        monitor: the logged metric to record (a ``trainer.callback_metrics`` key, e.g. ``"val/acc"``).
            Default: the ``monitor`` of a ModelCheckpoint or EarlyStopping callback, else the first
            logged key that starts with ``val`` and is not a loss, else the first ``val`` key.
        print_table: print the table and the summary on global rank 0 at the end of ``fit``.
        save_json: write ``timeline.json`` (the rows, what each field means, the summary).
        save_plot: write ``timeline.png`` when matplotlib is installed (else one warning says how to get it).

    List it before AutoFreeze: callbacks run in list order, and an epoch-level freeze (re-plan,
    cache advance) runs in AutoFreeze's ``on_train_epoch_start``; listed after it, that work falls
    outside the epoch's time (it warns). Throughput counts this process's training samples times the
    data-parallel replicas (the plan's, else the world size): every replica trains an equal share.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        monitor: str | None = None,
        print_table: bool = True,
        save_json: bool = True,
        save_plot: bool = True,
    ) -> None:
        super().__init__()
        self.dirpath = dirpath
        self.monitor = monitor
        self.print_table = print_table
        self.save_json = save_json
        self.save_plot = save_plot
        self.rows: list[EpochRecord] = []
        #: Where the last fit wrote its files (``None``: not written).
        self.json_path: Path | None = None
        self.plot_path: Path | None = None
        #: The last fit's one-line summary (what was frozen when, what it saved).
        self.summary = ""
        self._start: float | None = None
        self._epoch_start = 0.0
        self._val_start: float | None = None
        self._val_s = 0.0
        self._samples = 0
        self._last_cache: tuple[float, int, int] | None = None  # (boundary, hits, misses) at the last epoch end

    # -------------------------------------------------------------- hooks, in loop order

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        callbacks = list(trainer.callbacks)  # type: ignore[attr-defined]
        mine = next(i for i, cb in enumerate(callbacks) if cb is self)
        # Freeze work at epoch starts: epoch-level points, or sub-epoch points deferred there (AutoDP).
        before = [
            type(cb).__name__ for cb in callbacks[:mine]
            if isinstance(cb, AutoFreeze) and (cb.freeze_interval is None or getattr(trainer, "world_size", 1) > 1)
        ]  # fmt: skip
        if before:
            rank_zero_warn(
                f"PipeTransformerTimeline is listed after {before[0]}: the freeze work at epoch starts (re-plan, cache "
                "advance) runs before the timeline starts the epoch's clock and is left out of its train time. "
                "List PipeTransformerTimeline first in callbacks."
            )
        if self.monitor is None:
            self.monitor = _monitor_of(callbacks)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_start = time.perf_counter()
        if self._start is None:
            self._start = self._epoch_start
        self._val_s, self._samples = 0.0, 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._samples += batch_size(batch)

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
        samples = self._samples * (int(replicas) if replicas.isdigit() else max(1, getattr(trainer, "world_size", 1)))
        samples_per_s = samples / train_s
        stats = _cache_stats(trainer)
        hits, lookups = self._cache_epoch(stats)
        autofreeze = _autofreeze(trainer)
        if self.monitor is None:
            self.monitor = _metric_key(trainer.callback_metrics)
        # The ratio needs epoch 0's row (a run resumed without the timeline's state has none: None).
        first = samples_per_s if trainer.current_epoch == 0 else next((r.samples_per_s for r in self.rows if r.epoch == 0), None)
        self.rows.append(
            EpochRecord(
                epoch=trainer.current_epoch,
                frozen=f"{autofreeze.num_frozen}/{autofreeze.num_blocks}" if autofreeze is not None and autofreeze.stack is not None else MISSING,
                num_frozen=autofreeze.num_frozen if autofreeze is not None and autofreeze.stack is not None else None,
                pipe_len=pipe_len,
                replicas=replicas,
                cache_hits=hits_cell(hits, lookups),
                cache_hit_count=hits,
                cache_lookups=lookups,
                samples=samples,
                samples_per_s=samples_per_s,
                train_s=train_s,
                epoch_s=epoch_s,
                total_s=now - (self._start or self._epoch_start),
                metric=_metric(trainer, self.monitor),
                cache_mem_bytes=_count(stats, "bytes_in_memory"),
                cache_disk_bytes=_count(stats, "bytes_on_disk"),
                speed_vs_epoch0=samples_per_s / first if first else None,
            )
        )

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # trainer.log_dir broadcasts rank 0's folder: every rank must ask, before only rank 0 goes on.
        folder = Path(self.dirpath) if self.dirpath else Path(trainer.log_dir or trainer.default_root_dir)
        if not trainer.is_global_zero or not self.rows:
            return
        autofreeze = _autofreeze(trainer)
        freezes = list(autofreeze.history) if autofreeze is not None else []
        num_blocks = autofreeze.num_blocks if autofreeze is not None and autofreeze.stack is not None else None
        self.summary = freeze_summary(self.rows, freezes, num_blocks)
        if self.save_json:
            self.json_path = folder / "timeline.json"
            self.json_path.parent.mkdir(parents=True, exist_ok=True)
            self.json_path.write_text(json.dumps(to_json(self.rows, self.monitor, self.summary), indent=2))
        if self.save_plot:
            missing = matplotlib_missing()
            if missing is not None:
                rank_zero_warn(f"PipeTransformerTimeline: {missing} (save_plot=False turns this off.)")
            else:
                self.plot_path = folder / "timeline.png"
                write_plot(self.rows, self.plot_path, self.monitor)
        if self.print_table:
            _stop_live_progress(trainer)
            lines = ["", "PipeTransformer timeline", format_table(self.rows, self.monitor), textwrap.fill(self.summary, 80)]
            lines += [f"written: {p}" for p in (self.json_path, self.plot_path) if p is not None]
            print("\n".join(lines), flush=True)

    # -------------------------------------------------------------- checkpointing

    def state_dict(self) -> dict[str, Any]:
        return {"rows": [to_json([r], None, "")["rows"][0] for r in self.rows], "monitor": self.monitor}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rows = [EpochRecord.from_dict(r) for r in state_dict.get("rows", [])]
        self.monitor = state_dict.get("monitor", self.monitor)

    # -------------------------------------------------------------- the cache's counts per epoch

    def _cache_epoch(self, stats: Mapping[str, Any] | None) -> tuple[int | None, int | None]:
        """This epoch's (hits, lookups): the store's counters since the last epoch's end, or since the
        store opened when the boundary moved in between (a new store counts from zero)."""
        if stats is None or "hits" not in stats or "misses" not in stats:
            self._last_cache = None
            return None, None
        now = (float(stats.get("boundary", -1)), int(stats["hits"]), int(stats["misses"]))
        before, self._last_cache = self._last_cache, now
        if before is not None and before[0] == now[0] and now[1] >= before[1] and now[2] >= before[2]:
            hits, misses = now[1] - before[1], now[2] - before[2]
        else:
            hits, misses = now[1], now[2]
        return hits, hits + misses


def batch_size(batch: Any) -> int:
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
            n = batch_size(item)
            if n:
                return n
    return 0


def _stop_live_progress(trainer: pl.Trainer) -> None:
    """Stop a live progress display (Lightning's ``RichProgressBar``) before the table is printed.

    Lightning stops that display in its ``teardown`` hook, which runs after ``on_fit_end``: the
    table printed here would be followed by the bar's last frame (its metrics column wrapped in a
    narrow terminal), so the summary would not be the last thing the run prints. Stopped now, the
    last frame comes before the table; the bar's own teardown then finds it stopped (rich's
    ``Progress.stop`` does nothing the second time). A bar without a live display (tqdm, closed at
    the end of training) is left alone.
    """
    progress = getattr(trainer.progress_bar_callback, "progress", None)
    stop = getattr(progress, "stop", None)
    if callable(stop):
        stop()


def _autofreeze(trainer: pl.Trainer) -> AutoFreeze | None:
    return next((cb for cb in trainer.callbacks if isinstance(cb, AutoFreeze)), None)  # type: ignore[attr-defined]


def _monitor_of(callbacks: list[Any]) -> str | None:
    """The metric a ModelCheckpoint or EarlyStopping watches (the run's own choice), if any."""
    for cb in callbacks:
        if isinstance(cb, (ModelCheckpoint, EarlyStopping)) and getattr(cb, "monitor", None):
            return str(cb.monitor)
    return None


def _metric_key(metrics: Mapping[str, Any]) -> str | None:
    """A validation metric to show when none was named: a ``val*`` key that is not a loss, else any ``val*`` key."""
    keys = sorted(str(k) for k in metrics if str(k).startswith("val"))
    return next((k for k in keys if "loss" not in k), keys[0] if keys else None)


def _plan_fields(trainer: pl.Trainer) -> tuple[str, str]:
    """(pipe length, replicas) from the strategy's plan; ``-`` for strategies without one."""
    plan = getattr(trainer.strategy, "plan", None)
    if plan is None:
        return MISSING, MISSING
    pipe_len = getattr(plan, "pipe_len", None)
    ranks = getattr(plan, "active_ranks", None)
    return (str(pipe_len) if pipe_len is not None else MISSING, str(len(ranks)) if ranks is not None else MISSING)


def _cache_stats(trainer: pl.Trainer) -> dict[str, Any] | None:
    """The strategy's cache statistics under plain names (``hits``, ``bytes_in_memory``, ...); ``None`` without."""
    stats = getattr(trainer.strategy, "cache_stats", None)
    if callable(stats):
        stats = stats()
    if not isinstance(stats, Mapping):
        return None
    return {str(k).rsplit("/", 1)[-1]: v for k, v in stats.items()}  # "autocache/hits" -> "hits"


def _count(stats: Mapping[str, Any] | None, name: str) -> int | None:
    """One count of the stats as an int (the logger-ready metrics are floats); ``None`` if absent."""
    value = stats.get(name) if stats is not None else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return int(value)


def _metric(trainer: pl.Trainer, key: str | None) -> float | None:
    value = trainer.callback_metrics.get(key) if key is not None else None
    if value is None:
        return None
    number = float(value)
    return None if math.isnan(number) else number
