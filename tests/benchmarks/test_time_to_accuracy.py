"""The time-to-accuracy benchmark's own logic (issue 25), without training: the check points and the
time to accuracy read from them, the target, the validation subset, the training clock that stops
during validation, the new rows' names and plans, and ``--resume`` with the records of the earlier run."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import pytest
import torch

from benchmarks.time_to_accuracy import cli
from benchmarks.time_to_accuracy.data import BenchData
from benchmarks.time_to_accuracy.estimate import planned_frozen
from benchmarks.time_to_accuracy.runner import CheckClock, StepClock, check_interval
from benchmarks.time_to_accuracy.summary import summarize
from benchmarks.time_to_accuracy.variants import RunRecord, Variant, llrd_variants, smooth_variants

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "docs" / "time_to_accuracy.json"


def epoch(train_s: float, metric: float) -> dict:
    return {"epoch": 0, "frozen": "-", "pipe_len": "-", "replicas": "-", "cache_hits": "-", "samples_per_s": 1.0,
            "train_s": train_s, "epoch_s": train_s + 1.0, "total_s": 0.0, "metric": metric}  # fmt: skip


def record(variant: str, seed: int, checks: list[tuple[float, float]], final: float) -> RunRecord:
    return RunRecord(
        variant=variant, seed=seed, epochs=[epoch(checks[-1][0], checks[-1][1])],
        checks=[{"step": 10 * (i + 1), "train_s": t, "acc": a} for i, (t, a) in enumerate(checks)], final_full_acc=final,
    )  # fmt: skip


def test_time_to_accuracy_is_the_first_check_at_or_above_the_target_interpolating_nothing():
    r = record("x", 0, [(10.0, 0.70), (20.0, 0.795), (30.0, 0.80), (40.0, 0.79)], final=0.81)
    assert r.time_to(0.80) == 30.0  # not 20 + something: nothing between checks
    assert r.time_to(0.795) == 20.0
    assert r.time_to(0.90) is None
    assert r.final_acc == 0.81 and r.final_check_acc == 0.79  # the whole set vs the last check


def test_the_older_records_read_as_before():
    # Records from before issue 25: no checks, the whole set at every epoch end.
    old = RunRecord(variant="x", seed=0, epochs=[epoch(50.0, 0.78), epoch(60.0, 0.80)])
    assert old.points == [(50.0, 0.78), (110.0, 0.80)]
    assert old.time_to(0.79) == 110.0 and old.final_acc == 0.80 == old.final_check_acc
    saved = json.loads(RECORDS.read_text())["records"][0]
    assert RunRecord(**saved).final_acc == saved["epochs"][-1]["metric"]


def test_the_target_is_the_baselines_last_check_on_the_subset_and_tta_tells_rows_apart():
    variants = [Variant("full"), Variant("cache", 1 / 3, "1/3", rule="paper", interval=0.25, interval_text="0.25", anneal="cosine")]
    base = [record("full fine-tuning", s, [(10.0, 0.70), (20.0, 0.80), (30.0, 0.82)], final=0.80 + s / 100) for s in (0, 1)]
    fast = [record(variants[1].name, s, [(5.0, 0.75), (9.0, 0.817), (12.0, 0.818)], final=0.80) for s in (0, 1)]
    rows, target = summarize(base + fast, variants)
    assert target == pytest.approx(0.82 - 0.003)  # the subset's 0.82, not the whole set's 0.805
    by = {r["variant"]: r for r in rows}
    assert by["full fine-tuning"]["tta"][0] == 30.0
    assert by[variants[1].name]["tta"][0] == 9.0 and by[variants[1].name]["tta_speedup"] == pytest.approx(30 / 9)
    assert by[variants[1].name]["delta"] == pytest.approx(80.0 - 80.5)  # the goal: final accuracies, the whole set
    slow = [record(variants[1].name, 0, [(5.0, 0.75), (12.0, 0.80)], final=0.80), fast[1]]
    rows, _ = summarize(base + slow, variants)
    assert math.isnan(rows[1]["tta"][0]) and rows[1]["tta_reached"] == "1/2"


def test_checks_every_quarter_epoch_fall_on_the_quarter_epoch_freeze_points():
    args = types.SimpleNamespace(val_every=0.25, val_subset=1000)
    assert check_interval(args, 98) == 24  # AutoFreeze(freeze_interval=0.25) on 98 steps: points every 24
    assert check_interval(types.SimpleNamespace(val_every=1.0, val_subset=None), 98) is None  # the older schedule
    assert check_interval(types.SimpleNamespace(val_every=1.0, val_subset=500), 98) == 98


class FakeEncoded:
    """What BenchData reads of a side: lengths from the attention mask, batches by index."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(3)
        lengths = torch.randint(3, 16, (n,), generator=g)
        self.attention_mask = (torch.arange(16)[None, :] < lengths[:, None]).long()
        self.input_ids = self.attention_mask.clone()
        self.labels = torch.zeros(n, dtype=torch.long)
        self.index = torch.arange(n)

    def __len__(self) -> int:
        return len(self.index)

    def __getitems__(self, indices):
        idx = torch.tensor(indices)
        return {"input_ids": self.input_ids[idx], "attention_mask": self.attention_mask[idx], "labels": self.labels[idx], "index": idx}


def test_the_validation_subset_is_fixed_and_the_same_for_every_training_seed():
    def data(seed: int, subset: int | None) -> BenchData:
        dm = BenchData(seed=seed, val_subset=subset, val_batch_size=16)
        dm.val_set = FakeEncoded(100)  # type: ignore[assignment]
        return dm

    a, b = data(0, 30), data(7, 30)
    assert a.subset_indices() == b.subset_indices() and len(a.subset_indices() or []) == 30
    seen = sorted(i for batch in a.val_dataloader() for i in batch["index"].tolist())
    assert seen == a.subset_indices()
    assert sorted(i for batch in a.full_val_dataloader() for i in batch["index"].tolist()) == list(range(100))
    assert data(0, None).subset_indices() is None and data(0, 500).subset_indices() is None  # the whole set
    other = BenchData(val_subset=30, val_subset_seed=1)
    other.val_set = FakeEncoded(100)  # type: ignore[assignment]
    assert other.subset_indices() != a.subset_indices()
    with pytest.raises(ValueError, match="val_subset"):
        BenchData(val_subset=0)


def test_the_training_clocks_stop_during_a_validation_check(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("benchmarks.time_to_accuracy.runner.time.perf_counter", lambda: now[0])
    trainer = types.SimpleNamespace(sanity_checking=False, global_step=0, callback_metrics={"val/acc": torch.tensor(0.5)}, callbacks=[])
    checks, steps = CheckClock(), StepClock()
    for c in (checks, steps):
        c.on_train_epoch_start(trainer, None)  # type: ignore[arg-type]
    now[0] = 3.0  # a batch of 3 s
    steps.on_train_batch_end(trainer, None, None, None, 0)  # type: ignore[arg-type]
    trainer.global_step = 1
    for c in (checks, steps):
        c.on_validation_start(trainer, None)  # type: ignore[arg-type]
    now[0] = 13.0  # validation: 10 s
    for c in (checks, steps):
        c.on_validation_end(trainer, None)  # type: ignore[arg-type]
    now[0] = 15.0  # the next batch: 2 s
    steps.on_train_batch_end(trainer, None, None, None, 1)  # type: ignore[arg-type]
    checks.on_train_epoch_end(trainer, None)  # type: ignore[arg-type]
    assert checks.checks == [{"step": 1, "train_s": 3.0, "acc": 0.5}]
    assert checks.train_s == 5.0
    assert steps.seconds == {"0": 5.0} and steps.steps == {"0": 2}


def args_for(argv: list[str]):
    return cli.parse_args(argv)


def test_the_new_rows_are_new_names_and_the_old_names_stay():
    args = args_for([])
    names = [v.name for v in smooth_variants(args)] + [v.name for v in llrd_variants(args)]
    assert names == [
        "freeze+cache paper a=1/3, every 0.25 epoch, anneal cosine",
        "freeze+cache paper a=1/3, every 0.25 epoch, anneal cosine, LLRD 0.8",
        "freeze+cache autofreeze p50, every 0.5 epoch, anneal cosine",
        "freeze+cache autofreeze p50, every 0.5 epoch, anneal cosine, LLRD 0.8",
        "freeze+cache autofreeze p50, every 0.25 epoch, anneal cosine",
        "freeze+cache autofreeze p50, every 0.25 epoch, anneal cosine, LLRD 0.8",
        "full fine-tuning, LLRD 0.8",
    ]
    old = {r["variant"] for r in json.loads(RECORDS.read_text())["records"]}
    assert "freeze+cache paper a=1/3, every 0.25 epoch" in old and not old & set(names)
    assert Variant("full").baseline and not llrd_variants(args)[0].baseline
    assert not smooth_variants(args_for(["--llrd", "none"]))[1].llrd  # no LLRD copies


def test_smooth_gradient_rules_are_planned_one_interval_later():
    args = args_for([])
    plain = Variant("cache", 1 / 3, "1/3", rule="paper", interval=0.25, interval_text="0.25")
    smooth = smooth_variants(args)[0]
    a, b = planned_frozen(plain, 5, 98, args), planned_frozen(smooth, 5, 98, args)
    assert a.index(next(f for f in a if f)) == 24 and b.index(next(f for f in b if f)) == 48


def test_resume_with_the_earlier_records_is_a_fresh_run_or_adds_rows_under_their_schedule(tmp_path):
    args = args_for(["--threads", "2", "--resume", str(RECORDS)])
    args.steps_per_epoch = 98
    with pytest.raises(SystemExit, match="fresh --json"):
        cli.resumed_records(args, [Variant("full")])
    legacy = args_for(["--threads", "2", "--resume", str(RECORDS), "--val-every", "1", "--val-subset", "all"])
    new = smooth_variants(legacy)
    kept = cli.resumed_records(legacy, [Variant("full"), *new])
    assert {name for name, _ in kept} == {"full fine-tuning"} and {seed for _, seed in kept} == {0, 1, 2}
    # A row's own argument changed: that row reruns, the others stay.
    bft = Variant("bft", detail="(embeddings + 3 lower blocks)")
    changed = args_for(["--threads", "2", "--resume", str(RECORDS), "--val-every", "1", "--val-subset", "all", "--bft-blocks", "2"])
    assert cli.resumed_records(changed, [Variant("full"), bft]).keys() == kept.keys()
