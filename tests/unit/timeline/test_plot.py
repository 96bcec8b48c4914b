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
