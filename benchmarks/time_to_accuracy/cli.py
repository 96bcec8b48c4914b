"""The command line: arguments, the plan and its estimate, the runs (interleaved per seed, ``--resume``) and the report."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from examples.assets import fetch

from .data import BenchData, tokens_per_batch
from .estimate import CALIBRATIONS, estimate_seconds
from .models import MODELS
from .paired import plateau_target
from .paired_report import frontier_curves, frontier_times, paired_goal_text, paired_rows, paired_table
from .plots import (
    frontier_plot_path_for,
    plot_path_for,
    speedup_plot_path_for,
    write_frontier_plot,
    write_plot,
    write_speedup_plot,
)
from .report import (
    ROOT,
    bound_text,
    cache_text,
    commits_text,
    epoch_table,
    exactness_text,
    goal_text,
    markdown_table,
    ran_text,
    training_table,
    write_docs,
)
from .runner import anneal_supported, cache_supported, check_interval, interval_supported, peft_supported, quiet, run_one
from .summary import GOAL_DROP, summarize
from .variants import (
    KINDS,
    RunRecord,
    Variant,
    early_stopping_variants,
    issue41_variants,
    llrd_variants,
    peer_variants,
    smooth_variants,
    sub_epoch_variants,
)
from .verdict import verdict_text

__all__ = ["main", "parse_args"]

#: The first line of the package's docstring (``--help``).
DESCRIPTION = "Time-to-accuracy on real data: full fine-tuning vs AutoFreeze (+ AutoCache, smooth freezing, LLRD) vs peers (issues 8, 17, 25)."

#: Settings of the benchmark and of ``--smoke`` (one thread: on a machine busy with other jobs,
#: two OpenMP threads spinning against them made steps ~9x slower in our smoke runs).
FULL: dict[str, Any] = {"train_size": 3000, "val_size": None, "epochs": 5, "seeds": "0,1,2"}
SMOKE: dict[str, Any] = {"train_size": 960, "val_size": 320, "epochs": 3, "seeds": "0,1", "threads": 1}

DEFAULT_DOCS = ROOT / "docs" / "benchmarks.md"

#: The 12-layer setting (issue 34, ``--model mpnet-base``): the defaults it gives every argument the command
#: line leaves open. Sized for about 6 hours of ONE core for 3 seeds (the reasons are in docs/benchmarks_34.md;
#: ``--dry-run`` prints the estimate): 3 epochs, the fewest where the cache serves training steps (a snippet is
#: stored at its first visit after a freeze and served from the next epoch on), 1,500 training snippets (what
#: one core affords at 3 epochs: 7 ms per token for a training step of MPNet-base), 1,500 validation snippets
#: for the final paired accuracy, checks on a fixed subset of 250 every quarter epoch (the time-to-accuracy
#: curve, the frontier and EarlyStopping's signal). Rows: full fine-tuning, EarlyStopping, freeze+cache at
#: epoch starts, the best sub-epoch rule of the MiniLM runs (autofreeze p50 every 0.25 epoch), LoRA and
#: BaseFinetuning (embeddings + the lower half).
MPNET: dict[str, Any] = {
    "train_size": 1500, "val_size": 1500, "epochs": 3, "seeds": "0,1,2", "threads": 1,
    "variants": "full,es,cache,sub,lora,bft", "intervals": "0.25", "sub_rules": "autofreeze", "bft_blocks": 6,
    "val_subset": "250", "llrd": "none", "tta_target": "plateau", "docs": ROOT / "docs" / "benchmarks_34.md",
    "json": ROOT / "docs" / "time_to_accuracy_34.json", "compare": ROOT / "docs" / "time_to_accuracy.json",
}  # fmt: skip
#: Issue 41 (``--issue 41``, MPNet-base): every row paired with full fine-tuning of the same seed, 5 seeds on one core.
#: The peers (BaseFinetuning of the embeddings + 6 lower blocks, LoRA r=8, EarlyStopping) and the rows of ours:
#: the same BaseFinetuning callback under the cache, with 6 and with 8 lower blocks (a static freeze + cache; the 8
#: from issue 41's step-cost table: 2.4-2.5x projected), AutoFreeze's early rule ("plasticity", no block count) +
#: cache, and LoRA on the upper blocks with the embeddings + 6 lower blocks frozen and served by the cache. Its
#: own report and records (issue 34's stay as they are), issue 34's records beside it (``--compare``).
ISSUE41: dict[str, Any] = {
    **MPNET, "seeds": "0,1,2,3,4", "variants": "full,es,lora,bft,bftc,early,lorac", "bftc_blocks": "6,8",
    "docs": ROOT / "docs" / "benchmarks_41.md", "json": ROOT / "docs" / "time_to_accuracy_41.json",
    "compare": ROOT / "docs" / "time_to_accuracy_34.json",
}  # fmt: skip
#: ``--model mpnet-base --smoke``: one seed, tiny sizes, every row (a few minutes on one idle core).
MPNET_SMOKE: dict[str, Any] = {
    **MPNET, "train_size": 48, "val_size": 48, "epochs": 3, "seeds": "0", "val_subset": "32", "batch_size": 16, "max_length": 32,
    "docs": ROOT / "outputs" / "smoke34" / "benchmarks.md", "json": None, "compare": None,
}  # fmt: skip


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


def parse_intervals(text: str) -> list[tuple[float | int, str]]:
    """``"0.25,0.5,24"`` -> [(0.25, "0.25"), (0.5, "0.5"), (24, "24")]: fractions of an epoch, or optimizer steps."""
    out: list[tuple[float | int, str]] = []
    for item in (i.strip() for i in text.split(",") if i.strip()):
        try:
            value: float | int = int(item) if item.isdigit() else float(item)
        except ValueError:
            raise SystemExit(f"--intervals: {item!r} is neither a fraction of an epoch (0.25) nor a number of steps (24).") from None
        if isinstance(value, float) and not 0 < value <= 1:
            raise SystemExit(f"--intervals: a fraction of an epoch must be in (0, 1], got {item}.")
        if isinstance(value, int) and value < 1:
            raise SystemExit(f"--intervals: a number of optimizer steps must be >= 1, got {item}.")
        out.append((value, item))
    return out

def parse_smooth(text: str) -> list[tuple[str, float | int, str]]:
    """``"paper@0.25,autofreeze@0.5"`` -> [("paper", 0.25, "0.25"), ("autofreeze", 0.5, "0.5")]: rule@interval rows."""
    out: list[tuple[str, float | int, str]] = []
    for item in (i.strip() for i in text.split(",") if i.strip()):
        rule, _, interval = item.partition("@")
        if rule not in ("paper", "autofreeze", "schedule") or not interval:
            raise SystemExit(f"--smooth: {item!r} is not RULE@INTERVAL with RULE paper, autofreeze or schedule (e.g. paper@0.25).")
        out += [(rule, value, itext) for value, itext in parse_intervals(interval)]
    return out


def parse_optional_float(text: str, flag: str) -> float | None:
    """A number, or ``none`` / ``all`` / ``0`` for "off"."""
    if text.strip().lower() in ("none", "all", "off", "0", ""):
        return None
    try:
        return float(text)
    except ValueError:
        raise SystemExit(f"{flag}: {text!r} is not a number (or none).") from None


#: The values the arguments added by issue 25 had before it, for records that lack them (``--resume``).
LEGACY = {"val_every": 1.0, "val_subset": None, "val_subset_seed": 0, "model": "minilm-l6"}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = _parser()
    # The model picks the setting: its preset becomes the defaults, so any flag given still wins.
    first, _ = p.parse_known_args(argv)
    if first.issue == 41:  # the 12-layer setting with issue 41's rows, seeds, report and records
        smoke = {**MPNET_SMOKE, "variants": ISSUE41["variants"], "bftc_blocks": ISSUE41["bftc_blocks"],
                 "docs": ROOT / "outputs" / "smoke41" / "benchmarks.md"}  # fmt: skip
        p.set_defaults(model="mpnet-base", **(smoke if first.smoke else ISSUE41))
    elif first.model == "mpnet-base":
        p.set_defaults(**(MPNET_SMOKE if first.smoke else MPNET))
    args = p.parse_args(argv)
    return _finish(p, args)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.time_to_accuracy", description=DESCRIPTION)
    p.add_argument("--model", choices=sorted(MODELS), default="minilm-l6",
                   help="the pretrained encoder (default minilm-l6, the 6-block setting of issues 8-25). mpnet-base: the "
                        "12-layer setting of issue 34, whose preset sets every default below that it names (see "
                        "benchmarks/time_to_accuracy/README.md)")  # fmt: skip
    p.add_argument("--issue", type=int, choices=(41,), default=None,
                   help="41: the 12-layer setting (implies --model mpnet-base) with issue 41's rows (full, es, lora, bft, "
                        "bftc, early, lorac), seeds 0-4, the report docs/benchmarks_41.md and the records "
                        "docs/time_to_accuracy_41.json; issue 34's records stay as they are")  # fmt: skip
    p.add_argument("--bftc-blocks", default="6",
                   help="bftc rows (issue 41): the BaseFinetuning callback under PipeTransformerStrategy(cache=True, "
                        "cache_frozen_eval=True), one row per count of lower blocks frozen with the embeddings "
                        "(--issue 41: 6,8)")  # fmt: skip
    p.add_argument("--early-rule", default="plasticity", choices=("plasticity", "paper", "autofreeze"),
                   help="early row (issue 41): AutoFreeze's rule, with the cache (default plasticity: no block count)")
    p.add_argument("--early-ratio", default="2/3",
                   help="early row: PlasticityRule(ratio=...), the share of the most-moved block below which a leading "
                        "block freezes (default 2/3, the rule's default)")  # fmt: skip
    p.add_argument("--early-interval", default="0.0625",
                   help="early row: AutoFreeze(freeze_interval=...), a fraction of an epoch (default 0.0625, the rule's default)")
    p.add_argument("--lorac-blocks", type=int, default=6,
                   help="lorac row (issue 41): LoRA (--lora-*) on the blocks above this many, which stay frozen with the "
                        "embeddings and are served by the cache (default 6)")  # fmt: skip
    p.add_argument("--es-patience", type=int, default=2,
                   help="the EarlyStopping row (es): validation checks without improvement before it stops (default 2: half an epoch at --val-every 0.25)")
    p.add_argument("--tta-target", choices=("last", "plateau"), default="last",
                   help="time-to-accuracy target: the baseline's mean accuracy at its last check (last, the MiniLM pages), or its "
                        "plateau, the mean of its checks over the second half of training (plateau, issue 34), minus 0.3 points")  # fmt: skip
    p.add_argument("--compare", type=Path, default=None,
                   help="with --write: another run's records (e.g. the MiniLM rows, docs/time_to_accuracy.json) whose paired "
                        "table goes beside this run's in the report")  # fmt: skip
    p.add_argument("--commit", action="store_true",
                   help="git-commit the --json records after every run (a long run's records survive the machine), and "
                        "with --write the report and its PNGs at the end")
    p.add_argument("--smoke", action="store_true", help="tiny preset: 960/320 snippets, 3 epochs, seeds 0,1, 1 thread unless --threads (~5 min idle, ~10 loaded)")
    p.add_argument("--train-size", type=int, default=None, help="training snippets (default 3000; smoke 960)")
    p.add_argument("--val-size", type=int, default=None,
                   help="validation snippets (default: the whole held-out side, ~5,100; smoke 320)")  # fmt: skip
    p.add_argument("--epochs", type=int, default=None, help="epoch budget (default 5; smoke 3)")
    p.add_argument("--seeds", default=None, help="comma-separated training seeds (default 0,1,2; smoke 0,1)")
    p.add_argument("--variants", default=",".join(k for k in KINDS if k != "es"),
                   help="any of full (the baseline), freeze and cache (AutoFreeze at epoch starts, without / with AutoCache), "
                        "sub (freeze+cache with freeze points inside epochs: --intervals x --sub-rules), smooth (the --smooth "
                        "rows with AutoFreeze(anneal=--anneal), without and with --llrd), llrd (full fine-tuning with --llrd), "
                        "lora (peft LoRA), bft (Lightning's BaseFinetuning), es (full fine-tuning with Lightning's EarlyStopping "
                        "on the checks, --es-patience); default: all but es. Without full, ratios are "
                        "freeze+cache vs freeze and --write needs a --docs path of its own")  # fmt: skip
    p.add_argument("--alphas", default="1/3", help="AutoFreeze alphas for the epoch-level freeze/cache variants, e.g. 1/4,1/3,1/2")
    p.add_argument("--sweep-alphas", default="", help="extra epoch-level freeze+cache variants at these alphas (the accuracy cost of other settings), e.g. 1/4,1/2")
    p.add_argument("--sweep-seeds", type=int, default=None, help="run the sweep variants on the first N seeds only (default: all)")
    p.add_argument("--rule", choices=("schedule", "paper", "autofreeze"), default="schedule",
                   help="AutoFreeze rule of the epoch-level rows (default schedule: the geometric plan, as the issue's anchor ran)")  # fmt: skip
    p.add_argument("--intervals", default="0.25,0.5",
                   help="sub-epoch rows: AutoFreeze(freeze_interval=...) values, a fraction of an epoch (0.25) or a number "
                        "of optimizer steps (24)")  # fmt: skip
    p.add_argument("--sub-rules", default="paper,autofreeze", help="sub-epoch rows: AutoFreeze rules, any of paper,autofreeze,schedule")
    p.add_argument("--sub-alphas", default="1/3", help="sub-epoch rows: alphas of the paper and schedule rules (autofreeze takes none)")
    p.add_argument("--percentile", type=float, default=50.0, help="sub-epoch rows: the autofreeze rule's percentile (default 50)")
    p.add_argument("--sub-min-active", type=int, default=1, help="sub-epoch rows: AutoFreeze min_active (blocks never frozen; default 1)")
    p.add_argument("--smooth", default="paper@0.25,autofreeze@0.5,autofreeze@0.25",
                   help="smooth rows: RULE@INTERVAL freeze+cache rows run with AutoFreeze(anneal=--anneal) (default: the rows "
                        "that led in issue 17's run: paper every 0.25 epoch, autofreeze p50 every 0.5 and 0.25 epoch); the "
                        "paper rule uses the first --sub-alphas, autofreeze --percentile")  # fmt: skip
    p.add_argument("--anneal", choices=("cosine", "linear"), default="cosine",
                   help="smooth rows: the annealing curve of the blocks' learning rate before their freeze (FreezeOut's cosine by default)")
    p.add_argument("--llrd", default="0.8",
                   help="layer-wise learning-rate decay of the smooth rows' second copy and of the llrd row (full fine-tuning): "
                        "block i of L trains at lr * llrd^(L-1-i), the embeddings at lr * llrd^L (default 0.8; none: no LLRD rows)")  # fmt: skip
    p.add_argument("--val-every", type=float, default=0.25,
                   help="validation checks every this fraction of an epoch's optimizer steps, counted across epochs, on "
                        "--val-subset: the time-to-accuracy curve (default 0.25). The final accuracy is on the whole "
                        "validation set after training. --val-every 1 --val-subset all is the schedule of the records "
                        "before issue 25 (the whole set at every epoch end)")  # fmt: skip
    p.add_argument("--val-subset", default="1000",
                   help="snippets of the fixed validation subset the checks run on (default 1000; all: the whole set)")
    p.add_argument("--val-subset-seed", type=int, default=0, help="seed of the validation subset's draw (default 0; the same for every run)")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank (default 8)")
    p.add_argument("--lora-alpha", type=int, default=16, help="LoRA scaling alpha (default 16)")
    p.add_argument("--lora-dropout", type=float, default=0.1, help="LoRA dropout (default 0.1)")
    p.add_argument("--lora-lr", type=float, default=5e-4,
                   help="LoRA's peak learning rate (default 5e-4: the LoRA paper's for RoBERTa-base on SST-2; at --lr=5e-5 "
                        "LoRA barely learns in 5 epochs, 52.6%% on seed 0 of 2026-12-01); the same warm-up and linear decay as every row")  # fmt: skip
    p.add_argument("--bft-blocks", type=int, default=3, help="BaseFinetuning: lower blocks frozen with the embeddings (default 3 of 6)")
    p.add_argument("--padding", choices=("bucket", "trim", "max"), default="bucket")
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--val-batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--accelerator", "--device", dest="accelerator", default="cpu",
                   help="cpu (default) or cuda: Lightning's accelerator, and where the final evaluation runs")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice). On a machine busy with other jobs, fewer threads "
                        "than cores avoids OpenMP threads spinning against each other, which can inflate times many-fold")  # fmt: skip
    p.add_argument("--json", type=Path, default=None,
                   help="raw per-run records (default outputs/benchmarks/time_to_accuracy.json; with another --docs under docs/, "
                        "outputs/benchmarks/<docs stem>.json, so a partial run keeps the full benchmark's records; with a --docs "
                        "outside docs/, <docs without .md>.json next to it)")  # fmt: skip
    p.add_argument("--resume", type=Path, default=None,
                   help="a --json of an earlier, interrupted run of the same setting: its (variant, seed) records are kept "
                        "and not rerun (a run of all seeds can span several sittings)")  # fmt: skip
    p.add_argument("--note", default="", help="with --write: a sentence on how the run went (sittings, reruns), shown at the top of the report")
    p.add_argument("--write", action="store_true", help="write the report (--docs) and its PNGs next to it")
    p.add_argument("--dry-run", action="store_true", help="load the data, print the plan and the duration estimate, and stop")
    p.add_argument("--docs", type=Path, default=DEFAULT_DOCS,
                   help="the markdown report --write writes (default docs/benchmarks.md, the full benchmark's); "
                        "its plot goes next to it as <stem>_time_to_accuracy.png")  # fmt: skip
    return p


def _finish(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Fill the presets' remaining defaults, parse the lists and check what depends on several flags."""
    if args.json is None:
        docs = args.docs.resolve()
        if docs.is_relative_to((ROOT / "docs").resolve()):
            stem = "time_to_accuracy" if docs == DEFAULT_DOCS.resolve() else args.docs.stem
            args.json = ROOT / "outputs" / "benchmarks" / f"{stem}.json"
        else:  # a report outside docs/ (a smoke or partial run under outputs/): its records next to it
            args.json = docs.with_suffix(".json")
    # --smoke fills only what the command line left open: `--smoke --train-size 960` works.
    preset = SMOKE if args.smoke else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    kinds = [k.strip() for k in args.variants.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        p.error(f"--variants takes any of {','.join(KINDS)}, got {args.variants!r}.")
    args.interval_list = parse_intervals(args.intervals) if "sub" in kinds else []
    args.smooth_list = parse_smooth(args.smooth) if "smooth" in kinds else []
    args.llrd = parse_optional_float(args.llrd, "--llrd")
    if args.llrd is not None and not 0 < args.llrd <= 1:
        p.error(f"--llrd must be in (0, 1] (1: no decay), got {args.llrd}.")
    subset = parse_optional_float(args.val_subset, "--val-subset")
    if subset is not None and (subset != int(subset) or subset < 1):
        p.error(f"--val-subset takes a positive number of snippets or all, got {args.val_subset!r}.")
    args.val_subset = int(subset) if subset is not None else None
    if not 0 < args.val_every <= 1:
        p.error(f"--val-every is a fraction of an epoch in (0, 1], got {args.val_every}.")
    args.sub_rule_list = [r.strip() for r in args.sub_rules.split(",") if r.strip()]
    if "sub" in kinds and (not args.sub_rule_list or any(r not in ("paper", "autofreeze", "schedule") for r in args.sub_rule_list)):
        p.error(f"--sub-rules takes paper, autofreeze and/or schedule, got {args.sub_rules!r}.")
    args.sub_alpha_list = parse_alphas(args.sub_alphas)
    if "full" not in kinds and args.write and args.docs.resolve() == DEFAULT_DOCS.resolve():
        p.error(
            f"--variants {args.variants} has no full fine-tuning baseline, so its report must not replace "
            f"{DEFAULT_DOCS.relative_to(ROOT)} (the full benchmark's): pass --docs PATH, e.g. docs/cache_benchmark.md."
        )
    if args.es_patience < 1:
        p.error(f"--es-patience must be >= 1 validation check, got {args.es_patience}.")
    if "es" in kinds and args.val_subset is None and args.val_every >= 1.0:
        p.error("the EarlyStopping row needs validation checks inside the run: keep --val-every below 1 or a --val-subset.")
    args.kinds = kinds
    try:
        args.bftc_block_list = [int(b) for b in str(args.bftc_blocks).split(",") if b.strip()]
    except ValueError:
        p.error(f"--bftc-blocks takes comma-separated block counts, got {args.bftc_blocks!r}.")
    args.early_ratio_value = parse_alphas(args.early_ratio)[0]
    interval = parse_intervals(args.early_interval)[0][0]
    if not isinstance(interval, float):
        p.error(f"--early-interval is a fraction of an epoch (0.0625), got {args.early_interval!r}.")
    args.early_interval_value = interval
    args.alpha_list = parse_alphas(args.alphas)
    args.sweep_list = [a for a in parse_alphas(args.sweep_alphas) if a not in args.alpha_list] if args.sweep_alphas else []
    return args

def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the tables; with ``--write`` write the ``--docs`` report and its PNG."""
    args = parse_args(argv)
    quiet()
    if args.threads:
        torch.set_num_threads(args.threads)
    given = list(argv if argv is not None else sys.argv[1:])
    if "--note" in given:  # the note is printed on its own at the top of the report
        at = given.index("--note")
        given[at : at + 2] = ["--note", "..."]
    command = "python -m benchmarks.time_to_accuracy " + " ".join(shlex.quote(a) for a in given)
    spec = MODELS[args.model]
    args.blocks = spec.blocks  # the estimate's and the report's block count
    model_dir = str(fetch(spec.asset))
    if args.accelerator in ("cuda", "gpu"):
        if not torch.cuda.is_available():
            raise SystemExit("time_to_accuracy: --device cuda, but this torch sees no CUDA device (torch.cuda.is_available() is False).")
        torch.backends.cuda.matmul.allow_tf32 = True  # every row alike; fp32 weights and optimizer states
        torch.backends.cudnn.allow_tf32 = True
    has_cache = cache_supported()
    variants: list[Variant] = [Variant("full")] if "full" in args.kinds else []
    variants += early_stopping_variants(args)
    variants += llrd_variants(args) if "llrd" in args.kinds else []
    for kind in ("freeze", "cache"):
        if kind in args.kinds:
            variants += [Variant(kind, a, t) for a, t in args.alpha_list]  # type: ignore[arg-type]
    sweep = [Variant("cache", a, t) for a, t in args.sweep_list]  # type: ignore[arg-type]
    variants += sweep
    sub = sub_epoch_variants(args) if "sub" in args.kinds else []
    smooth = smooth_variants(args) if "smooth" in args.kinds else []
    variants += sub + smooth + peer_variants(args) + issue41_variants(args)
    sweep_seeds = args.seed_list[: args.sweep_seeds] if args.sweep_seeds is not None else args.seed_list
    requested = list(variants)
    cache_note = "" if has_cache else "**Skipped in this run: variant 3 needs AutoCache (not merged yet).**"
    if not has_cache and any(v.kind == "cache" for v in variants):
        print("time_to_accuracy: variant 3 needs AutoCache (not merged yet): PipeTransformerStrategy takes no cache= argument; skipping it.", flush=True)  # fmt: skip
        variants = [v for v in variants if v.kind != "cache"]
    if (sub or smooth) and not interval_supported():
        print("time_to_accuracy: this AutoFreeze takes no freeze_interval / rule='autofreeze' (issue 17): skipping the sub-epoch rows.", flush=True)  # fmt: skip
        variants = [v for v in variants if not v.sub_epoch]
    if smooth and not anneal_supported():
        print("time_to_accuracy: this AutoFreeze takes no anneal= (issue 25): skipping the smooth rows.", flush=True)
        variants = [v for v in variants if not v.anneal]
    if "lora" in args.kinds and not peft_supported():
        print('time_to_accuracy: the LoRA row needs peft: pip install -e ".[benchmarks]"; skipping it.', flush=True)
        variants = [v for v in variants if v.kind != "lora"]

    dm = BenchData(
        seed=args.seed_list[0], padding=args.padding, val_batch_size=args.val_batch_size, tokenizer=model_dir,
        train_size=args.train_size, val_size=args.val_size, max_length=args.max_length, batch_size=args.batch_size,
        val_subset=args.val_subset, val_subset_seed=args.val_subset_seed,
    )  # fmt: skip
    dm.setup("fit")
    assert dm.train_set is not None and dm.val_set is not None
    n_train, n_val = len(dm.train_set), len(dm.val_set)
    tokens = {p: tokens_per_batch(dm, p) for p in ("max", "trim", "bucket")}  # type: ignore[arg-type]
    steps = len(dm.train_dataloader())
    args.steps_per_epoch = steps  # the validation checks' interval (runner.check_interval)
    every = check_interval(args, steps)
    subset = dm.subset_indices()
    n_check = len(subset) if subset is not None else n_val
    start = time.perf_counter()
    for _ in dm.train_dataloader():
        pass
    load_s = time.perf_counter() - start
    val_tokens = sum(b["input_ids"].numel() for b in dm.full_val_dataloader())
    check_tokens = sum(b["input_ids"].numel() for b in dm.val_dataloader())
    per_run = {
        v.name: estimate_seconds(v, args.epochs, steps, tokens[args.padding], val_tokens, n_train, n_val, args,
                                 check_every=every, check_tokens=check_tokens)
        for v in requested
    }  # fmt: skip
    est = sum(per_run[v.name] * (len(sweep_seeds) if v in sweep else len(args.seed_list)) for v in requested)
    skipped = " (skipped variants included)" if len(requested) > len(variants) else ""
    print(
        f"time_to_accuracy: {n_train} train / {n_val} val snippets, {args.epochs} epochs, seeds {args.seed_list}, "
        f"padding={args.padding} ({tokens[args.padding]:.0f} tokens per batch of {args.batch_size}; trim "
        f"{tokens['trim']:.0f}, max {tokens['max']:.0f}), {steps} steps per epoch; "
        + (f"validation checks every {every} optimizer steps on a fixed subset of {n_check} snippets (seed {args.val_subset_seed}), "
           f"the whole {n_val} once after training; " if every is not None else f"validation on all {n_val} snippets at every epoch end; ")
        + f"variants: {', '.join(v.name for v in variants)}.\n"
        f"time_to_accuracy: estimated seconds per run (training + validation + set-up): "
        + "; ".join(f"{name} {sec:.0f}" for name, sec in per_run.items()) + ".\n"
        f"time_to_accuracy: estimated duration on {CALIBRATIONS[args.model].machine}{skipped}: {est / 60:.0f} min "
        + ("(+-30%: calibrated on the 2026-12-01 run of this benchmark; " if args.model == "minilm-l6" else
           "(from a few timed training steps on one core, not from a run: +-50%; the freeze rows' step costs are issue "
           "41's measurement of MPNet's steps with 6, 8 and 10 blocks frozen, the EarlyStopping row is counted as if it "
           "never stopped; ")
        + "the sub-epoch rules' freezing is an assumption, see planned_frozen; a loaded machine takes longer"
        + ("; on CUDA the estimate does not apply: it is for the CPU" if args.accelerator in ("cuda", "gpu") else "")
        + f"). {len(requested)} rows x {len(args.seed_list)} seeds.",
        flush=True,
    )
    if args.dry_run:
        return 0

    records: list[RunRecord] = []
    kept = resumed_records(args, variants) if args.resume else {}
    for seed in args.seed_list:  # seeds outside, variants inside: the variants share the noise
        for v in variants:
            if v in sweep and seed not in sweep_seeds:
                continue
            if (v.name, seed) in kept:
                records.append(kept[(v.name, seed)])
                print(f"time_to_accuracy: seed {seed} {v.name}: kept from {args.resume}", flush=True)
                continue
            t0 = time.perf_counter()
            rec = run_one(v, seed, dm, args, model_dir)
            records.append(rec)
            status = rec.error or (
                f"train {rec.train_s:.0f} s, val {rec.val_s:.0f} s, acc {100 * (rec.final_acc or math.nan):.2f}%"
                + (f", freezes {' '.join(f'{a}:{b}' for a, b in rec.freezes)}" if rec.freezes else "")
            )
            print(f"time_to_accuracy: seed {seed} {v.name}: {status} ({time.perf_counter() - t0:.0f} s wall)", flush=True)
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"command": command, "args": _jsonable(vars(args)), "records": [asdict(r) for r in records]}, indent=1))
            if args.commit:
                commit_records(args.json, f"benchmark records: seed {seed} {v.name} ({len(records)} in {args.json.name})")

    baseline = [r for r in records if r.variant == Variant("full").name]
    plateau = plateau_target(baseline, GOAL_DROP) if args.tta_target == "plateau" else None
    rows, target = summarize(records, variants, target=plateau)
    table = markdown_table(rows, target)
    print("\n" + table + "\n", flush=True)
    print(training_table(rows, MODELS[args.model].blocks) + "\n", flush=True)
    print(epoch_table(rows) + "\n", flush=True)
    goal = goal_text(rows, records, MODELS[args.model].blocks)
    paired, times, curves = paired_section(records, variants, target, args)
    goal += "\n\n" + paired
    print(goal + "\n", flush=True)
    if args.write:
        plot, speed_plot = plot_path_for(args.docs), speedup_plot_path_for(args.docs)
        title = MODELS[args.model].title
        write_plot(records, variants, target, plot, title)
        if target is not None:
            write_speedup_plot(rows, speed_plot, title)
        if times:
            write_frontier_plot(times, curves, variants, target, frontier_plot_path_for(args.docs), title)
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
            + (
                f"- Evaluation: the checks over {n_check} snippets every {every} optimizer steps took {val_frac} of each run's "
                f"wall time (the final evaluation over all {n_val} after training, {_final_eval_text(records)}, is outside it). "
                if every is not None else
                f"- Evaluation: validation over {n_val} snippets every epoch took {val_frac} of each run's wall time. "
            )
            + f"Batches are sorted by length, {args.val_batch_size} per batch, with no gradients. It is kept out of "
            f"the training time, and evaluating less often would cut it.\n"
            + ("- Optimizer: fused AdamW (the example's default) cost ~13 ms per step on this kind of CPU, against ~83 ms "
               "for the default implementation (measured earlier on this kind of CPU; not timed in this run). Once the embeddings freeze, their 11.7 M parameters, "
               "half the model, leave the update.\n" if args.model == "minilm-l6" else
               "- Optimizer: fused AdamW (the example's default). Once the embeddings freeze, their 23.8 M parameters (the "
               "30,527-token vocabulary at width 768), a fifth of MPNet-base, leave the update.\n")
            + "- A sub-epoch freeze point stores nothing for the snippets already seen in the epoch: they miss the cache "
            "once, at their next visit, and are stored then (see the cache hits per epoch)."
        )
        where += bound_text(rows, args.epochs) + cache_text(rows) + exactness_text(records, variants)
        body = {
            "command": command, "table": table, "training": training_table(rows, MODELS[args.model].blocks), "epochs": epoch_table(rows),
            "where": where, "cache_note": cache_note, "goal": goal, "steps": str(steps), "n_check": str(n_check),
            "peft_version": _version("peft"),
            "ran": ran_text(records, variants),
            "commits": commits_text(records),
            "setting": (
                f"{n_train} training snippets and {n_val} validation snippets, split by movie (data split seed 0). "
                f"Max length {args.max_length}, padding `{args.padding}`, batch {args.batch_size}, {args.epochs} epochs "
                f"({steps} optimizer steps each), seeds {args.seed_list}. Epoch-level AutoFreeze rows: rule `{args.rule}`, "
                f"alphas {args.alphas}"
                + (f"; alpha sweep (freeze+cache only) {args.sweep_alphas} on seeds {sweep_seeds}" if sweep else "")
                + (f". Sub-epoch rows: intervals {args.intervals}, rules {args.sub_rules}, alphas {args.sub_alphas}, "
                   f"percentile {args.percentile:g}, min_active {args.sub_min_active}" if sub else "")
                + (f". Smooth rows: {args.smooth}, anneal {args.anneal}" + (f", with and without LLRD {args.llrd:g}" if args.llrd else "")
                   if smooth else "")
                + (f". Validation: checks every {every} optimizer steps ({args.val_every:g} epoch) on a fixed subset of {n_check} "
                   f"snippets (seed {args.val_subset_seed}) and at the end of training; the final accuracy on all {n_val}"
                   if every is not None else ". Validation: all snippets at every epoch end")
                + "."
            ),
        }  # fmt: skip
        write_docs(args.docs, (plot, speed_plot), args, body, variants, target)
        print(f"time_to_accuracy: wrote {args.docs}, {plot}" + (f", {speed_plot}" if target is not None else "") + f" and {args.json}", flush=True)
        if args.commit:
            written = [args.docs, plot, speed_plot, frontier_plot_path_for(args.docs), args.json]
            commit_records(written, f"benchmark report: {args.docs.name} from {len(records)} records")
    return 1 if any(r.error for r in records) else 0

#: The arguments that define the setting: a resumed record must come from a run with the same ones. The
#: validation schedule is among them: it changes what every row measures (and costs).
SETTING_ARGS = (
    "train_size", "val_size", "epochs", "padding", "max_length", "batch_size", "val_batch_size", "lr", "accelerator", "threads",
    "val_every", "val_subset", "val_subset_seed", "model",
)  # fmt: skip
#: Arguments that change only some rows: when they differ, those rows are rerun and the others kept. (The
#: smooth rows' curve, rule, interval and LLRD are in their names: another value is another row.)
ROW_ARGS = {
    "lora": ("lora_r", "lora_alpha", "lora_dropout", "lora_lr"),
    "bft": ("bft_blocks",),
    "es": ("es_patience",),
    "sub": ("percentile", "sub_min_active"),
    "lorac": ("lora_r", "lora_alpha", "lora_dropout", "lora_lr"),
    "smooth": ("percentile", "sub_min_active"),
    "epoch-level": ("rule",),
}


def _row_group(v: Variant) -> str:
    if v.kind in ("lora", "bft", "llrd", "es", "bftc", "early", "lorac"):
        return v.kind  # bftc's count and early's rule, ratio and interval are in their names
    if v.anneal:
        return "smooth"
    return "sub" if v.sub_epoch else ("epoch-level" if v.autofreeze else "full")


def resumed_records(args: argparse.Namespace, variants: list[Variant]) -> dict[tuple[str, int], RunRecord]:
    """The error-free records of ``--resume`` for this run's rows, keyed by (variant name, seed).

    Refuses a record file of another setting (data, epochs, batches, learning rate); when only a
    row's own arguments differ (``--lora-lr``, ``--bft-blocks``, ...), that row is rerun.
    """
    saved = json.loads(args.resume.read_text())
    theirs, ours = {**LEGACY, **saved.get("args", {})}, _jsonable(vars(args))
    differ = [k for k in SETTING_ARGS if theirs.get(k) != ours.get(k)]
    if differ:
        hint = (
            " The validation schedule changed (issue 25: checks every --val-every epoch on --val-subset snippets): every "
            "row measures differently, so this is a fresh run: give it a fresh --json (e.g. --json "
            "outputs/benchmarks/time_to_accuracy_25.json) and no --resume; or pass --val-every 1 --val-subset all "
            "to add rows to these records under their schedule."
            if any(k in ("val_every", "val_subset", "val_subset_seed") for k in differ) else ""
        )
        raise SystemExit(
            f"time_to_accuracy: --resume {args.resume} was run with another setting ({', '.join(f'{k}={theirs.get(k)!r} here {ours.get(k)!r}' for k in differ)}); "
            "rerun with the same arguments or without --resume." + hint
        )  # fmt: skip
    stale = {group for group, keys in ROW_ARGS.items() if any(theirs.get(k) != ours.get(k) for k in keys)}
    group_of = {v.name: _row_group(v) for v in variants}
    kept: dict[tuple[str, int], RunRecord] = {}
    for r in (RunRecord(**r) for r in saved["records"]):
        if r.error or r.variant not in group_of:
            continue
        if group_of[r.variant] in stale:
            print(f"time_to_accuracy: seed {r.seed} {r.variant}: rerun (its arguments changed since {args.resume})", flush=True)
            continue
        kept[(r.variant, r.seed)] = r
    return kept


def paired_section(
    records: list[RunRecord], variants: list[Variant], target: float | None, args: argparse.Namespace
) -> tuple[str, list[float], dict[str, list[float]]]:
    """The paired statistics (issue 34) as markdown, with the frontier's time grid and curves for its plot;
    with ``--compare``, the other run's paired table (the MiniLM rows) beside it."""
    if not any(v.baseline for v in variants):
        return "", [], {}
    names = [v.name for v in variants]
    rows = paired_rows(records, names, target)
    times = frontier_times(records)
    curves = frontier_curves(records, variants, times)
    how = (f"the baseline's plateau (the mean of its checks over the second half of training, mean over seeds) minus {GOAL_DROP:g} points"
           if args.tta_target == "plateau" else f"the baseline's mean accuracy at its last check minus {GOAL_DROP:g} points")  # fmt: skip
    text = (
        "### Paired with full fine-tuning (issue 34)\n\n"
        "Every row of a seed trains on the same snippets in the same order from the same head initialisation as full "
        "fine-tuning of that seed. Per seed: the row's final accuracy (whole validation set) minus the baseline's, and "
        "the baseline's training time over the row's; the mean difference with a 95% t-interval, the speed-ups as a "
        "geometric mean with a 95% interval (a t-interval of the log ratios). Time to accuracy: to the first check at or above "
        + (f"{100 * target:.2f}%, " if target is not None else "the target, ") + f"{how}.\n\n"
        + paired_table(rows) + "\n\n"
        + (f"![frontier]({frontier_plot_path_for(args.docs).name})\n\n" if times else "")
        + paired_goal_text(rows, variants, curves, times)
    )
    if any(v.kind in ("bftc", "early", "lorac") for v in variants):  # issue 41's rows: its goal, read from the same rows
        text += "\n\n" + verdict_text(rows, variants, records)
    if args.compare is not None and args.compare.is_file():
        other = [RunRecord(**r) for r in json.loads(args.compare.read_text())["records"]]
        other_names = list(dict.fromkeys(r.variant for r in other))
        other_base = [r for r in other if r.variant == Variant("full").name]
        other_target = plateau_target(other_base, GOAL_DROP)
        text += (
            f"\n\n#### For comparison: the rows of `{_relative(args.compare)}`, paired the same way\n\n"
            + paired_table(paired_rows(other, other_names, other_target))
        )
    return text, times, curves


def commit_records(paths: Path | Sequence[Path], message: str) -> None:
    """Commit these files alone (``git commit --only``: whatever else is staged stays staged). A failure is
    reported and the run goes on: the files are on disk either way."""
    import subprocess

    files = [str(p.resolve()) for p in ([paths] if isinstance(paths, Path) else paths) if p.exists()]
    if not files:
        return
    cwd = Path(files[0]).parent
    for cmd in (["git", "add", "--", *files], ["git", "commit", "-q", "--only", "-m", message, "--", *files]):
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"time_to_accuracy: --commit: `{' '.join(cmd[:3])} ...` failed ({(done.stderr or done.stdout).strip()[-300:]}); "
                  "the records are on disk, not committed.", flush=True)  # fmt: skip
            return


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _version(package: str) -> str:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:
        return ""

def _final_eval_text(records: list[RunRecord]) -> str:
    times = [r.final_eval_s for r in records if r.error is None and r.final_eval_s]
    return f"{min(times):.0f}-{max(times):.0f} s per run" if times else "not timed"


def _val_share(rows: list[dict[str, Any]]) -> str:
    shares = [r["val"][0] / r["fit"][0] for r in rows if r.get("runs") and r["fit"][0] > 0]
    if not shares:
        return "an unknown share"
    low, high = f"{100 * min(shares):.0f}", f"{100 * max(shares):.0f}"
    return f"{low}%" if low == high else f"{low}-{high}%"

def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in values.items()}
