"""What the demo's speed column compares, and the plain fine-tuning reference beside it.

``speed vs epoch 0`` in the timeline is an epoch's samples/s over epoch 0's *of the same run*. A
newcomer asks something else: how much faster than plain fine-tuning? This prints two answers:

* measured now, on this machine: plain fine-tuning (``strategy: auto``, no AutoFreeze, the same
  data, batches and lengths; examples/configs/text_minilm_baseline.yaml) for a few batches, and
  the demo's epochs and total training time against that speed;
* the committed benchmark (3 seeds, its date, its setting): training time and accuracy of full
  fine-tuning and of freeze+cache, from the records in docs/ (no training).

And one a newcomer on a busy machine needs: this machine's speed next to the README's run
(:data:`README_RUN`, the numbers README.md quotes: tests/integration/examples/test_text_example.py
keeps them equal), and whether what is seeded (frozen blocks, cache hits, accuracy) matches it, so
that "slow machine" (only the seconds differ) reads apart from "broken" (the seeded numbers differ)::

    python examples/reference.py outputs/text_minilm_pipetransformer/timeline.json outputs/text_minilm_baseline/timeline.json \\
        --machine THREADS CPUS BUSY     # what scripts/demo.sh measured (examples/machine.py)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "docs" / "time_to_accuracy_25_fc.json"
PAGE = ROOT / "docs" / "benchmarks_25_3seeds.md"
FULL, OURS = "full fine-tuning", "freeze+cache a=1/3"

#: The terminal width the printed lines are wrapped to (the demo's table fits it too).
WIDTH = 80


@dataclass(frozen=True)
class ReadmeRun:
    """The demo run README.md quotes: where and when it ran, and what it measured."""

    date: str
    machine: str
    threads: int
    plain_samples_per_s: float  # plain fine-tuning, the reference run just before the demo
    epoch0_samples_per_s: float
    train_s: float  # the demo's training, validation excluded
    frozen: tuple[str, ...]  # per epoch, as the timeline writes it
    hits: tuple[str, ...]  # per epoch, hits/lookups (None: no store)
    accuracy: tuple[float, ...]  # val/acc per epoch
    epochs: int = 4
    samples_per_epoch: int = 1500


#: README.md's demo run ("The demo"): a run whose seeded numbers differ from these is not merely slow.
README_RUN = ReadmeRun(
    date="2026-12-03", machine="a quiet 2-core CPU", threads=2, plain_samples_per_s=57.1, epoch0_samples_per_s=56.9,
    train_s=62, frozen=("0/6", "2/6", "4/6", "5/6"), hits=("-", "0/2500 (0%)", "2500/2500 (100%)", "2500/2500 (100%)"),
    accuracy=(0.541, 0.813, 0.810, 0.810),
)  # fmt: skip
#: How far the final accuracy may be from the README's and still count as the same run: other thread counts sum in
#: other orders, so the weights differ in their last bits and a few of 1,000 validation snippets can flip.
ACCURACY_SLACK = 0.01

__all__ = ["README_RUN", "WIDTH", "ReadmeRun", "benchmark_lines", "machine_lines", "main", "measured_lines", "report"]


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


def machine_lines(demo_rows: list[dict[str, Any]], baseline_rows: list[dict[str, Any]], machine: tuple[int, int, float] | None,
                  readme: ReadmeRun = README_RUN) -> list[str]:
    """This machine's speed next to the README's run, and whether the seeded numbers match it.

    ``machine``: (torch threads, CPUs, CPUs busy with other work) as scripts/demo.sh measured them.
    The speed compared is plain fine-tuning's (the reference run), else epoch 0's: both train every block.
    """
    here = (
        f"{machine[0]} torch thread(s), {machine[1]} CPU(s) of which {machine[2]:.1f} busy with other work" if machine
        else "this machine"
    )  # fmt: skip
    if baseline_rows:
        what, now, then = "plain fine-tuning", baseline_rows[-1]["samples_per_s"], readme.plain_samples_per_s
    elif demo_rows:
        what, now, then = "epoch 0", demo_rows[0]["samples_per_s"], readme.epoch0_samples_per_s
    else:
        return []
    ratio = then / now if now > 0 else float("inf")
    pace = (
        f"{ratio:.1f}x slower than" if ratio >= 1.15 else f"{1 / ratio:.1f}x faster than" if ratio <= 1 / 1.15
        else "about as fast as"
    )  # fmt: skip
    lines = [
        f"this machine ({here}): {what} at {now:.1f} samples/s, where the README's run ({readme.date}, {readme.machine}, "
        f"{readme.threads} threads) had {then:.1f}: {pace} it. Seconds scale with that (the README's demo trained "
        f"{readme.train_s:.0f} s), and the speed column moves with the load and the threads too; what is seeded "
        "(frozen blocks, cache hits, accuracy) should match."
    ]
    same_setting = len(demo_rows) == readme.epochs and all(r.get("samples") == readme.samples_per_epoch for r in demo_rows)
    if not same_setting:
        return lines + ["not the README's setting (epochs or snippets differ): its frozen blocks, hits and accuracy "
                        "do not apply."]
    differ = []
    if tuple(r["frozen"] for r in demo_rows) != readme.frozen:
        differ.append(f"frozen blocks {', '.join(r['frozen'] for r in demo_rows)} (README: {', '.join(readme.frozen)})")
    if tuple(r["cache_hits"] for r in demo_rows) != readme.hits:
        differ.append(f"cache hits {', '.join(r['cache_hits'] for r in demo_rows)} (README: {', '.join(readme.hits)})")
    final = demo_rows[-1].get("metric")
    if final is None or abs(final - readme.accuracy[-1]) > ACCURACY_SLACK:
        got = "-" if final is None else f"{100 * final:.1f}%"
        differ.append(f"final accuracy {got} (README: {100 * readme.accuracy[-1]:.1f}%)")
    if differ:
        return lines + [f"this run differs from the README's in what a slow machine cannot change: {'; '.join(differ)}."]
    return lines + [
        f"frozen blocks, cache hits and accuracy ({100 * final:.1f}%) match the README's run: nothing is broken; "
        "only this machine's speed differs."
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("demo", type=Path, help="the demo's timeline.json")
    parser.add_argument("baseline", type=Path, nargs="?", help="the baseline run's timeline.json")
    parser.add_argument("--machine", nargs=3, metavar=("THREADS", "CPUS", "BUSY"), default=None,
                        help="torch threads, CPUs and CPUs busy with other work (examples/machine.py's first line)")  # fmt: skip
    args = parser.parse_args(argv)
    demo = _rows(args.demo)
    baseline = _rows(args.baseline) if args.baseline is not None and args.baseline.exists() else []
    machine = (int(args.machine[0]), int(args.machine[1]), float(args.machine[2])) if args.machine else None
    print(report(demo, baseline, machine=machine))


def report(demo_rows: list[dict[str, Any]], baseline_rows: list[dict[str, Any]], width: int = WIDTH,
           machine: tuple[int, int, float] | None = None) -> str:
    """What the demo prints after its table, each statement wrapped to ``width`` columns, as the table
    is: in a terminal of that width a longer line would wrap mid-word (dates and paths are not split).
    This machine's speed against the README's run comes last: the line a newcomer reads first."""
    lines = ["'speed' in the table is samples/s over this run's epoch 0, not over plain fine-tuning."]
    lines += measured_lines(demo_rows, baseline_rows) + benchmark_lines() + machine_lines(demo_rows, baseline_rows, machine)
    wrap = textwrap.TextWrapper(width, initial_indent="reference: ", subsequent_indent="  ", break_on_hyphens=False)
    return "\n".join(wrap.fill(line) for line in lines)


if __name__ == "__main__":
    main()
