"""The plot's right panel puts the metric at the training time it was reached, validation left out,
as the table's ``train s`` is, and its x-axis says so."""

from __future__ import annotations

from itertools import accumulate
from pathlib import Path

import pytest

from lightning_pipetransformer.timeline.plot import write_plot
from lightning_pipetransformer.timeline.records import EpochRecord


def test_the_metric_is_plotted_against_training_time_without_validation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure write_plot would close
    rows = [
        EpochRecord(epoch=e, frozen=f"{2 * e}/6", num_frozen=2 * e, pipe_len="1", replicas="1", cache_hits="-", samples_per_s=50.0 * (e + 1),
                    train_s=train_s, epoch_s=train_s + 10.0, total_s=0.0, metric=0.5 + e / 10, speed_vs_epoch0=float(e + 1))
        for e, train_s in enumerate((30.0, 15.0, 10.0))
    ]  # fmt: skip
    write_plot(rows, tmp_path / "timeline.png", "val/acc")
    assert (tmp_path / "timeline.png").stat().st_size > 1000
    titles = {ax.get_title(): ax for ax in figures[0].axes}
    speed, metric = titles["throughput and freezing per epoch"], titles["val/acc after each epoch"]
    assert metric.get_xlabel() == "training time, validation excluded (s)" and metric.get_ylabel() == "val/acc"
    x, y = metric.lines[0].get_data()
    assert list(x) == list(accumulate(r.train_s for r in rows)) == [30.0, 45.0, 55.0]  # not epoch_s (validation in)
    assert list(y) == [r.metric for r in rows]
    assert [t.get_text() for t in speed.texts] == ["1.00x", "2.00x", "3.00x"]  # each bar names its speed vs epoch 0


def _png_width(path: Path) -> int:
    """The image's width in pixels, from the PNG header (IHDR follows the 8-byte signature)."""
    return int.from_bytes(path.read_bytes()[16:20], "big")


def test_the_cache_hits_per_epoch_sit_beside_the_speed_bars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With AutoCache the plot has a middle panel: each epoch's lookups and hits (what explains the speed of
    the epochs after a freeze), labelled with the hit rate; epoch 0 (no store yet) has none. Without a cache
    there is no such panel."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    counts = [(None, None), (0, 2500), (2500, 2500), (2400, 2500)]
    rows = [
        EpochRecord(epoch=e, frozen=f"{2 * e}/6", num_frozen=2 * e, pipe_len="1", replicas="1", cache_hits="-",
                    samples_per_s=50.0 * (e + 1), train_s=10.0, epoch_s=12.0, total_s=0.0, metric=0.8,
                    speed_vs_epoch0=float(e + 1), cache_hit_count=h, cache_lookups=n)
        for e, (h, n) in enumerate(counts)
    ]  # fmt: skip
    write_plot(rows, tmp_path / "cached.png", "val/acc")
    titles = [ax.get_title() for ax in figures[0].axes if ax.get_title()]
    # Beside the speed bars, between them and the metric.
    assert titles == ["throughput and freezing per epoch", "AutoCache hits per epoch", "val/acc after each epoch"]
    hits = next(ax for ax in figures[0].axes if ax.get_title() == "AutoCache hits per epoch")
    lookups_bars, hit_bars = hits.containers
    assert [b.get_height() for b in lookups_bars] == [0, 2500, 2500, 2500]
    assert [b.get_height() for b in hit_bars] == [0, 0, 2500, 2400]
    assert [t.get_text() for t in hits.texts] == ["-", "0%", "100%", "96%"]

    plain = [EpochRecord(**{**vars(r), "cache_hit_count": None, "cache_lookups": None}) for r in rows]
    write_plot(plain, tmp_path / "plain.png", "val/acc")
    assert "AutoCache hits per epoch" not in [ax.get_title() for ax in figures[1].axes]
    assert _png_width(tmp_path / "cached.png") > _png_width(tmp_path / "plain.png")  # the written image has the third panel
