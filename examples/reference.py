"""What the demo's speed column compares, and the plain fine-tuning reference beside it.

``speed vs epoch 0`` in the timeline is an epoch's samples/s over epoch 0's *of the same run*. A
newcomer asks something else: how much faster than plain fine-tuning? This prints two answers:

* measured now, on this machine: plain fine-tuning (``strategy: auto``, no AutoFreeze, the same
  data, batches and lengths; examples/configs/text_minilm_baseline.yaml) for a few batches, and
  the demo's epochs and total training time against that speed;
* the committed benchmark (3 seeds, its date, its setting): training time and accuracy of full
  fine-tuning and of freeze+cache, from the records in docs/ (no training)::

    python examples/reference.py outputs/text_minilm_pipetransformer/timeline.json outputs/text_minilm_baseline/timeline.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "docs" / "time_to_accuracy_25_fc.json"
PAGE = ROOT / "docs" / "benchmarks_25_3seeds.md"
FULL, OURS = "full fine-tuning", "freeze+cache a=1/3"

#: The terminal width the printed lines are wrapped to (the demo's table fits it too).
WIDTH = 80

__all__ = ["WIDTH", "benchmark_lines", "main", "measured_lines", "report"]


def _rows(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text())
    return data["rows"] if isinstance(data, dict) else data


def measured_lines(demo_rows: list[dict[str, Any]], baseline_rows: list[dict[str, Any]]) -> list[str]:
    """The demo's epochs against plain fine-tuning's samples/s measured in the baseline run (its last,
    warm epoch: the first pays the warm-up)."""
    if not baseline_rows or not demo_rows:
        return ["reference: no plain fine-tuning run to compare with (the baseline's timeline is missing)."]
    base = baseline_rows[-1]
    plain = base["samples_per_s"]
    per_epoch = ", ".join(f"{r['epoch']}: {r['samples_per_s'] / plain:.2f}x" for r in demo_rows)
    samples = sum(r.get("samples") or r["samples_per_s"] * r["train_s"] for r in demo_rows)
    took = sum(r["train_s"] for r in demo_rows)
    at_plain = samples / plain
    return [
        f"plain fine-tuning (strategy auto, no AutoFreeze, same data, batches and lengths), measured just now over "
        f"{base.get('samples') or '?'} samples: {plain:.1f} samples/s (its last epoch, a few batches of varying lengths: an approximate figure).",
        f"this run's samples/s over plain fine-tuning's, per epoch: {per_epoch}.",
        f"this run's training, validation excluded: {took:.0f} s; at plain fine-tuning's speed the same samples take "
        f"{at_plain:.0f} s ({at_plain / took:.2f}x). Accuracy is not compared here: see the benchmark below.",
    ]


def benchmark_lines(records: Path = RECORDS, page: Path = PAGE) -> list[str]:
    """Full fine-tuning vs freeze+cache from the committed records: mean training time and final accuracy."""
    data = json.loads(records.read_text())
    args = data["args"]
    found = re.search(r"on (\d{4}-\d{2}-\d{2})", page.read_text()) if page.exists() else None
    date = found.group(1) if found else "date unknown"

    def mean(variant: str, what: str) -> tuple[float, int]:
        runs = [r for r in data["records"] if r["variant"] == variant and not r.get("error")]
        if not runs:
            raise ValueError(f"{records.name} has no run of {variant!r}")
        values = [sum(e["train_s"] for e in r["epochs"]) if what == "train_s" else 100 * r["final_full_acc"] for r in runs]
        return statistics.fmean(values), len(runs)

    (full_s, n), (ours_s, _) = mean(FULL, "train_s"), mean(OURS, "train_s")
    (full_acc, _), (ours_acc, _) = mean(FULL, "acc"), mean(OURS, "acc")
    return [
        f"the committed benchmark ({page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name}, {date}; "
        f"{args['train_size']:,} snippets, {args['epochs']} epochs, batch {args['batch_size']} x {args['max_length']} tokens, "
        f"{n} seeds, {args['threads']} CPU thread(s)): full fine-tuning {full_s:.0f} s of training, {full_acc:.2f}% accuracy; "
        f"freeze+cache (AutoFreeze alpha 1/3 + AutoCache) {ours_s:.0f} s ({full_s / ours_s:.2f}x less), "
        f"{ours_acc:.2f}% ({ours_acc - full_acc:+.2f} points).",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("demo", type=Path, help="the demo's timeline.json")
    parser.add_argument("baseline", type=Path, nargs="?", help="the baseline run's timeline.json")
    args = parser.parse_args(argv)
    demo = _rows(args.demo)
    baseline = _rows(args.baseline) if args.baseline is not None and args.baseline.exists() else []
    print(report(demo, baseline))


def report(demo_rows: list[dict[str, Any]], baseline_rows: list[dict[str, Any]], width: int = WIDTH) -> str:
    """What the demo prints after its table, each statement wrapped to ``width`` columns, as the table
    is: in a terminal of that width a longer line would wrap mid-word (dates and paths are not split)."""
    lines = ["'speed' in the table is samples/s over this run's epoch 0, not over plain fine-tuning."]
    lines += measured_lines(demo_rows, baseline_rows) + benchmark_lines()
    wrap = textwrap.TextWrapper(width, initial_indent="reference: ", subsequent_indent="  ", break_on_hyphens=False)
    return "\n".join(wrap.fill(line) for line in lines)


if __name__ == "__main__":
    main()
