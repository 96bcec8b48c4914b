"""PipeTransformerTimeline in a Trainer: a plain one with AutoFreeze, and the strategy with AutoCache.

The rows are checked against what the run did (AutoFreeze's history, the strategy's plan, the
cache store's own counters), the printed table against 80 columns, and the files against their
contents; the plot is written with matplotlib and skipped, with a reason, without it.
"""

from __future__ import annotations

import json
import sys
import warnings

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy, PipeTransformerTimeline
from lightning_pipetransformer.timeline import EpochRecord
from tests.helpers.models import TextClassifier, loader, text_dataset

PNG = b"\x89PNG\r\n\x1a\n"


def fit(callbacks, strategy="auto", max_epochs=3, **kwargs) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=max_epochs, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kwargs,
    )  # fmt: skip
    trainer.fit(TextClassifier(num_layers=4), loader(text_dataset(32)), loader(text_dataset(32, seed=1)))
    return trainer


def test_plain_trainer_with_autofreeze(tmp_path, capsys) -> None:
    timeline, freeze = PipeTransformerTimeline(dirpath=str(tmp_path)), AutoFreeze(schedule={1: 1, 2: 3})
    fit([timeline, freeze])
    rows = timeline.rows
    assert [r.frozen for r in rows] == ["0/4", "1/4", "3/4"] and [r.num_frozen for r in rows] == [0, 1, 3]
    assert all(r.pipe_len == "-" and r.replicas == "-" and r.cache_hits == "-" for r in rows)  # no plan, no cache
    assert [r.samples for r in rows] == [32, 32, 32]
    assert rows[0].speed_vs_epoch0 == 1.0 and all(r.speed_vs_epoch0 == pytest.approx(r.samples_per_s / rows[0].samples_per_s) for r in rows)
    assert all(r.train_s < r.epoch_s for r in rows)  # validation ran and is left out of train_s
    # The monitored metric, found without being named: the only validation metric logged.
    assert timeline.monitor == "val_loss" and all(r.metric is not None and r.metric > 0 for r in rows)

    printed = capsys.readouterr().out
    table = printed[printed.index("PipeTransformer timeline") :]
    assert max(len(line) for line in table.splitlines() if not line.startswith("written: ")) <= 80, table
    assert f"written: {tmp_path / 'timeline.json'}" in table
    assert "froze 1/4 blocks in epoch 1, 3/4 blocks in epoch 2" in " ".join(table.split())
    assert "pipe, replicas, cache hits" in " ".join(table.split())  # said to be left out, not silently dropped

    data = json.loads((tmp_path / "timeline.json").read_text())
    assert data["monitor"] == "val_loss" and data["summary"] == timeline.summary
    assert [r["frozen"] for r in data["rows"]] == ["0/4", "1/4", "3/4"]
    assert [r["metric"] for r in data["rows"]] == [r.metric for r in rows]
    assert set(data["columns"]) == set(data["rows"][0])
    assert (tmp_path / "timeline.png").read_bytes()[:8] == PNG


def test_without_matplotlib_the_plot_is_skipped_with_a_reason(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails as if not installed
    timeline = PipeTransformerTimeline(dirpath=str(tmp_path), print_table=False)
    with pytest.warns(UserWarning, match=r"timeline plot needs matplotlib, which is not installed: pip install matplotlib"):
        fit([timeline, AutoFreeze(schedule={1: 1})], max_epochs=2)
    assert not (tmp_path / "timeline.png").exists() and timeline.plot_path is None
    assert len(json.loads((tmp_path / "timeline.json").read_text())["rows"]) == 2
    # Asked for no plot: no warning at all.
    quiet = PipeTransformerTimeline(dirpath=str(tmp_path / "quiet"), print_table=False, save_plot=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit([quiet, AutoFreeze(schedule={1: 1})], max_epochs=2)
    assert not [w for w in caught if "matplotlib" in str(w.message)]


def test_default_folder_is_the_loggers_log_dir(tmp_path) -> None:
    timeline = PipeTransformerTimeline(print_table=False, save_plot=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, callbacks=[timeline], default_root_dir=str(tmp_path),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(TextClassifier(num_layers=2), loader(text_dataset(16)))
    assert timeline.json_path is not None and timeline.json_path.parent == tmp_path / "lightning_logs" / "version_0"
    assert timeline.json_path.exists() and timeline.rows[0].frozen == "-" and timeline.rows[0].metric is None


class StoreCounts(Callback):
    """The cache store's own counters at each epoch end (listed after the timeline)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int] | None] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        store = trainer.strategy.autocache.store
        self.seen.append(None if store is None else (store.boundary, store.stats().hits, store.stats().misses))


def test_under_the_strategy_with_autocache_the_hits_are_per_epoch(tmp_path) -> None:
    """Epoch 1 stores boundary 2 (every lookup misses), epoch 2 reads it (every lookup hits): the row's
    counts are the store's counters since the previous epoch's end, and they engage (hits > 0)."""
    timeline, counts = PipeTransformerTimeline(dirpath=str(tmp_path), print_table=False, save_plot=False), StoreCounts()
    strategy = PipeTransformerStrategy(pipe_len=2, cache=True, cache_dir=str(tmp_path / "cache"))
    fit([timeline, AutoFreeze(schedule={1: 2}), counts], strategy=strategy, max_epochs=4)
    rows = timeline.rows
    assert all(r.pipe_len.isdigit() for r in rows) and [r.frozen for r in rows] == ["0/4", "2/4", "2/4", "2/4"]
    assert all(r.replicas == "1" for r in rows)
    assert rows[0].cache_hits == "-" and counts.seen[0] is None  # nothing frozen: no store
    # Epoch 1: 32 training + 32 validation lookups, all misses (stored); epochs 2, 3: all hits.
    assert (rows[1].cache_hit_count, rows[1].cache_lookups) == (0, 64)
    assert [(r.cache_hit_count, r.cache_lookups) for r in rows[2:]] == [(64, 64), (64, 64)]
    assert rows[2].cache_hits == "64/64 (100%)"
    for before, now, r in zip(counts.seen[1:], counts.seen[2:], rows[2:]):
        assert now[0] == before[0] == 2 and r.cache_hit_count == now[1] - before[1]
    assert all(r.cache_mem_bytes and r.cache_mem_bytes > 0 for r in rows[1:])


def _fake_trainer(callbacks=()):
    from types import SimpleNamespace

    return SimpleNamespace(callbacks=list(callbacks), strategy=None, world_size=1, callback_metrics={}, current_epoch=0, sanity_checking=False)


def test_speed_vs_epoch_0_is_each_epochs_samples_per_s_over_epoch_0s() -> None:
    import torch

    from lightning_pipetransformer.timeline import format_table

    timeline = PipeTransformerTimeline(print_table=False)
    trainer = _fake_trainer()
    batch = {"labels": torch.zeros(10)}
    for epoch, batches in enumerate((2, 3, 5)):  # 20, 30, 50 samples in about the same time
        trainer.current_epoch = epoch
        timeline.on_train_epoch_start(trainer, None)  # type: ignore[arg-type]
        for i in range(batches):
            timeline.on_train_batch_end(trainer, None, None, batch, i)  # type: ignore[arg-type]
        timeline._epoch_start -= 1.0  # each epoch took 1 s (plus the test's own microseconds)
        timeline.on_train_epoch_end(trainer, None)  # type: ignore[arg-type]
    speeds = [r.speed_vs_epoch0 for r in timeline.rows]
    assert speeds[0] == 1.0 and speeds[1] == pytest.approx(1.5, rel=0.01) and speeds[2] == pytest.approx(2.5, rel=0.01)
    assert [r.samples for r in timeline.rows] == [20, 30, 50]
    table = format_table(timeline.rows)
    assert table.splitlines()[0].split()[2] == "speed*"
    assert [line.split()[2] for line in table.splitlines()[2:5]] == ["1.00x", "1.50x", "2.50x"]
    # A run resumed without epoch 0's row has nothing to compare with.
    resumed = PipeTransformerTimeline(print_table=False)
    trainer.current_epoch = 3
    resumed.on_train_epoch_start(trainer, None)  # type: ignore[arg-type]
    resumed.on_train_batch_end(trainer, None, None, batch, 0)  # type: ignore[arg-type]
    resumed.on_train_epoch_end(trainer, None)  # type: ignore[arg-type]
    assert resumed.rows[0].speed_vs_epoch0 is None and format_table(resumed.rows).splitlines()[2].split()[2] == "-"
    # The rows survive a checkpoint.
    restored = PipeTransformerTimeline()
    restored.load_state_dict(timeline.state_dict())
    assert restored.rows == timeline.rows


def test_warns_when_listed_after_autofreeze() -> None:
    """An epoch-level freeze (re-plan, cache advance) runs in AutoFreeze's on_train_epoch_start: a
    timeline listed after it starts the epoch's clock too late and says so."""
    timeline = PipeTransformerTimeline(print_table=False)
    with pytest.warns(UserWarning, match="PipeTransformerTimeline is listed after AutoFreeze"):
        timeline.on_fit_start(_fake_trainer([AutoFreeze(), timeline]), None)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        timeline.on_fit_start(_fake_trainer([timeline, AutoFreeze()]), None)  # type: ignore[arg-type]
        # Sub-epoch points in one process freeze at batch starts, inside the epoch's clock either way.
        timeline.on_fit_start(_fake_trainer([AutoFreeze(freeze_interval=0.5), timeline]), None)  # type: ignore[arg-type]


def test_every_rank_asks_for_the_log_dir_at_fit_end(tmp_path) -> None:
    """``trainer.log_dir`` is a broadcast from rank 0: a rank that skipped it would leave rank 0 waiting
    forever. Every rank reads it; only global rank 0 writes."""

    class Trainer:
        def __init__(self, rank: int) -> None:
            self.is_global_zero, self.asked = rank == 0, 0
            self.default_root_dir, self.callbacks = str(tmp_path), []

        @property
        def log_dir(self) -> str:
            self.asked += 1
            return str(tmp_path / "logs")

    for rank in (0, 1):
        timeline = PipeTransformerTimeline(print_table=False, save_plot=False)
        timeline.rows = [EpochRecord.from_dict(dict(epoch=0, frozen="-", pipe_len="-", replicas="-", cache_hits="-", samples_per_s=1.0,
                                                    train_s=1.0, epoch_s=1.0, total_s=1.0, metric=None))]  # fmt: skip
        trainer = Trainer(rank)
        timeline.on_fit_end(trainer, None)  # type: ignore[arg-type]
        assert trainer.asked == 1, rank
        assert (timeline.json_path is not None) == (rank == 0)
    assert (tmp_path / "logs" / "timeline.json").exists()
