"""``python -m benchmarks.sweep_cache``: the runs of a seed sweep with the cache kept across runs, per run, and none."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from benchmarks.time_to_accuracy.data import BenchData
from benchmarks.time_to_accuracy.models import MODELS
from benchmarks.time_to_accuracy.runner import evaluate, quiet
from examples.assets import fetch
from examples.text_classification import SentimentClassifier
from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy

ROOT = Path(__file__).resolve().parents[2]
ROWS = ("full", "per-run", "kept")

#: The 12-layer setting (docs/benchmarks_12layer.md): MPNet-base, its best frozen row (embeddings + 6 lower blocks).
PRESETS: dict[str, dict[str, Any]] = {
    "mpnet-base": {"frozen": 6, "train_size": 1500, "val_size": 1500, "epochs": 3, "seeds": "0,1,2"},
    "minilm-l6": {"frozen": 3, "train_size": 3000, "val_size": None, "epochs": 5, "seeds": "0,1,2"},
}
#: ``--smoke``: does it run (MiniLM, a few dozen snippets, two seeds: a minute or two on one loaded core).
SMOKE: dict[str, Any] = {
    "model": "minilm-l6", "frozen": 3, "train_size": 64, "val_size": 32, "epochs": 2, "seeds": "0,1", "batch_size": 16,
    "max_length": 32,
}


@dataclass
class SweepRun:
    """One run of the sweep: its row, seed, training seconds, what the cache served and the final accuracy."""

    row: str
    seed: int
    train_s: float = 0.0
    epoch_s: list[float] = field(default_factory=list)
    first_epoch_hits: float | None = None
    first_epoch_lookups: float | None = None
    #: Batches of the first epoch the cache did not look up (the first step while the call order is unknown, when
    #: it cannot be served: see docs/cache.md).
    first_epoch_bypassed: float | None = None
    acc: float | None = None


class EpochClock(pl.Callback):
    """Seconds of each training epoch (from its start to its end: a freeze and a cache open at its start count),
    and the cache's hits and lookups in the first one."""

    def __init__(self, record: SweepRun) -> None:
        self.record, self._start = record, 0.0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.record.epoch_s.append(time.perf_counter() - self._start)
        stats = getattr(trainer.strategy, "cache_stats", None)
        if stats and self.record.first_epoch_hits is None:
            self.record.first_epoch_hits = stats["autocache/hits"]
            self.record.first_epoch_lookups = stats["autocache/hits"] + stats["autocache/misses"]
            self.record.first_epoch_bypassed = stats["autocache/batches_bypassed"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep_cache", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="mpnet-base", help="the encoder (default: the 12-layer setting's)")
    p.add_argument("--smoke", action="store_true", help="MiniLM, 64/32 snippets, 2 epochs, seeds 0,1: does it run")
    p.add_argument("--frozen", type=int, default=None, help="lower blocks frozen with the embeddings from the first step")
    p.add_argument("--seeds", default=None, help="comma-separated seeds: the runs of the sweep")
    p.add_argument("--rows", default=",".join(ROWS), help=f"any of {','.join(ROWS)}")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--train-size", type=int, default=None)
    p.add_argument("--val-size", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None, help="default 32 (smoke 16)")
    p.add_argument("--max-length", type=int, default=None, help="tokens per snippet at most; default 64 (smoke 32)")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--device", dest="accelerator", default="cpu", help="cpu or cuda")
    p.add_argument("--cache-dir", type=Path, default=None, help="the kept row's folder (default: a fresh one, removed after)")
    p.add_argument("--json", type=Path, default=ROOT / "outputs" / "benchmarks" / "sweep_cache.json")
    p.add_argument("--docs", type=Path, default=None, help="write the report (markdown) here")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = _parser()
    args = p.parse_args(argv)
    if args.smoke:
        args.model = SMOKE["model"]
    # What the command line leaves open comes from the smoke preset or the model's.
    for key, value in {"batch_size": 32, "max_length": 64, **(SMOKE if args.smoke else PRESETS[args.model])}.items():
        if key != "model" and getattr(args, key) is None:
            setattr(args, key, value)
    args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.row_list = [r.strip() for r in args.rows.split(",") if r.strip()]
    if not args.row_list or any(r not in ROWS for r in args.row_list):
        p.error(f"--rows takes any of {','.join(ROWS)}, got {args.rows!r}.")
    if not 0 < args.frozen < MODELS[args.model].blocks:
        p.error(f"--frozen must be in 1..{MODELS[args.model].blocks - 1}, got {args.frozen}.")
    return args


def run_one(row: str, seed: int, dm: BenchData, args: argparse.Namespace, model_dir: str, kept_dir: Path) -> SweepRun:
    """Fit one run of the sweep and time its training epochs."""
    record = SweepRun(row=row, seed=seed)
    per_run = Path(tempfile.mkdtemp(prefix="sweep-per-run-")) if row == "per-run" else None
    try:
        dm.seed = seed
        pl.seed_everything(seed, workers=True, verbose=False)  # the head's init, the data order, dropout
        model = SentimentClassifier(pretrained=model_dir, lr=args.lr)
        callbacks: list[pl.Callback] = [EpochClock(record)]
        strategy: Any = "auto"
        if row != "full":
            spec = MODELS[args.model]
            extra = {"pre": list(spec.pre)} if spec.pre is not None else {}
            callbacks.append(AutoFreeze(schedule={0: args.frozen}, **extra))
            folder = kept_dir if row == "kept" else per_run
            strategy = PipeTransformerStrategy(pipe_len=1, cache=True, cache_dir=str(folder), cache_keep=row == "kept")
        trainer = pl.Trainer(
            accelerator=args.accelerator, devices=1, strategy=strategy, precision="32-true", max_epochs=args.epochs,
            callbacks=callbacks, num_sanity_val_steps=0, limit_val_batches=0, enable_checkpointing=False, logger=False,
            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        )  # fmt: skip
        trainer.fit(model, datamodule=dm)
        record.train_s = sum(record.epoch_s)
        record.acc = evaluate(model, dm.full_val_dataloader(), "cuda" if args.accelerator in ("cuda", "gpu") else "cpu")
    finally:
        if per_run is not None:
            shutil.rmtree(per_run, ignore_errors=True)
    return record


def report(records: list[SweepRun], args: argparse.Namespace) -> str:
    """Each run, then each row's total over the sweep against full fine-tuning's."""
    lines = [
        f"Sweep of {len(args.seed_list)} seeds, {MODELS[args.model].title}, embeddings + {args.frozen} lower blocks frozen from "
        f"the first step, {args.epochs} epoch(s), {args.train_size} training snippets.",
        "",
        "| row | seed | train s | per epoch s | first-epoch hits (lookups; batches computed without a lookup) | accuracy |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for r in records:
        hits = "-"
        if r.first_epoch_lookups:
            hits = f"{r.first_epoch_hits:.0f} of {r.first_epoch_lookups:.0f}; {r.first_epoch_bypassed:.0f}"
        acc = f"{100 * r.acc:.2f}%" if r.acc is not None else "-"
        lines.append(f"| {r.row} | {r.seed} | {r.train_s:.1f} | {' / '.join(f'{s:.1f}' for s in r.epoch_s)} | {hits} | {acc} |")
    totals = {row: sum(r.train_s for r in records if r.row == row) for row in args.row_list}
    lines += ["", "| row | sweep total train s | vs full fine-tuning | runs after the first, each vs full |"]
    lines += ["|---|---:|---:|---|"]
    full = totals.get("full")
    full_runs = {r.seed: r.train_s for r in records if r.row == "full"}
    for row, total in totals.items():
        ratio = f"{full / total:.2f}x" if full and total else "-"
        later = [r for r in records if r.row == row and r.seed != args.seed_list[0]]
        each = ", ".join(f"{full_runs[r.seed] / r.train_s:.2f}x" for r in later if r.seed in full_runs and r.train_s) or "-"
        lines.append(f"| {row} | {total:.1f} | {ratio} | {each} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    quiet()
    torch.set_num_threads(args.threads)
    spec = MODELS[args.model]
    model_dir = str(fetch(spec.asset))
    dm = BenchData(
        seed=args.seed_list[0], padding="bucket", tokenizer=model_dir, train_size=args.train_size, val_size=args.val_size,
        max_length=args.max_length, batch_size=args.batch_size,
    )  # fmt: skip
    dm.setup("fit")
    kept_dir = args.cache_dir or Path(tempfile.mkdtemp(prefix="sweep-kept-"))
    records: list[SweepRun] = []
    try:
        for seed in args.seed_list:  # seeds outside, rows inside: the rows share the machine's noise
            for row in args.row_list:
                record = run_one(row, seed, dm, args, model_dir, kept_dir)
                records.append(record)
                served = (
                    f", first epoch {record.first_epoch_hits:.0f}/{record.first_epoch_lookups:.0f} hits, "
                    f"{record.first_epoch_bypassed:.0f} batch(es) not looked up" if record.first_epoch_lookups else ""
                )
                acc = 100 * (record.acc or 0)
                print(f"sweep_cache: seed {seed} {row}: train {record.train_s:.1f} s{served}, acc {acc:.2f}%", flush=True)
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                 "records": [asdict(r) for r in records]}, indent=1))
    finally:
        if args.cache_dir is None:
            shutil.rmtree(kept_dir, ignore_errors=True)
    text = report(records, args)
    print("\n" + text, flush=True)
    if args.docs is not None:
        args.docs.parent.mkdir(parents=True, exist_ok=True)
        args.docs.write_text(f"# Sweep with a kept cache (issue 42)\n\n{text}\n")
    return 0
