"""Lightning's features keep working with idle ranks: one 4-process CPU run (tests/integration/scripts/autodp_features.py).

The run stops early (EarlyStopping) at the end of epoch 1, while two of four ranks are idle, on
metrics only the replicas compute; every rank must take the same decisions and nobody may hang.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import launch_ranks

pytestmark = pytest.mark.distributed  # several processes: deselected by -m "not distributed"

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "autodp_features.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("features")
    proc = launch_ranks(SCRIPT, out, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


def csv_rows(out: Path) -> list[dict[str, str]]:
    with open(out / "logs" / "csv" / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_every_rank_stops_at_the_same_point_with_the_same_checkpoints(run) -> None:
    out, ranks = run
    fit = [r["fit"] for r in ranks]
    # Stopped by EarlyStopping at the end of epoch 1 (of 4), on every rank alike.
    assert {(f["current_epoch"], f["global_step"], f["should_stop"], f["stopped_epoch"]) for f in fit} == {(2, 8 + 4, True, 1)}
    # Two ranks idle at the stop (pipe length 2): local ranks 0 and 2 drive the replicas.
    assert [f["is_active"] for f in fit] == [True, False, True, False]
    assert fit[0]["plan"]["pipe_len"] == 2 and fit[0]["plan"]["active_ranks"] == [0, 2]
    for key in ("best_loss_path", "best_loss_score", "best_acc_path", "last_path"):
        assert len({f[key] for f in fit}) == 1, key
    # Idle ranks saw the replicas' metrics (the monitored ones included).
    for f in fit[1:]:
        for key in ("val_loss", "val_acc", "val_countdown", "train_loss_epoch", "epoch_marker"):
            assert f["callback_metrics"][key] == pytest.approx(fit[0]["callback_metrics"][key]), key

    rows = csv_rows(out)
    logged = [(int(r["epoch"]), float(r["val_loss"])) for r in rows if r.get("val_loss")]
    # Epochs 0 and 1 from fit, then trainer.validate() after it (logged at the final epoch, 2).
    assert [epoch for epoch, _ in logged] == [0, 1, 2]
    assert fit[0]["best_loss_score"] == pytest.approx(min(loss for epoch, loss in logged if epoch < 2))
    saved = sorted(p.name for p in (out / "ckpt").iterdir())
    assert "last.ckpt" in saved and len(saved) == 3, saved  # top-2 of 2 epochs + last
    assert len(list((out / "ckpt_acc").iterdir())) == 1


def test_loggers_got_every_epoch_metric_once(run) -> None:
    out, _ = run
    rows = csv_rows(out)
    for key in ("train_loss_epoch", "epoch_marker", "lr-SGD"):
        assert len([r for r in rows if r.get(key)]) == 2, key
    assert [float(r["epoch_marker"]) for r in rows if r.get("epoch_marker")] == [0.0, 1.0]
    assert len([r for r in rows if r.get("val_acc")]) == 3  # two epochs + validate()
    assert len([r for r in rows if r.get("test_acc")]) == 1
    assert [float(r["lr-SGD"]) for r in rows if r.get("lr-SGD")] == pytest.approx([0.05, 0.025])
    assert any((out / "logs" / "tb" / "version_0").glob("events.out.tfevents.*"))


def test_idle_ranks_skip_the_modules_batch_and_epoch_end_hooks(run) -> None:
    _, ranks = run
    # Rank 0: 8 + 4 batches (1 then 2 replicas over 32 samples, batch 4); rank 2 joined in epoch 1.
    assert ranks[0]["fit"]["hook_calls"]["on_train_batch_end"] == 12
    assert ranks[2]["fit"]["hook_calls"]["on_train_batch_end"] == 4
    assert ranks[2]["fit"]["hook_calls"]["on_train_epoch_end"] == 1
    for idle in (1, 3):
        assert ranks[idle]["hook_calls"] == {}


def test_validate_test_predict_after_fit_with_idle_ranks(run) -> None:
    _, ranks = run
    fit_val_loss = ranks[0]["fit"]["callback_metrics"]["val_loss"]
    # validate() on the trained weights gives the last epoch's validation loss again.
    assert ranks[0]["validate"][0]["val_loss"] == pytest.approx(fit_val_loss, rel=1e-5)
    assert ranks[2]["validate"][0]["val_loss"] == pytest.approx(fit_val_loss, rel=1e-5)
    # test(): torchmetrics synced over the two replicas gives both the same accuracy.
    assert ranks[0]["test"][0]["test_acc"] == ranks[2]["test"][0]["test_acc"]
    # predict(): each replica predicts its half of 16 samples; idle ranks return placeholders.
    assert sum(len(batch) for batch in ranks[0]["predicted"]) == 8
    assert sum(len(batch) for batch in ranks[2]["predicted"]) == 8
    assert ranks[1]["predicted"] == [] and ranks[1]["predict_batches"] == 2
    for key, value in ranks[0]["state"].items():
        torch.testing.assert_close(ranks[2]["state"][key], value, rtol=0, atol=0)
