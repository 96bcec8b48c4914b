"""Time-to-accuracy on real data: full fine-tuning vs AutoFreeze vs AutoFreeze + AutoCache (issue 8).

The pretrained MiniLM-L6 (a 6-block BERT) fine-tuned on Rotten Tomatoes sentiment snippets (split by
movie), with the example's data module and LightningModule (``examples/``). Variants, all in ONE
invocation, interleaved per seed (seed loop outer, variants inner) so they share the machine's noise:

1. ``full``          plain Lightning fine-tuning, single-device strategy: the baseline;
2. ``freeze``        ``AutoFreeze(alpha, rule)`` + ``PipeTransformerStrategy(pipe_len=1, cache=False)``;
3. ``freeze+cache``  ``AutoFreeze`` + ``PipeTransformerStrategy(pipe_len=1, cache=True)``.

freeze and freeze+cache share the strategy so that the cache is their only difference: Lightning's
DDP-family strategies (ours included) re-seed torch at fit start (``reset_seed()`` in
``setup_distributed``) and the single-device strategy does not, so the dropout stream of a run under
``"auto"`` differs from one under ``"pipetransformer"`` with the same seed. With one strategy, cache
off and on train bit-for-bit the same model (AutoCache is exact), and their accuracies are equal.

Every variant of a seed sees the same data, the same batches in the same order (a loader with its
own seeded generator) and the same classifier-head initialisation. Reported per variant: total
training time for the epoch budget (validation excluded), time per epoch, final validation accuracy,
time-to-accuracy (training time until the baseline's mean final accuracy minus 0.3 points is first
reached, from per-epoch validation) and the validation time itself. Mean and spread over the seeds::

    python benchmarks/time_to_accuracy.py --smoke                              # a few minutes
    python benchmarks/time_to_accuracy.py --write                              # the benchmark (~1-2 h on 2 cores)
    python benchmarks/time_to_accuracy.py --variants full,cache --alphas 1/4,1/3,1/2 --write   # alpha sweep

``--write`` writes ``docs/benchmarks.md`` and ``docs/benchmarks_time_to_accuracy.png``; ``--docs PATH``
writes the report elsewhere, its PNG next to it (``<stem>_time_to_accuracy.png``), so a partial run does
not overwrite the full benchmark's report. Without ``full`` in ``--variants`` there is no baseline: no
accuracy target or time-to-accuracy, and freeze+cache's speed-up is against freeze at the same alpha
(cache off vs on); such a run needs its own ``--docs``. Raw per-run records always go to ``--json``
(default ``outputs/benchmarks/time_to_accuracy.json``, or ``<docs stem>.json`` there with another ``--docs``). The cache's footprint (bytes in host memory
and on disk at each epoch end, from the strategy's ``cache_stats``) is in the per-epoch and summary
tables::

    python benchmarks/time_to_accuracy.py --variants freeze,cache --seeds 0 --write --docs docs/cache_benchmark.md

Padding (``--padding``, the same for every variant): ``bucket`` (default) pads each sample to its
own length rounded up to a multiple of 8 and draws each batch from samples of one such length
(random composition each epoch), so a sample's input is identical every epoch: AutoCache's content
keys hit, and batches carry far less padding than with ``trim`` (the example's per-batch trim to the
longest snippet, where a sample's padded length depends on its batch-mates and content keys then
miss) or ``max`` (always ``--max-length`` tokens).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # assets, rotten_tomatoes, text_classification, timeline

from text_classification import SentimentClassifier  # noqa: E402  (sets HF_HUB_OFFLINE before transformers)

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Sampler  # noqa: E402

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy  # noqa: E402
from lightning_pipetransformer.core.freeze_rules import geometric_num_frozen  # noqa: E402
from rotten_tomatoes import Batch, EncodedDataset, RottenTomatoesDataModule, collate_trimmed  # noqa: E402
from timeline import Timeline  # noqa: E402

__all__ = ["BenchData", "LengthBucketBatches", "RunRecord", "Variant", "main"]

Padding = Literal["bucket", "trim", "max"]
Kind = Literal["full", "freeze", "cache"]

#: What the issue measured with a plain PyTorch loop on a 2-core machine (3,008 train snippets,
#: 5 epochs, batch 32, AdamW 5e-5, geometric schedule, idealised cache, 2,000 val snippets).
ANCHOR = (
    ("full fine-tuning", "487 s", "1.00x", "79.75%"),
    ("freeze, alpha=1/3", "289 s", "1.69x", "80.05%"),
    ("freeze + cache, alpha=1/3", "244 s", "2.00x", "80.05%"),
    ("freeze + cache, alpha=1/2", "214 s", "2.28x", "78.95%"),
    ("freeze + cache, alpha=1/4", "284 s", "1.71x", "79.90%"),
)
OTHER_TABLES = (
    ("docs/executor.md", "pipeline executor overhead per micro-batch and pipe length (CPU)"),
    ("docs/planner.md", "AutoPipe: paper greedy vs exact partition, compression sequence"),
    ("docs/cache.md", "AutoCache: lookup vs recompute per sample, storage and keys"),
    ("docs/cost_model.md", "simulated multi-GPU speed-ups, validated against the paper"),
    ("docs/autofreeze.md", "step time with 0..L-1 frozen blocks (no cache)"),
    ("docs/autodp.md", "AutoDP: one transition of BERT-base on 4 CPU processes, per phase (transition-time table)"),
    ("docs/cache_benchmark.md", "AutoCache off vs on in this setting (one seed): time per epoch, accuracy, bytes used"),
)
#: Per-step milliseconds of MiniLM-L6 at batch 32 x 64 tokens on an idle 2-core CPU, fused AdamW
#: (measured once with examples/text_classification.py): {frozen blocks: ms} without / with the frozen prefix cached.
STEP_MS = {0: 1059.0, 2: 783.0, 4: 484.0, 5: 377.0, 6: 300.0}
STEP_MS_CACHED = {0: 1059.0, 2: 656.0, 4: 310.0, 5: 148.0, 6: 60.0}
NO_GRAD_MS_PER_TOKEN = 200.0 / (32 * 48)  # validation forward: ~0.2 s per 32 x 48 batch
ADVANCE_S_PER_BLOCK_PER_SAMPLE = 5.0 / 3008  # cache boundary advance: ~5 s per block over 3,008 snippets
SETUP_S = 5.0  # model load + Trainer set-up per run
#: Settings of the benchmark and of ``--smoke`` (one thread: on a machine busy with other jobs,
#: two OpenMP threads spinning against them made steps ~9x slower in our smoke runs).
FULL: dict[str, Any] = {"train_size": 3000, "val_size": None, "epochs": 5, "seeds": "0,1,2"}
SMOKE: dict[str, Any] = {"train_size": 960, "val_size": 320, "epochs": 3, "seeds": "0,1", "threads": 1}
DEFAULT_DOCS = ROOT / "docs" / "benchmarks.md"


def plot_path_for(docs: Path) -> Path:
    """The PNG next to a report: docs/benchmarks.md -> docs/benchmarks_time_to_accuracy.png (the historic
    name); docs/cache_benchmark.md -> docs/cache_benchmark_time_to_accuracy.png, never the other's."""
    return docs.with_name(f"{docs.stem}_time_to_accuracy.png")


# ---------------------------------------------------------------------------------------- data


def padded_length(lengths: torch.Tensor, multiple: int, max_length: int) -> torch.Tensor:
    """Each sample's length rounded up to ``multiple`` (capped at ``max_length``)."""
    return torch.clamp(((lengths + multiple - 1) // multiple) * multiple, max=max_length)


class LengthBucketBatches(Sampler[list[int]]):
    """Batches drawn from samples of one padded length: random composition, seeded per epoch.

    Each epoch the samples of every length bucket are shuffled and cut into batches, and the
    batches of all buckets are shuffled together. The generator is seeded with ``(seed, epoch)``:
    Lightning calls ``set_epoch`` on ``batch_sampler.sampler`` (this object's :attr:`sampler`).
    """

    def __init__(self, bucket_of: torch.Tensor, batch_size: int, seed: int, shuffle: bool = True) -> None:
        self.bucket_of = bucket_of
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.sampler = _EpochClock()
        self._buckets = {int(b): torch.nonzero(bucket_of == b).flatten() for b in torch.unique(bucket_of)}

    def __len__(self) -> int:
        return sum(math.ceil(len(idx) / self.batch_size) for idx in self._buckets.values())

    def __iter__(self) -> Iterator[list[int]]:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + self.sampler.epoch)
        batches: list[list[int]] = []
        for bucket in sorted(self._buckets):
            idx = self._buckets[bucket]
            if self.shuffle:
                idx = idx[torch.randperm(len(idx), generator=gen)]
            batches.extend(idx[i : i + self.batch_size].tolist() for i in range(0, len(idx), self.batch_size))
        order = torch.randperm(len(batches), generator=gen).tolist() if self.shuffle else range(len(batches))
        yield from (batches[i] for i in order)


class _EpochClock:
    """Receives Lightning's ``set_epoch`` for :class:`LengthBucketBatches`."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def collate_to_multiple(multiple: int) -> Any:
    """Cut a batch to its longest sample rounded up to ``multiple``: within one length bucket that
    is the bucket's length, the same every epoch whoever the batch-mates are."""

    def collate(batch: Batch) -> Batch:
        longest = int(batch["attention_mask"].sum(dim=1).max())
        width = batch["attention_mask"].shape[1]
        length = min(width, ((longest + multiple - 1) // multiple) * multiple)
        return {k: (v[:, :length].contiguous() if v.dim() == 2 else v) for k, v in batch.items()}

    return collate


class BenchData(RottenTomatoesDataModule):
    """The example's data module with seeded loaders and a choice of padding (the same for every variant).

    Args:
        seed: seeds the training order (its own generator, untouched by dropout or model init).
        padding: ``"bucket"``, ``"trim"`` or ``"max"`` (see the module docstring).
        val_batch_size: samples per validation batch (validation batches are sorted by length).
        multiple: bucket granularity in tokens.
        **kwargs: :class:`RottenTomatoesDataModule` arguments.
    """

    def __init__(self, seed: int = 0, padding: Padding = "bucket", val_batch_size: int = 128, multiple: int = 8, **kwargs: Any) -> None:
        if padding not in ("bucket", "trim", "max"):
            raise ValueError(f"padding must be 'bucket', 'trim' or 'max', got {padding!r}.")
        super().__init__(trim_padding=padding != "max", **kwargs)
        self.seed, self.padding, self.val_batch_size, self.multiple = seed, padding, val_batch_size, multiple

    def _lengths(self, dataset: EncodedDataset) -> torch.Tensor:
        return dataset.attention_mask.sum(dim=1)

    def train_dataloader(self) -> DataLoader[Batch]:
        data = self._require(self.train_set)
        bs = int(self.hparams.batch_size)
        if self.padding == "bucket":
            buckets = padded_length(self._lengths(data), self.multiple, data.input_ids.shape[1])
            sampler = LengthBucketBatches(buckets, bs, self.seed)
            return DataLoader(data, batch_sampler=sampler, collate_fn=collate_to_multiple(self.multiple))
        gen = torch.Generator().manual_seed(self.seed)
        collate = collate_trimmed if self.padding == "trim" else _identity
        return DataLoader(data, batch_size=bs, shuffle=True, generator=gen, collate_fn=collate)

    def val_dataloader(self) -> DataLoader[Batch]:
        data = self._require(self.val_set)
        if self.padding == "max":
            return DataLoader(data, batch_size=self.val_batch_size, collate_fn=_identity)
        order = torch.argsort(self._lengths(data), stable=True).tolist()  # fixed batches, little padding
        batches = [order[i : i + self.val_batch_size] for i in range(0, len(order), self.val_batch_size)]
        return DataLoader(data, batch_sampler=batches, collate_fn=collate_to_multiple(self.multiple))

    @staticmethod
    def _require(dataset: EncodedDataset | None) -> EncodedDataset:
        if dataset is None:
            raise RuntimeError("Call setup('fit') before asking for a dataloader.")
        return dataset


def _identity(batch: Batch) -> Batch:
    return batch


def tokens_per_batch(dm: BenchData, padding: Padding) -> float:
    """Mean padded tokens per training batch under ``padding`` (one epoch, seed 0)."""
    saved = dm.padding
    dm.padding = padding
    try:
        shapes = [b["input_ids"].numel() for b in dm.train_dataloader()]
    finally:
        dm.padding = saved
    return statistics.fmean(shapes)


# ---------------------------------------------------------------------------------------- variants


@dataclass(frozen=True)
class Variant:
    """One line of the benchmark: what runs, under which name."""

    kind: Kind
    alpha: float | None = None
    alpha_text: str = ""

    @property
    def name(self) -> str:
        if self.kind == "full":
            return "full fine-tuning"
        return f"{'freeze' if self.kind == 'freeze' else 'freeze+cache'} a={self.alpha_text}"


@dataclass
class RunRecord:
    """One (variant, seed) run: per-epoch rows from the Timeline, plus the fit's wall time."""

    variant: str
    seed: int
    epochs: list[dict[str, Any]] = field(default_factory=list)
    fit_s: float = 0.0
    error: str | None = None

    @property
    def train_s(self) -> float:
        return sum(e["train_s"] for e in self.epochs)

    @property
    def val_s(self) -> float:
        return sum(e["epoch_s"] - e["train_s"] for e in self.epochs)

    @property
    def final_acc(self) -> float | None:
        return self.epochs[-1]["metric"] if self.epochs else None

    def cache_peak(self, field_name: Literal["cache_mem_bytes", "cache_disk_bytes"]) -> int | None:
        """The largest cache footprint at an epoch end (``None``: no epoch reported one, e.g. no cache).

        Epoch ends only: while the boundary advances, the previous boundary's store briefly coexists
        with the new one, so the footprint within an epoch can be higher than this.
        """
        values = [e[field_name] for e in self.epochs if e.get(field_name) is not None]  # .get: older JSON rows lack it
        return max(values) if values else None

    def time_to(self, target: float) -> float | None:
        """Training seconds (validation excluded) until validation accuracy >= ``target``."""
        elapsed = 0.0
        for e in self.epochs:
            elapsed += e["train_s"]
            if e["metric"] is not None and e["metric"] >= target:
                return elapsed
        return None


def cache_supported() -> bool:
    """Whether this build's strategy takes AutoCache's arguments (``cache=``)."""
    try:
        PipeTransformerStrategy(pipe_len=1, cache=True)  # type: ignore[call-arg]
    except TypeError:
        return False
    return True


def build_trainer(variant: Variant, args: argparse.Namespace, cache_dir: str) -> pl.Trainer:
    """The Trainer of one run: the same settings for every variant except callbacks and strategy."""
    callbacks: list[pl.Callback] = [Timeline(print_table=False)]
    strategy: Any = "auto"
    if variant.kind != "full":
        assert variant.alpha is not None
        callbacks.insert(0, AutoFreeze(alpha=variant.alpha, rule=args.rule))
    if variant.kind in ("freeze", "cache"):  # the same strategy: the cache is the only difference (module docstring)
        cache = variant.kind == "cache"
        strategy = PipeTransformerStrategy(pipe_len=1, cache=cache, cache_dir=cache_dir if cache else None)  # type: ignore[call-arg]
    return pl.Trainer(
        accelerator=args.accelerator, devices=1, strategy=strategy, precision="32-true", max_epochs=args.epochs,
        callbacks=callbacks, num_sanity_val_steps=0, enable_checkpointing=False, logger=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip


def run_one(variant: Variant, seed: int, dm: BenchData, args: argparse.Namespace, model_dir: str) -> RunRecord:
    """Fit one variant with one seed and return its per-epoch timeline."""
    record = RunRecord(variant=variant.name, seed=seed)
    cache_dir = tempfile.mkdtemp(prefix="ttacc-cache-")  # a fresh cache per run: never a hit from another run
    try:
        dm.seed = seed
        pl.seed_everything(seed, workers=True, verbose=False)  # classifier head init, dropout
        model = SentimentClassifier(pretrained=model_dir, lr=args.lr)
        trainer = build_trainer(variant, args, cache_dir)
        start = time.perf_counter()
        trainer.fit(model, datamodule=dm)
        record.fit_s = time.perf_counter() - start
        timeline = next(c for c in trainer.callbacks if isinstance(c, Timeline))  # type: ignore[attr-defined]
        record.epochs = [asdict(r) for r in timeline.rows]
    except Exception as err:  # one failed run must not lose the others of a long benchmark
        record.error = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
        gc.collect()
    return record


# ---------------------------------------------------------------------------------------- estimate


def _interp(table: dict[int, float], f: float) -> float:
    keys = sorted(table)
    lo = max(k for k in keys if k <= f)
    hi = min(k for k in keys if k >= f)
    return table[lo] if lo == hi else table[lo] + (table[hi] - table[lo]) * (f - lo) / (hi - lo)


def estimate_seconds(variant: Variant, epochs: int, steps: int, tokens: float, val_tokens: float, n_train: int, blocks: int = 6) -> float:
    """Rough seconds of one run on an idle 2-core CPU, from the per-step costs in ``STEP_MS``.

    Uses the geometric schedule (the paper rule freezes no more, so it can only take longer) and
    assumes step time proportional to tokens per batch.
    """
    scale = tokens / (32 * 64)
    total, prev = SETUP_S, 0
    for e in range(epochs):
        f = 0 if variant.kind == "full" else min(blocks - 1, geometric_num_frozen(blocks, variant.alpha or 0.5, e))
        cached = variant.kind == "cache" and prev > 0
        ms = _interp(STEP_MS_CACHED if cached else STEP_MS, f)
        total += steps * ms / 1000 * scale
        if cached and f > prev:
            total += (f - prev) * ADVANCE_S_PER_BLOCK_PER_SAMPLE * n_train
        total += val_tokens * NO_GRAD_MS_PER_TOKEN / 1000
        prev = f
    return total


# ---------------------------------------------------------------------------------------- report


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample sd; the sd is NaN for one value (one seed measures no spread, not a zero one)."""
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else math.nan)


def _fmt(mean: float, sd: float, digits: int = 0, unit: str = "") -> str:
    if math.isnan(mean):
        return "-"
    if math.isnan(sd):
        return f"{mean:.{digits}f}{unit}"
    return f"{mean:.{digits}f} ± {sd:.{digits}f}{unit}"


def _mean_mb(values: Sequence[int | None]) -> float | None:
    """Mean of the known byte counts, in MB; ``None`` if none is known (a variant without a cache)."""
    known = [v for v in values if v is not None]
    return statistics.fmean(known) / 1e6 if known else None


def _mb_pair(mem: float | None, disk: float | None) -> str:
    """``"mem / disk"`` MB cell; ``-`` when the variant reported no cache bytes."""
    if mem is None and disk is None:
        return "-"
    return " / ".join("-" if v is None else f"{v:.1f}" for v in (mem, disk))


def reference_of(variant: Variant, variants: Sequence[Variant], has_baseline: bool) -> Variant | None:
    """What a variant's speed-up is measured against: the full fine-tuning baseline when it ran;
    otherwise, for freeze+cache, the freeze variant of the same alpha (the cache off vs on)."""
    if has_baseline:
        return Variant("full")
    if variant.kind == "cache":
        return next((v for v in variants if v.kind == "freeze" and v.alpha == variant.alpha), None)
    return None


def summarize(records: list[RunRecord], variants: list[Variant]) -> tuple[list[dict[str, Any]], float | None]:
    """Per-variant aggregates and the time-to-accuracy target (baseline mean final acc - 0.3 pt)."""
    ok = [r for r in records if r.error is None and r.epochs]
    base = [r.final_acc for r in ok if r.variant == "full fine-tuning" and r.final_acc is not None]
    target = statistics.fmean(base) - 0.003 if base else None
    train_of = {v.name: [r.train_s for r in ok if r.variant == v.name] for v in variants}
    base_tta = None
    rows = []
    for v in variants:
        runs = [r for r in ok if r.variant == v.name]
        failed = [r for r in records if r.variant == v.name and r.error is not None]
        if not runs:
            rows.append({"variant": v.name, "runs": 0, "failed": len(failed)})
            continue
        train = _mean_sd([r.train_s for r in runs])
        n_epochs = max(len(r.epochs) for r in runs)
        per_epoch = [statistics.fmean(r.epochs[e]["train_s"] for r in runs if len(r.epochs) > e) for e in range(n_epochs)]
        acc = _mean_sd([100 * r.final_acc for r in runs if r.final_acc is not None])
        ttas = [r.time_to(target) for r in runs] if target is not None else []
        reached = [t for t in ttas if t is not None]
        tta = _mean_sd(reached) if reached and len(reached) == len(runs) else (math.nan, math.nan)
        if v.kind == "full":
            base_tta = tta[0]
        ref = reference_of(v, variants, bool(base))
        ref_train = train_of.get(ref.name) if ref is not None else None
        rows.append({
            "variant": v.name, "runs": len(runs), "failed": len(failed), "train": train, "per_epoch": per_epoch,
            "speedup": (statistics.fmean(ref_train) / train[0]) if ref_train else math.nan,
            "reference": ref.name if ref_train else None, "acc": acc,
            "tta": tta, "tta_reached": f"{len(reached)}/{len(runs)}" if target is not None else None,
            "val": _mean_sd([r.val_s for r in runs]),
            "fit": _mean_sd([r.fit_s for r in runs]),
            "frozen": [runs[0].epochs[e]["frozen"] for e in range(len(runs[0].epochs))],
            "cache_hits": [runs[0].epochs[e]["cache_hits"] for e in range(len(runs[0].epochs))],
            "per_epoch_acc": [statistics.fmean(100 * r.epochs[e]["metric"] for r in runs if len(r.epochs) > e) for e in range(n_epochs)],
            # Cache footprint, MB, mean over seeds: the run's largest at an epoch end, and per epoch.
            "cache_peak_mb": (_mean_mb([r.cache_peak("cache_mem_bytes") for r in runs]),
                              _mean_mb([r.cache_peak("cache_disk_bytes") for r in runs])),
            "per_epoch_cache_mb": [
                (_mean_mb([r.epochs[e].get("cache_mem_bytes") for r in runs if len(r.epochs) > e]),
                 _mean_mb([r.epochs[e].get("cache_disk_bytes") for r in runs if len(r.epochs) > e]))
                for e in range(n_epochs)
            ],
        })  # fmt: skip
    for row in rows:
        if "tta" in row:
            row["tta_speedup"] = (base_tta / row["tta"][0]) if base_tta and not math.isnan(row["tta"][0]) else math.nan
    return rows, target


def markdown_table(rows: list[dict[str, Any]], target: float | None) -> str:
    """The summary table (mean ± sd over seeds)."""
    head = ["variant", "seeds", "train time (s)", "speed-up", "train s per epoch", "final val acc (%)",
            f"time to {100 * target:.2f}% (s)" if target is not None else "time to target (s)", "TTA speed-up",
            "validation (s)", "frozen per epoch", "cache MB, peak (mem / disk)"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    references = {r.get("reference") for r in rows}
    for r in rows:
        if not r.get("runs"):
            lines.append(f"| {r['variant']} | 0 ({r['failed']} failed) |" + " - |" * (len(head) - 2))
            continue
        if r["tta_reached"] is None:  # no baseline ran: no target to reach
            tta = "-"
        else:
            tta = _fmt(*r["tta"]) if not math.isnan(r["tta"][0]) else f"not reached ({r['tta_reached']})"
        speedup = "-" if math.isnan(r["speedup"]) else f"{r['speedup']:.2f}x"
        if math.isnan(r["speedup"]) and r["variant"] in references:
            speedup = "reference"
        if r["reference"] not in (None, "full fine-tuning", r["variant"]):
            speedup += f" vs {r['reference']}"
        cells = [
            r["variant"], str(r["runs"]) + (f" (+{r['failed']} failed)" if r["failed"] else ""), _fmt(*r["train"]),
            speedup, " / ".join(f"{s:.0f}" for s in r["per_epoch"]), _fmt(*r["acc"], digits=2), tta,
            "-" if math.isnan(r["tta_speedup"]) else f"{r['tta_speedup']:.2f}x", _fmt(*r["val"]),
            " ".join("0" if f == "-" else f.split("/")[0] for f in r["frozen"]), _mb_pair(*r["cache_peak_mb"]),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def epoch_table(rows: list[dict[str, Any]]) -> str:
    """Per-epoch means over seeds: training seconds, accuracy, cache MB at the epoch's end; frozen blocks
    and cache hits of the first seed."""
    lines = [
        "| variant | epoch | frozen | train s | val acc (%) | cache hits (first seed) | cache MB at epoch end (mem / disk) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for e, (s, a) in enumerate(zip(r.get("per_epoch", []), r.get("per_epoch_acc", []))):
            mb = _mb_pair(*r["per_epoch_cache_mb"][e])
            lines.append(f"| {r['variant']} | {e} | {r['frozen'][e]} | {s:.1f} | {a:.2f} | {r['cache_hits'][e]} | {mb} |")
    return "\n".join(lines)


def write_plot(records: list[RunRecord], variants: list[Variant], target: float | None, path: Path) -> None:
    """Validation accuracy against cumulative training time, one line per variant (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for v in variants:
        runs = [r for r in records if r.variant == v.name and r.error is None and r.epochs]
        if not runs:
            continue
        n = min(len(r.epochs) for r in runs)
        times = [statistics.fmean(sum(e["train_s"] for e in r.epochs[: i + 1]) for r in runs) for i in range(n)]
        accs = [[100 * r.epochs[i]["metric"] for r in runs] for i in range(n)]
        mean = [statistics.fmean(a) for a in accs]
        sd = [statistics.stdev(a) if len(a) > 1 else 0.0 for a in accs]
        ax.errorbar(times, mean, yerr=sd, marker="o", capsize=3, label=v.name)
    if target is not None:
        ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1, label="target (baseline - 0.3 pt)")
    ax.set_xlim(left=0)
    ax.set_xlabel("training wall-clock (s, validation excluded)")
    ax.set_ylabel("validation accuracy (%)")
    ax.set_title("MiniLM-L6 on Rotten Tomatoes: accuracy vs training time (mean ± sd over seeds)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine_text() -> str:
    """CPU model, cores, threads, load and library versions, one line each."""
    import lightning
    import transformers

    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return (
        f"- CPU: {cpu}, {os.cpu_count()} cores visible, torch threads {torch.get_num_threads()}\n"
        f"- load average (1, 5, 15 min) when the report was written: {load}\n"
        f"- Python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}, "
        f"transformers {transformers.__version__}"
    )


def write_docs(
    path: Path, plot: Path, args: argparse.Namespace, body: dict[str, str], variants: list[Variant], target: float | None
) -> None:
    """Write the markdown report (``docs/benchmarks.md`` by default).

    It describes only the variants that were run, and says which seeds each ran on. Without the
    full fine-tuning baseline there is no accuracy target: the time-to-accuracy explanation and the
    issue's anchor and goal (all relative to the baseline) are left out, and speed-ups are cache on
    against cache off.
    """
    kinds = {v.kind for v in variants}
    has_baseline = target is not None
    others = "\n".join(f"- [{p}]({os.path.relpath(ROOT / p, path.resolve().parent)}): {what}" for p, what in OTHER_TABLES
                       if (ROOT / p).resolve() != path.resolve())
    smoke = (
        "\n> **Smoke run.** These numbers come from `--smoke` (a tiny subset, few epochs, one or two seeds)"
        " on a machine busy with other jobs. They show that the benchmark runs, not how fast anything is."
        " Run the command without `--smoke` on a quiet machine for the benchmark.\n"
        if args.smoke else ""
    )
    described = {
        "full": "**full fine-tuning**: a plain Lightning `Trainer` with the single-device strategy. This is the baseline.",
        "freeze": f"**freeze**: `AutoFreeze(alpha, rule=\"{args.rule}\")` with `PipeTransformerStrategy(pipe_len=1, cache=False)`"
        " (the same strategy as freeze+cache, so the cache is the only difference: DDP-family strategies re-seed torch at fit start,"
        " the single-device one does not, which changes the dropout stream).",
        "cache": "**freeze+cache**: `AutoFreeze` with `PipeTransformerStrategy(pipe_len=1, cache=True)`. " + body["cache_note"],
    }
    listed = "\n".join(f"{i}. {described[k]}" for i, k in enumerate((k for k in ("full", "freeze", "cache") if k in kinds), 1))
    if has_baseline:
        speedup_note = (
            "- \"speed-up\" is the baseline's mean train time divided by the variant's.\n"
            "- \"time to X%\" is the training time until validation accuracy first reaches the baseline's mean\n"
            "  final accuracy minus 0.3 points. Accuracy is checked once per epoch, so this time is always an\n"
            "  epoch boundary. It is reported only if every seed reaches the target; otherwise the cell says\n"
            "  how many did."
        )
    else:
        speedup_note = (
            "- No full fine-tuning baseline ran, so there is no accuracy target: the time-to-accuracy columns\n"
            "  are empty, and nothing here compares against full fine-tuning.\n"
            "- \"speed-up\" of freeze+cache is the mean train time of freeze at the same alpha (the cache off)\n"
            "  divided by its own (the cache on); \"-\" where that variant did not run."
        )
    anchor = ""
    if has_baseline:
        anchor_rows = "\n".join(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in ANCHOR)
        anchor = f"""
### For comparison: the anchor in issue 8

This is a plain PyTorch loop on a 2-core machine like ours, not this code: 3,008 training snippets,
5 epochs, batch 32, AdamW 5e-5 with warm-up and linear decay, the geometric schedule, and an
idealised cache that recomputes the boundary activations in a separate pass at each freeze.
Medians of 2 runs, 2,000 validation snippets.

| variant | total train time | speed-up | final accuracy |
|---|---|---|---|
{anchor_rows}

The goal set in the issue for variant 3 against variant 1 is at least 3.0x total training time, at a
mean final accuracy no more than 0.3 points below the baseline's.
"""
    variants_intro = (
        "Variants, run in one invocation with the seed loop outside and the variants inside, so that every\n"
        "variant sees the same machine noise:"
        if len(variants) > 1 else "One variant ran:"
    )
    seeds_note = (
        "mean ± sd over seeds" if len(args.seed_list) > 1 else "one seed: single runs, no spread measured"
    )
    heading = (
        "Time to accuracy: MiniLM-L6 on Rotten Tomatoes (issue 8)" if has_baseline
        else "AutoCache off vs on: MiniLM-L6 on Rotten Tomatoes (issue 6)"
    )
    text = f"""# Benchmarks

## {heading}

Generated by `benchmarks/time_to_accuracy.py` on {datetime.date.today().isoformat()}.
{smoke}
Command:

```bash
{body['command']}
```

Machine:

{machine_text()}

Setting: {body['setting']}

Ran: {body['ran']}.

{variants_intro}

{listed}

Every variant of a seed gets the same data, the same batches in the same order and the same
classifier-head initialisation. The LightningModule (`examples/text_classification.py`) uses fused
AdamW with lr {args.lr}, 10% linear warm-up and then linear decay.

### Results ({seeds_note})

{body['table']}

- "train time" is the sum of the epochs' training parts. Validation is excluded, and is in the
  "validation" column.
{speedup_note}
- "frozen per epoch" is the number of frozen blocks (of 6) in each epoch, for the first seed.
- "cache MB, peak" is the most the cache held at an epoch end, in host memory / on disk (the
  strategy's `cache_stats()`: the current frozen boundary's store), each run's largest, mean over
  seeds; "-" for a variant without a cache.

![accuracy vs training time]({os.path.relpath(plot.resolve(), path.resolve().parent)})

### Per epoch

{body['epochs']}

"cache MB at epoch end" is "-" while nothing is cached (no block frozen yet, or no cache).

### Where the time goes

{body['where']}
{anchor}
### Caveats

- This is CPU only: 2 cores, one process, `pipe_len=1`. There is no pipeline or data-parallel
  speed-up here. The multi-GPU speed-up is predicted by the cost model (docs/cost_model.md), not
  measured.
- Our machines are shared, so wall-clock times move with other people's jobs. The variants are
  interleaved per seed so that they share the noise, and the load average is printed above. Trust
  the ratios more than the absolute seconds.
- Freezing starts at the second epoch (`freeze_every_n_epochs=1`). The first epoch always trains
  the whole model, and it bounds the speed-up of every schedule over a short epoch budget.
- Determinism: each seed fixes the data order, the classifier-head initialisation and dropout. A
  frozen block runs in eval mode (no dropout), so frozen variants draw fewer random numbers, and
  their dropout masks differ from an unfrozen run's after the first freeze.
- Length buckets (`--padding bucket`, the default, the same for every variant): a batch holds
  samples of one padded length, so each bucket ends with a partial batch (a few % more, smaller
  steps per epoch than plain batching), and a batch's label mix follows its length bucket's.
  `--padding trim` reproduces the example's loader, at about twice the tokens per batch.
- The validation set is one fixed split by movie, so the spread over seeds does not include the
  split's own sampling error. At ~5,000 snippets that error is about 0.6 points.

## Other benchmark tables

{others}
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# ---------------------------------------------------------------------------------------- main


def parse_alphas(text: str) -> list[tuple[float, str]]:
    """``"1/4,0.333,1/2"`` -> [(0.25, "1/4"), (0.333, "0.333"), (0.5, "1/2")]."""
    out = []
    for item in text.split(","):
        item = item.strip()
        try:
            value = float(Fraction(item))
        except (ValueError, ZeroDivisionError):
            raise SystemExit(f"--alphas: {item!r} is not a number or fraction (e.g. 1/3 or 0.25).") from None
        if not 0 < value < 1:
            raise SystemExit(f"--alphas: {item} is not strictly between 0 and 1.")
        out.append((value, item))
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny preset: 960/320 snippets, 3 epochs, seeds 0,1, 1 thread unless --threads (~5 min idle, ~10 loaded)")
    p.add_argument("--train-size", type=int, default=None, help="training snippets (default 3000; smoke 960)")
    p.add_argument("--val-size", type=int, default=None,
                   help="validation snippets (default: the whole held-out side, ~5,100; smoke 320)")  # fmt: skip
    p.add_argument("--epochs", type=int, default=None, help="epoch budget (default 5; smoke 3)")
    p.add_argument("--seeds", default=None, help="comma-separated training seeds (default 0,1,2; smoke 0,1)")
    p.add_argument("--variants", default="full,freeze,cache",
                   help="any of full,freeze,cache; without full (the baseline) ratios are freeze+cache vs freeze and "
                        "--write needs a --docs path of its own")  # fmt: skip
    p.add_argument("--alphas", default="1/3", help="AutoFreeze alphas for the freeze/cache variants, e.g. 1/4,1/3,1/2")
    p.add_argument("--sweep-alphas", default="", help="extra freeze+cache variants at these alphas (the accuracy cost of other settings), e.g. 1/4,1/2")
    p.add_argument("--sweep-seeds", type=int, default=None, help="run the sweep variants on the first N seeds only (default: all)")
    p.add_argument("--rule", choices=("schedule", "paper"), default="schedule",
                   help="AutoFreeze rule (default schedule: the geometric plan, as the issue's anchor ran)")  # fmt: skip
    p.add_argument("--padding", choices=("bucket", "trim", "max"), default="bucket")
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--val-batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice). On a machine busy with other jobs, fewer threads "
                        "than cores avoids OpenMP threads spinning against each other, which can inflate times many-fold")  # fmt: skip
    p.add_argument("--json", type=Path, default=None,
                   help="raw per-run records (default outputs/benchmarks/time_to_accuracy.json; with another --docs, "
                        "outputs/benchmarks/<docs stem>.json, so a partial run keeps the full benchmark's records)")  # fmt: skip
    p.add_argument("--write", action="store_true", help="write the report (--docs) and its PNG next to it")
    p.add_argument("--dry-run", action="store_true", help="load the data, print the plan and the duration estimate, and stop")
    p.add_argument("--docs", type=Path, default=DEFAULT_DOCS,
                   help="the markdown report --write writes (default docs/benchmarks.md, the full benchmark's); "
                        "its plot goes next to it as <stem>_time_to_accuracy.png")  # fmt: skip
    args = p.parse_args(argv)
    if args.json is None:
        stem = "time_to_accuracy" if args.docs.resolve() == DEFAULT_DOCS.resolve() else args.docs.stem
        args.json = ROOT / "outputs" / "benchmarks" / f"{stem}.json"
    # --smoke fills only what the command line left open: `--smoke --train-size 960` works.
    preset = SMOKE if args.smoke else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    kinds = [k.strip() for k in args.variants.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("full", "freeze", "cache")]
    if bad or not kinds:
        p.error(f"--variants takes full, freeze and/or cache, got {args.variants!r}.")
    if "full" not in kinds and args.write and args.docs.resolve() == DEFAULT_DOCS.resolve():
        p.error(
            f"--variants {args.variants} has no full fine-tuning baseline, so its report must not replace "
            f"{DEFAULT_DOCS.relative_to(ROOT)} (the full benchmark's): pass --docs PATH, e.g. docs/cache_benchmark.md."
        )
    args.kinds = kinds
    args.alpha_list = parse_alphas(args.alphas)
    args.sweep_list = [a for a in parse_alphas(args.sweep_alphas) if a not in args.alpha_list] if args.sweep_alphas else []
    return args


def _quiet() -> None:
    """Keep the output to the benchmark's own lines: no per-run load reports or Trainer banners."""
    import logging

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_pipetransformer"):
        logging.getLogger(name).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the tables; with ``--write`` write the ``--docs`` report and its PNG."""
    args = parse_args(argv)
    _quiet()
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python benchmarks/time_to_accuracy.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    from assets import fetch

    model_dir = str(fetch("minilm-l6"))
    has_cache = cache_supported()
    variants: list[Variant] = [Variant("full")] if "full" in args.kinds else []
    for kind in ("freeze", "cache"):
        if kind in args.kinds:
            variants += [Variant(kind, a, t) for a, t in args.alpha_list]  # type: ignore[arg-type]
    sweep = [Variant("cache", a, t) for a, t in args.sweep_list]  # type: ignore[arg-type]
    variants += sweep
    sweep_seeds = args.seed_list[: args.sweep_seeds] if args.sweep_seeds is not None else args.seed_list
    requested = list(variants)
    cache_note = "" if has_cache else "**Skipped in this run: variant 3 needs AutoCache (not merged yet).**"
    if not has_cache and any(v.kind == "cache" for v in variants):
        print("time_to_accuracy: variant 3 needs AutoCache (not merged yet): PipeTransformerStrategy takes no cache= argument; skipping it.", flush=True)  # fmt: skip
        variants = [v for v in variants if v.kind != "cache"]

    dm = BenchData(
        seed=args.seed_list[0], padding=args.padding, val_batch_size=args.val_batch_size, tokenizer=model_dir,
        train_size=args.train_size, val_size=args.val_size, max_length=args.max_length, batch_size=args.batch_size,
    )  # fmt: skip
    dm.setup("fit")
    assert dm.train_set is not None and dm.val_set is not None
    n_train, n_val = len(dm.train_set), len(dm.val_set)
    tokens = {p: tokens_per_batch(dm, p) for p in ("max", "trim", "bucket")}  # type: ignore[arg-type]
    steps = len(dm.train_dataloader())
    start = time.perf_counter()
    for _ in dm.train_dataloader():
        pass
    load_s = time.perf_counter() - start
    val_tokens = sum(b["input_ids"].numel() for b in dm.val_dataloader())
    est = sum(
        estimate_seconds(v, args.epochs, steps, tokens[args.padding], val_tokens, n_train)
        * (len(sweep_seeds) if v in sweep else len(args.seed_list))
        for v in requested
    )
    skipped = " (variant 3 included, as if AutoCache were merged)" if len(requested) > len(variants) else ""
    print(
        f"time_to_accuracy: {n_train} train / {n_val} val snippets, {args.epochs} epochs, seeds {args.seed_list}, "
        f"padding={args.padding} ({tokens[args.padding]:.0f} tokens per batch of {args.batch_size}; trim "
        f"{tokens['trim']:.0f}, max {tokens['max']:.0f}), {steps} steps per epoch; variants: "
        f"{', '.join(v.name for v in variants)}.\n"
        f"time_to_accuracy: estimated duration on an idle 2-core CPU{skipped}: {est / 60:.0f} min "
        f"(+-50%, from per-step costs measured once on an idle 2-core CPU; a loaded machine takes longer).",
        flush=True,
    )
    if args.dry_run:
        return 0

    records: list[RunRecord] = []
    for seed in args.seed_list:  # seeds outside, variants inside: the variants share the noise
        for v in variants:
            if v in sweep and seed not in sweep_seeds:
                continue
            t0 = time.perf_counter()
            rec = run_one(v, seed, dm, args, model_dir)
            records.append(rec)
            status = rec.error or (
                f"train {rec.train_s:.0f} s, val {rec.val_s:.0f} s, acc {100 * (rec.final_acc or math.nan):.2f}%"
            )
            print(f"time_to_accuracy: seed {seed} {v.name}: {status} ({time.perf_counter() - t0:.0f} s wall)", flush=True)
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"command": command, "args": _jsonable(vars(args)), "records": [asdict(r) for r in records]}, indent=1))

    rows, target = summarize(records, variants)
    table = markdown_table(rows, target)
    print("\n" + table + "\n", flush=True)
    print(epoch_table(rows) + "\n", flush=True)
    if args.write:
        plot = plot_path_for(args.docs)
        write_plot(records, variants, target, plot)
        val_frac = _val_share(rows)
        where = (
            f"- Padding (measured on this data, no timing involved): mean tokens per training batch of "
            f"{args.batch_size} are {tokens['max']:.0f} padded to max length, {tokens['trim']:.0f} trimmed per batch "
            f"(the example's default) and {tokens['bucket']:.0f} with length buckets. Step time on CPU is close to "
            f"proportional to tokens at these lengths, so bucketing should cut every variant's step time by about "
            f"{100 * (1 - tokens['bucket'] / tokens['trim']):.0f}% against trimming (not timed here). It also keeps a sample's padded "
            f"input the same every epoch, which AutoCache's content keys need. With per-batch trimming the padded "
            f"length depends on the batch-mates, so keys change between epochs and the cache mostly misses.\n"
            f"- Data loading: one epoch of training batches takes {1000 * load_s:.0f} ms to produce "
            f"(pre-tokenized tensors, sliced per batch), which is negligible.\n"
            f"- Evaluation: validation over {n_val} snippets every epoch took {val_frac} of each run's wall time. "
            f"Batches are sorted by length, {args.val_batch_size} per batch, with no gradients. It is kept out of "
            f"the training time, and evaluating less often would cut it.\n"
            f"- Optimizer: fused AdamW (the example's default) cost ~13 ms per step on this kind of CPU, against ~83 ms "
            f"for the default implementation (measured earlier on this kind of CPU; not timed in this run). Once the embeddings freeze, their 11.7 M parameters, "
            f"half the model, leave the update."
        )
        where += bound_text(rows, args.epochs) + cache_text(rows) + exactness_text(records, variants)
        body = {
            "command": command, "table": table, "epochs": epoch_table(rows), "where": where, "cache_note": cache_note,
            "ran": ran_text(records, variants),
            "setting": (
                f"{n_train} training snippets and {n_val} validation snippets, split by movie (data split seed 0). "
                f"Max length {args.max_length}, padding `{args.padding}`, batch {args.batch_size}, {args.epochs} epochs, "
                f"seeds {args.seed_list}, AutoFreeze rule `{args.rule}`, alphas {args.alphas}"
                + (f"; alpha sweep (freeze+cache only) {args.sweep_alphas} on seeds {sweep_seeds}." if sweep else ".")
            ),
        }  # fmt: skip
        write_docs(args.docs, plot, args, body, variants, target)
        print(f"time_to_accuracy: wrote {args.docs} and {plot}", flush=True)
    return 1 if any(r.error for r in records) else 0


def bound_text(rows: list[dict[str, Any]], epochs: int) -> str:
    """What the measured epochs allow: the best total if every frozen epoch were the cheapest one."""
    base = next((r for r in rows if r["variant"] == "full fine-tuning" and r.get("runs")), None)
    cached = [r for r in rows if r["variant"].startswith("freeze+cache") and r.get("runs")]
    if base is None or not cached:
        return ""
    best = min(cached, key=lambda r: r["train"][0])
    first, cheapest = best["per_epoch"][0], min(best["per_epoch"])
    floor = first + (epochs - 1) * cheapest
    return (
        f"\n- The bound on this setting: freezing is decided at epoch boundaries, so epoch 0 trains the whole "
        f"model ({first:.0f} s for {best['variant']}). Even if every later epoch cost as little as the cheapest "
        f"measured cached epoch ({cheapest:.0f} s, {best['frozen'][-1]} blocks frozen), the total would be "
        f"{floor:.0f} s, a speed-up of at most {base['train'][0] / floor:.2f}x over the baseline's "
        f"{base['train'][0]:.0f} s, and only by freezing almost everything after one epoch. Reaching 3x at "
        f"equal accuracy would need freeze points inside the first epochs (sub-epoch intervals) or a longer epoch "
        f"budget, where the unfrozen start weighs less."
    )


def ran_text(records: list[RunRecord], variants: list[Variant]) -> str:
    """Which variants ran with which seeds (successful runs only): what the report's numbers rest on."""
    parts = []
    for v in variants:
        done = [r.seed for r in records if r.variant == v.name and r.error is None and r.epochs]
        failed = [r.seed for r in records if r.variant == v.name and r.error is not None]
        parts.append(f"**{v.name}** on seed{'s' if len(done) != 1 else ''} {', '.join(map(str, done)) or 'none'}"
                     + (f" (failed on {', '.join(map(str, failed))})" if failed else ""))  # fmt: skip
    return "; ".join(parts)


def exactness_text(records: list[RunRecord], variants: list[Variant]) -> str:
    """Cache off vs on, seed by seed: AutoCache is exact, so every epoch's validation accuracy must match."""
    lines = []
    for on in (v for v in variants if v.kind == "cache"):
        off = next((v for v in variants if v.kind == "freeze" and v.alpha == on.alpha), None)
        if off is None:
            continue
        pairs = [
            (a, b) for a in records for b in records
            if a.variant == off.name and b.variant == on.name and a.seed == b.seed and a.epochs and b.epochs
        ]
        if not pairs:
            continue
        gaps = [abs(x["metric"] - y["metric"]) for a, b in pairs for x, y in zip(a.epochs, b.epochs)
                if x["metric"] is not None and y["metric"] is not None]  # fmt: skip
        worst = max(gaps, default=0.0)
        verdict = "identical" if worst == 0.0 else f"different by up to {100 * worst:.2f} points"
        lines.append(
            f"\n- Cache off vs on ({off.name} vs {on.name}, {len(pairs)} seed(s), {len(gaps)} epoch validations): "
            f"validation accuracy {verdict}. The two share the strategy and the seed, so AutoCache being exact means identical."
        )
    return "".join(lines)


def cache_text(rows: list[dict[str, Any]]) -> str:
    """The cache's footprint in words: the largest bytes held at an epoch end, and what that covers."""
    lines = []
    for r in rows:
        mem, disk = r.get("cache_peak_mb", (None, None))
        if mem is None and disk is None:
            continue
        spilled = "" if disk else " Nothing spilled to disk: the entries fit the strategy's host-memory budget."
        lines.append(
            f"\n- Cache footprint, {r['variant']}: at most {mem or 0.0:.1f} MB in host memory and {disk or 0.0:.1f} MB "
            f"on disk at an epoch end (mean over seeds of each run's largest). It is the current frozen boundary's "
            f"store only, validation snippets included when validation runs through the cached prefix (see the "
            f"lookups in the per-epoch cache hits): the previous boundary's entries are dropped when the boundary "
            f"moves, and while it advances both stores exist for a moment, so the footprint within an epoch can be "
            f"higher than at its end.{spilled}"
        )
    return "".join(lines)


def _val_share(rows: list[dict[str, Any]]) -> str:
    shares = [r["val"][0] / r["fit"][0] for r in rows if r.get("runs") and r["fit"][0] > 0]
    if not shares:
        return "an unknown share"
    low, high = f"{100 * min(shares):.0f}", f"{100 * max(shares):.0f}"
    return f"{low}%" if low == high else f"{low}-{high}%"


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in values.items()}


if __name__ == "__main__":
    sys.exit(main())
