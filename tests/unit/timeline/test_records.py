"""The timeline's words: the table fits 80 columns, the summary adds up, the JSON rows round-trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_pipetransformer.timeline.records import COLUMNS, EpochRecord, format_table, freeze_summary, to_json


def row(epoch: int, n_frozen: int | None, samples: int, train_s: float, **kw) -> EpochRecord:
    base = dict(
        epoch=epoch, frozen=f"{n_frozen}/6" if n_frozen is not None else "-", num_frozen=n_frozen, pipe_len="-", replicas="-",
        cache_hits="-", samples=samples, samples_per_s=samples / train_s, train_s=train_s, epoch_s=train_s + 1, total_s=0.0,
        metric=0.5 + epoch / 100,
    )  # fmt: skip
    base.update(kw)
    return EpochRecord(**base)


def test_the_table_fits_80_columns_even_with_large_numbers_and_a_long_metric_name() -> None:
    rows = [
        row(e, min(e * 5, 23), 1_234_567, 12345.6, frozen=f"{min(e * 5, 23)}/24", pipe_len="8", replicas="16",
            cache_hits="x", cache_hit_count=987_654 * e, cache_lookups=999_999, speed_vs_epoch0=123.45)
        for e in range(12)
    ]  # fmt: skip
    table = format_table(rows, "val/multiclass_accuracy_macro_averaged")
    lines = table.splitlines()
    assert max(len(line) for line in lines) <= 80, "\n" + table
    head = lines[0].split()
    assert head[:6] == ["epoch", "frozen", "pipe", "replicas", "cache", "hits"] and head[-1] == "val/multicla"
    assert "988k/1.0M" in lines[3]  # 987,654 hits of 999,999 lookups in epoch 1, compact
    assert all(len(line.split()) == 9 for line in lines[2:14])  # every cell of every row is there


def test_columns_without_content_are_left_out_and_named() -> None:
    rows = [row(0, 0, 100, 10.0, speed_vs_epoch0=1.0), row(1, 2, 100, 5.0, speed_vs_epoch0=2.0)]
    table = format_table(rows, "val/acc")
    head = table.splitlines()[0].split()
    assert head == ["epoch", "frozen", "samples/s", "speed*", "train", "s", "val/acc"]
    words = " ".join(table.split())  # the notes under the table are wrapped at 80 columns
    assert "Not shown (nothing to show in this run): pipe, replicas, cache hits." in words
    assert "epoch 0 trains every block" in words and "not a comparison with a separate plain fine-tuning run" in words
    assert [line.split()[3] for line in table.splitlines()[2:4]] == ["1.00x", "2.00x"]
    assert max(len(line) for line in table.splitlines()) <= 80


def test_the_summary_says_what_was_frozen_when_and_what_it_saved() -> None:
    rows = [row(0, 0, 1000, 10.0), row(1, 2, 1000, 5.0), row(2, 4, 1000, 2.5)]
    text = freeze_summary(rows, [(1, 2), (2, 4)], 6)
    # 3,000 samples at epoch 0's 100/s would take 30 s; they took 17.5 s.
    assert text.startswith("Timeline: froze 2/6 blocks in epoch 1, 4/6 blocks in epoch 2;")
    assert "training 18 s (validation excluded) against 30 s at epoch 0's samples/s: saved 12 s (1.71x" in text
    assert "epoch 0 trains every block" in text
    slower = freeze_summary([row(0, 0, 1000, 10.0), row(1, 0, 1000, 12.0)], [], 6)
    assert "nothing frozen (0/6 blocks)" in slower and "cost 2 s more" in slower
    assert "no AutoFreeze" in freeze_summary([row(0, None, 10, 1.0)], [], None)


def test_json_holds_the_rows_their_meaning_and_the_summary() -> None:
    rows = [row(0, 0, 64, 2.0, cache_hit_count=None), row(1, 1, 64, 1.0, cache_hits="30/32 (94%)", cache_hit_count=30, cache_lookups=32)]
    data = json.loads(json.dumps(to_json(rows, "val/acc", "Timeline: ...")))
    assert data["monitor"] == "val/acc" and data["summary"] == "Timeline: ..."
    assert set(data["rows"][0]) == set(COLUMNS), "every field is described, and only fields are"
    assert [EpochRecord.from_dict(r) for r in data["rows"]] == rows
    # A row saved by the example's earlier timeline (no num_frozen, samples, counts) still loads.
    old = {k: v for k, v in data["rows"][1].items() if k not in ("num_frozen", "samples", "cache_hit_count", "cache_lookups")}
    assert EpochRecord.from_dict({**old, "unknown_later_field": 1}).cache_hits == "30/32 (94%)"


@pytest.mark.parametrize("speed", [None, 1.0])
def test_a_row_without_epoch_0_has_no_speed(speed) -> None:
    table = format_table([row(3, 1, 10, 1.0, speed_vs_epoch0=speed)])
    cell = table.splitlines()[2].split()[3]
    assert cell == ("-" if speed is None else "1.00x")
    assert "no epoch-0 row" in " ".join(table.split())


GUIDE = Path(__file__).resolve().parents[3] / "docs" / "user-guide.md"


def test_the_user_guides_sample_table_and_summary_are_what_the_timeline_prints() -> None:
    guide = GUIDE.read_text()
    start = guide.index("```\nepoch  frozen") + 4
    sample = guide[start : guide.index("```", start)].splitlines()
    rows = [
        row(0, 0, 1500, 30.0, pipe_len="1", replicas="1", speed_vs_epoch0=1.0, metric=0.541),
        row(1, 2, 1500, 22.0, pipe_len="1", replicas="1", cache_hits="0/2500 (0%)", cache_hit_count=0, cache_lookups=2500,
            speed_vs_epoch0=(1500 / 22.0) / 50.0, metric=0.813),
    ]  # fmt: skip
    assert format_table(rows, "val/acc").splitlines()[: len(sample)] == sample
    # 3,000 samples at epoch 0's 1000/40 s take 120 s; they took 40 + 20 + 17 = 77 s.
    summary = freeze_summary([row(0, 0, 1000, 40.0), row(1, 2, 1000, 20.0), row(2, 4, 1000, 17.0)], [(1, 2), (2, 4)], 6)
    assert f'"{summary}"' in " ".join(guide.split()), summary
