"""The report: markdown tables, the goal and its bounds in words, and the ``--docs`` page."""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import torch

from .models import MODELS
from .summary import GOAL_DROP, GOAL_SPEEDUP, goal_status
from .variants import RunRecord, Variant

ROOT = Path(__file__).resolve().parents[2]

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


def _fmt(mean: float, sd: float, digits: int = 0, unit: str = "") -> str:
    if math.isnan(mean):
        return "-"
    if math.isnan(sd):
        return f"{mean:.{digits}f}{unit}"
    return f"{mean:.{digits}f} ± {sd:.{digits}f}{unit}"

def _mb_pair(mem: float | None, disk: float | None) -> str:
    """``"mem / disk"`` MB cell; ``-`` when the variant reported no cache bytes."""
    if mem is None and disk is None:
        return "-"
    return " / ".join("-" if v is None else f"{v:.1f}" for v in (mem, disk))

def markdown_table(rows: list[dict[str, Any]], target: float | None) -> str:
    """The summary table (mean ± sd over seeds)."""
    head = ["variant", "seeds", "train time (s)", "speed-up", "wall time with validation (s)", "wall speed-up",
            "final val acc (%)", "vs baseline (pt)",
            f"time to {100 * target:.2f}% (s)" if target is not None else "time to target (s)", "TTA speed-up",
            f"goal ({GOAL_SPEEDUP:g}x, -{GOAL_DROP:g} pt)"]  # fmt: skip
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
        wall = "-" if math.isnan(r["wall_speedup"]) else f"{r['wall_speedup']:.2f}x"
        if math.isnan(r["speedup"]) and r["variant"] in references:
            speedup = wall = "reference"
        if r["reference"] not in (None, "full fine-tuning", r["variant"]):
            speedup += f" vs {r['reference']}"
        delta = "-" if r["kind"] == "full" or math.isnan(r["delta"]) else f"{r['delta']:+.2f}"
        cells = [
            r["variant"], str(r["runs"]) + (f" (+{r['failed']} failed)" if r["failed"] else ""), _fmt(*r["train"]),
            speedup, _fmt(*r["fit"]), wall, _fmt(*r["acc"], digits=2), delta, tta,
            "-" if math.isnan(r["tta_speedup"]) else f"{r['tta_speedup']:.2f}x", goal_status(r),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def training_table(rows: list[dict[str, Any]], blocks: int = 6) -> str:
    """How each variant trains: what it updates, when it freezes, where its training time goes. With 6 blocks a
    column per frozen count (the MiniLM pages); deeper stacks list the counts that occurred, ``k: s (steps)``."""
    per_level = "0/1/2/3/4/5 frozen" if blocks == 6 else "k frozen, k: s (steps)"
    lines = [
        "| variant | trainable params at the end (M) | freezes, step:blocks (first seed) | frozen per epoch end | "
        f"train s (steps) at {per_level} | train s per epoch | validation (s) | cache MB, peak (mem / disk) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.get("runs"):
            continue
        freezes = " ".join(f"{s}:{f}" for s, f in r["freezes"]) or "-"
        if blocks == 6:
            at = " / ".join(
                f"{r['frozen_s'][f]:.0f} ({r['frozen_steps'][f]:.0f})" if f in r["frozen_s"] else "-" for f in range(6)
            ) if r["ours"] else "-"  # fmt: skip
        else:
            at = "; ".join(f"{f}: {r['frozen_s'][f]:.0f} ({r['frozen_steps'][f]:.0f})" for f in sorted(r["frozen_s"])) if r["ours"] else "-"
        cells = [
            r["variant"], f"{r['trainable_m']:.2f}", freezes,
            " ".join("0" if f == "-" else f.split("/")[0] for f in r["frozen"]) if r["ours"] else "-", at,
            " / ".join(f"{x:.0f}" for x in r["per_epoch"]), _fmt(*r["val"]), _mb_pair(*r["cache_peak_mb"]),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def epoch_table(rows: list[dict[str, Any]]) -> str:
    """Per-epoch means over seeds: training seconds, accuracy, cache MB at the epoch's end; frozen blocks
    and cache hits of the first seed."""
    lines = [
        "| variant | epoch | frozen | train s | val acc at the epoch's last check (%) | cache hits (first seed) | cache MB at epoch end (mem / disk) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for e, (s, a) in enumerate(zip(r.get("per_epoch", []), r.get("per_epoch_acc", []))):
            mb = _mb_pair(*r["per_epoch_cache_mb"][e])
            lines.append(f"| {r['variant']} | {e} | {r['frozen'][e]} | {s:.1f} | {a:.2f} | {r['cache_hits'][e]} | {mb} |")
    return "\n".join(lines)


def goal_text(rows: list[dict[str, Any]], records: list[RunRecord], blocks: int = 6) -> str:
    """Whether the goal (issue 25) is met, in words; if not, the closest variant and what bounds it."""
    base = next((r for r in rows if r["kind"] == "full" and r.get("runs")), None)
    if base is None:
        return "No full fine-tuning baseline ran: the goal (relative to it) cannot be judged."
    others = [r for r in rows if r["kind"] != "full" and r.get("runs") and not math.isnan(r["speedup"])]
    goal = f"at least {GOAL_SPEEDUP:g}x less training time than full fine-tuning at a mean final accuracy no more than {GOAL_DROP:g} points below it"
    met = [r for r in others if goal_status(r) == "met"]
    if met:
        names = "; ".join(f"**{r['variant']}** ({r['speedup']:.2f}x, {r['delta']:+.2f} points, {r['runs']} seed(s))" for r in met)
        return f"**The goal is met** ({goal}) by: {names}."
    lines = [f"**The goal is not met** ({goal}): no variant reaches both."]
    ours = [r for r in others if r["ours"]] or others
    accurate = sorted((r for r in ours if r["delta"] >= -GOAL_DROP), key=lambda r: -r["speedup"])
    fast = sorted((r for r in ours if r["speedup"] >= GOAL_SPEEDUP), key=lambda r: -r["delta"])
    if accurate:
        lines.append(f"- Fastest within {GOAL_DROP:g} points: **{accurate[0]['variant']}**, {accurate[0]['speedup']:.2f}x at {accurate[0]['delta']:+.2f} points.")
    if fast:
        lines.append(f"- Most accurate at {GOAL_SPEEDUP:g}x or more: **{fast[0]['variant']}**, {fast[0]['speedup']:.2f}x at {fast[0]['delta']:+.2f} points.")
    if not accurate and not fast:
        # Neither bound holds anywhere: the smallest sum of the two relative shortfalls.
        def shortfall(r: dict[str, Any]) -> float:
            return max(0.0, 1 - r["speedup"] / GOAL_SPEEDUP) + max(0.0, (-r["delta"] - GOAL_DROP) / GOAL_DROP)

        lines.append("- No AutoFreeze variant holds either bound.")
        accurate = sorted(ours, key=shortfall)
    closest = accurate[0] if accurate else fast[0]
    lines.append(
        f"- Closest: **{closest['variant']}** "
        + ("(the accuracy bound is the one the issue asks to keep; this is the fastest variant inside it)." if closest in accurate and closest["delta"] >= -GOAL_DROP
           else "(no variant keeps the accuracy; this one is the most accurate at the speed, or nearest to both).")
    )  # fmt: skip
    lines.append(bound_of(closest, base))
    if closest is not (fast[0] if fast else None) and fast:
        lines.append(f"- For {fast[0]['variant']}: the accuracy is what bounds it, {fast[0]['delta']:+.2f} points against the -{GOAL_DROP:g} allowed.")
    share = trained_share_text(records, {r["variant"] for r in others if r["ours"]}, blocks)
    if share:
        lines.append(share)
    return "\n".join(lines)


#: MiniLM-L6's blocks: what the share of trained block-steps is a share of (by default; MPNet passes 12).
NUM_BLOCKS = 6


def trained_share(freezes: list[list[int]], total_steps: int, num_blocks: int = NUM_BLOCKS) -> float:
    """The share of (block, optimizer step) pairs in which the block trained: block ``b`` trains until
    the first freeze event that covers it. 1.0 for a run that never freezes."""
    frozen_at = [total_steps] * num_blocks
    for step, count in freezes:
        for block in range(min(count, num_blocks)):
            frozen_at[block] = min(frozen_at[block], step)
    return sum(frozen_at) / (num_blocks * total_steps)


def trained_share_text(records: list[RunRecord], autofreeze_variants: set[str], blocks: int = NUM_BLOCKS) -> str:
    """Across the AutoFreeze runs (``autofreeze_variants``), how the accuracy cost follows the share of
    block-steps trained, and what a 3x run's share does to accuracy (paired with the same seed's baseline)."""
    base = {r.seed: r for r in records if r.variant == "full fine-tuning" and not r.error and r.final_acc is not None}
    points = []  # (share, points vs the same seed's baseline, speed-up vs it)
    for r in records:
        if r.variant not in autofreeze_variants or r.error or not r.frozen_steps or r.seed not in base or r.final_acc is None:
            continue
        total = int(sum(r.frozen_steps.values()))
        points.append((trained_share(r.freezes, total, blocks), 100 * (r.final_acc - base[r.seed].final_acc), base[r.seed].train_s / r.train_s))
    if len(points) < 3:
        return ""
    try:
        corr = statistics.correlation([p[0] for p in points], [p[1] for p in points])
    except statistics.StatisticsError:  # every run trained the same share, or lost the same points
        corr = float("nan")
    kept = [p for p in points if p[1] >= -GOAL_DROP]
    fast = [p for p in points if p[2] >= GOAL_SPEEDUP]
    text = (
        f"- What bounds the accuracy, measured over the {len(points)} AutoFreeze runs: the share of block-steps "
        f"(block x optimizer step) in which a block still trained. Each run's points against the same seed's baseline "
        f"follow it (correlation {corr:.2f})."
    )
    if kept:
        text += f" Runs within {GOAL_DROP:g} points of their baseline trained at least {min(p[0] for p in kept):.2f} of the block-steps"
        text += f" and were at most {max(p[2] for p in kept):.2f}x faster."
    if fast:
        text += (
            f" Runs at {GOAL_SPEEDUP:g}x or more trained at most {max(p[0] for p in fast):.2f} of the block-steps and lost "
            f"{-max(p[1] for p in fast):.2f} to {-min(p[1] for p in fast):.2f} points."
        )
    return text


def bound_of(row: dict[str, Any], base: dict[str, Any]) -> str:
    """What bounds a variant's speed-up: time before its first freeze, and the floor if every later step
    cost as little as its cheapest measured step (from :class:`StepClock`)."""
    if not row["ours"] or not row["frozen_s"]:
        return f"- It trains {row['trainable_m']:.2f} M parameters; its per-step cost is fixed for the whole run ({row['speedup']:.2f}x)."
    total_s = sum(row["frozen_s"].values())
    total_steps = sum(row["frozen_steps"].values())
    unfrozen_s, unfrozen_steps = row["frozen_s"].get(0, 0.0), row["frozen_steps"].get(0, 0)
    per_step = {f: row["frozen_s"][f] / row["frozen_steps"][f] for f in row["frozen_s"] if row["frozen_steps"][f] >= 3}
    cheapest_f = min(per_step, key=per_step.get) if per_step else None  # type: ignore[arg-type]
    text = (
        f"- What bounds its speed: {unfrozen_s:.0f} s of its {total_s:.0f} s of training "
        f"({100 * unfrozen_s / max(total_s, 1e-9):.0f}%) are the {unfrozen_steps:.0f} steps before its first freeze, "
        f"with the whole model training (the baseline takes {base['train'][0]:.0f} s in all)."
    )
    if cheapest_f is not None and unfrozen_steps < total_steps:
        floor = unfrozen_s + (total_steps - unfrozen_steps) * per_step[cheapest_f]
        text += (
            f" Its cheapest steps cost {1000 * per_step[cheapest_f]:.0f} ms ({cheapest_f} blocks frozen"
            f"{', served from the cache' if row['kind'] == 'cache' else ''}); even if every step after the first freeze cost that, "
            f"the total would be {floor:.0f} s, at most {base['train'][0] / floor:.2f}x. "
        )
        ups = ", ".join(f"{f} frozen {1000 * ms:.0f} ms" for f, ms in sorted(per_step.items()))
        text += f"Mean step (with its share of freezes, cache advances and misses) at {ups}."
    acc = f" Its accuracy: {row['delta']:+.2f} points against the baseline (per epoch: " + " / ".join(
        f"{a - b:+.2f}" for a, b in zip(row["per_epoch_acc"], base["per_epoch_acc"])
    ) + ")."
    return text + acc

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
    path: Path, plots: tuple[Path, Path], args: argparse.Namespace, body: dict[str, str], variants: list[Variant], target: float | None
) -> None:
    """Write the markdown report (``docs/benchmarks.md`` by default).

    It describes only the variants that were run, and says which seeds each ran on. Without the
    full fine-tuning baseline there is no accuracy target: the time-to-accuracy explanation, the goal
    and the issue's anchor (all relative to the baseline) are left out, and speed-ups are cache on
    against cache off.
    """
    plot, speed_plot = plots
    spec = MODELS[getattr(args, "model", "minilm-l6")]
    kinds = {v.kind for v in variants}
    has_baseline = target is not None
    others = "\n".join(f"- [{p}]({os.path.relpath(ROOT / p, path.resolve().parent)}): {what}" for p, what in OTHER_TABLES
                       if (ROOT / p).resolve() != path.resolve())
    smoke = (
        "\n> **Smoke run.** These numbers come from `--smoke` (a tiny subset, few epochs, one or two seeds)"
        " on a machine busy with other jobs. They show that the benchmark runs, not how fast anything is"
        " nor how accurate a setting is. Run the command without `--smoke` on a quiet machine for the benchmark.\n"
        if args.smoke else ""
    )
    note = f"\n> **How this run went.** {args.note}\n" if getattr(args, "note", "") else ""
    epoch_level = any(v.autofreeze and not v.sub_epoch for v in variants)
    sub = [v for v in variants if v.autofreeze and v.sub_epoch and not v.anneal]
    smooth = [v for v in variants if v.anneal]
    every = check_steps(args)
    described = {
        "full": "**full fine-tuning**: a plain Lightning `Trainer` with the single-device strategy. This is the baseline.",
        "freeze": f"**freeze**: `AutoFreeze(alpha, rule=\"{args.rule}\")`, freeze points at epoch starts, with "
        "`PipeTransformerStrategy(pipe_len=1, cache=False)` (the same strategy as freeze+cache, so the cache is the only "
        "difference: DDP-family strategies re-seed torch at fit start, the single-device one does not, which changes the "
        "dropout stream).",
        "cache": "**freeze+cache**: the same `AutoFreeze` with `PipeTransformerStrategy(pipe_len=1, cache=True)`. " + body["cache_note"],
        "sub": (
            f"**freeze+cache RULE ..., every X epoch** (issue 17): `AutoFreeze(rule=RULE, alpha={args.sub_alphas}, "
            f"freeze_interval=X, percentile={args.percentile:g}, min_active={args.sub_min_active})`, with `PipeTransformerStrategy(pipe_len=1, "
            f"cache=True)`: freeze points inside epochs, every X of an epoch's optimizer steps (an int: every X steps); "
            "the strategy advances the cache boundary there and keeps the optimizer state. Rules: `paper` (the geometric step "
            "`F + alpha (L - F)` as an upper bound, stopped at the active block with the smallest mean gradient norm over the "
            "interval; at least one block per point), `autofreeze` (Liu et al. 2021: the blocks before the first one whose "
            "interval-summed gradient L1 norm changed by at least the percentile of the active blocks' changes; it needs two "
            "intervals before its first freeze; `alpha` is not used), `schedule` (the geometric count of the point). "
            f"Rows: {'; '.join(v.name for v in sub)}." if sub else ""
        ),
        "llrd": f"**full fine-tuning, LLRD {args.llrd:g}**: the baseline with layer-wise learning-rate decay "
        f"(`SentimentClassifier(llrd={args.llrd:g})`, `examples/text_classification.py`): the classifier, the pooler and the top "
        f"block at lr, each block below at {args.llrd:g} times the one above, the embeddings at lr x {args.llrd:g}^L (L = {spec.blocks} blocks); one "
        "AdamW parameter group per depth (and decay setting), the same warm-up and decay (LambdaLR scales each group's own lr). "
        "What LLRD alone does, beside the freeze rows that use it. Not the baseline." if args.llrd else "",
        "smooth": (
            f"**..., anneal {args.anneal}** (smooth freezing, issue 25; FreezeOut, Brock et al. 2017): the freeze+cache "
            f"rows `{args.smooth}` (rule@interval, like the sub-epoch rows) with `AutoFreeze(anneal=\"{args.anneal}\")`: the learning rate of the blocks that freeze "
            "next is annealed to zero over an interval (the optimizer's update of those blocks scaled by the curve), so "
            "the freeze changes nothing. `paper` and `autofreeze` decide at a point from the interval's gradients as "
            "without, anneal the chosen blocks over the next interval and freeze them at the point after (each freeze "
            "one interval later than without); `schedule` anneals in the interval before its points. "
            + (f"Each also with `, LLRD {args.llrd:g}`: the module's optimizer with layer-wise learning-rate decay (row "
               f"\"full fine-tuning, LLRD {args.llrd:g}\"). " if args.llrd else "")
            + f"Rows: {'; '.join(v.name for v in smooth)}." if smooth else ""
        ),
        "lora": f"**LoRA** (a peer, through `peft` {body.get('peft_version', '')}): `LoraConfig(r={args.lora_r}, lora_alpha={args.lora_alpha}, "
        f"lora_dropout={args.lora_dropout}, target_modules={list(spec.lora_targets)}, modules_to_save=[\"classifier\"])` on the "
        f"example's `{spec.head_class}` (after its head is initialised), the single-device strategy, the same "
        f"optimizer, warm-up and decay at peak lr {args.lora_lr if args.lora_lr is not None else args.lr}.",
        "bft": f"**BaseFinetuning** (a peer, Lightning's own callback): a `BaseFinetuning` subclass whose "
        f"`freeze_before_training` freezes the embeddings and the lower {args.bft_blocks} encoder blocks and whose "
        "`finetune_function` unfreezes nothing: the lower half stays frozen for the whole run, the way a user would "
        "cut fine-tuning time with Lightning alone. `BaseFinetuning.freeze` leaves the modules in train mode (dropout "
        "on in the frozen blocks, unlike AutoFreeze), and the example's `configure_optimizers` keeps only trainable "
        "parameters, so LambdaLR schedules them as in the baseline. (`BackboneFinetuning` needs a `backbone` attribute, "
        "adds the unfrozen backbone as a new parameter group that the example's LambdaLR does not schedule, and trains "
        "the whole model after its unfreeze epoch, so it does not cut training time: not used.)",
        "bftc": (
            "**BaseFinetuning (embeddings + N lower blocks) + cache** (issue 41, ours): the same `BaseFinetuning` callback, "
            "unchanged, under `PipeTransformerStrategy(pipe_len=1, cache=True, cache_frozen_eval=True)`: the cache serves the "
            "prefix it froze (AutoCache checks by observation that the prefix is frozen and stays so); `cache_frozen_eval` "
            "keeps that prefix in eval mode (no dropout there), since `BaseFinetuning.freeze` leaves it in train mode and a "
            "stored output must be the one the block computes. Rows: N = "
            + ", ".join(str(v.blocks) for v in variants if v.kind == "bftc") + " (hand-chosen counts)."
        ),
        "early": (
            f"**AutoFreeze {args.early_rule} ... + cache** (issue 41, ours: the early rule, no block count): "
            f"`AutoFreeze(rule=PlasticityRule(ratio={args.early_ratio}), freeze_interval={args.early_interval}, pre=...)` with "
            "`PipeTransformerStrategy(pipe_len=1, cache=True)`: from the first point after the warm-up, the leading blocks whose "
            "weights moved less than the ratio of the most-moved active block's (relative to their size, since the start) freeze "
            "once two points in a row agree; blocks keep freezing as the run goes on (docs/autofreeze.md)."
        ),
        "lorac": (
            "**LoRA ... on the upper blocks, embeddings + N lower blocks frozen + cache** (issue 41, ours: the two peers "
            "combined): the LoRA peer's `LoraConfig` with `layers_to_transform` = the blocks from "
            f"N = {getattr(args, 'lorac_blocks', 6)} up (a hand-chosen count), so the embeddings and the lower N blocks keep "
            "no trainable parameter (peft froze them), under `PipeTransformerStrategy(pipe_len=1, cache=True, "
            "cache_frozen_eval=True)`: the cache serves that prefix."
        ),
        "es": f"**full fine-tuning, EarlyStopping** (a peer, Lightning's own callback): the baseline with "
        f"`EarlyStopping(monitor=\"val/acc\", mode=\"max\", patience={getattr(args, 'es_patience', 2)})` on the validation checks: "
        "it stops once that many checks in a row have not improved on the best; the learning-rate schedule is the "
        "baseline's, planned for the whole epoch budget. The peer a user who wants speed would pick. Its final accuracy "
        "is the model's when it stopped (no checkpoint is restored).",
    }
    present = {"full": "full" in kinds, "es": "es" in kinds, "llrd": "llrd" in kinds, "freeze": "freeze" in kinds, "cache": epoch_level and "cache" in kinds,
               "sub": bool(sub), "smooth": bool(smooth), "lora": "lora" in kinds, "bft": "bft" in kinds,
               "bftc": "bftc" in kinds, "early": "early" in kinds, "lorac": "lorac" in kinds}  # fmt: skip
    listed = "\n".join(f"{i}. {described[k]}" for i, k in enumerate((k for k, there in present.items() if there), 1))
    if has_baseline:
        speedup_note = (
            "- \"speed-up\" is the baseline's mean train time divided by the variant's; \"wall speed-up\" the same\n"
            "  for the whole `fit` (its validation and set-up included; not the final evaluation after it).\n"
            + (
                f"- \"time to X%\" is the training time until the first validation check at or above the target (nothing\n"
                f"  interpolated). Checks run every {every} optimizer steps ({args.val_every:g} of an epoch, counted across\n"
                f"  epochs) on a fixed subset of {body.get('n_check', '?')} validation snippets (seed {args.val_subset_seed}), the same for every\n"
                f"  run, and once more at the end of training; the target is the baseline's mean accuracy "
                + ("over its checks in the second half of training (its plateau)" if getattr(args, "tta_target", "last") == "plateau"
                   else "at that last\n  check")
                + f", on the same subset, minus {GOAL_DROP:g} points. The final accuracy (and the goal) is on the whole\n"
                "  validation set, evaluated once after training. Validation is outside the training time (the\n"
                "  clocks stop while it runs). It is reported only if every seed reaches the target; otherwise the\n"
                "  cell says how many did.\n"
                if every is not None else
                f"- \"time to X%\" is the training time until validation accuracy first reaches the baseline's mean\n"
                f"  final accuracy minus {GOAL_DROP:g} points. Accuracy is checked once per epoch, so this time is always an\n"
                "  epoch boundary. It is reported only if every seed reaches the target; otherwise the cell says\n"
                "  how many did.\n"
            )
            + f"- \"goal\": `met` for at least {GOAL_SPEEDUP:g}x training speed-up at a mean final accuracy no more than\n"
            f"  {GOAL_DROP:g} points below the baseline's; otherwise what is missing (`speed`, `accuracy` or `both`)."
        )
    else:
        speedup_note = (
            "- No full fine-tuning baseline ran, so there is no accuracy target: the time-to-accuracy columns\n"
            "  are empty, and nothing here compares against full fine-tuning.\n"
            "- \"speed-up\" of freeze+cache is the mean train time of freeze at the same alpha (the cache off)\n"
            "  divided by its own (the cache on); \"-\" where that variant did not run."
        )
    goal = ""
    if has_baseline:
        goal = f"""
### The goal ({"issue 25" if spec.asset == "minilm-l6" else "issue 25's, on this setting"})

{body['goal']}

![speed-up vs accuracy]({os.path.relpath(speed_plot.resolve(), path.resolve().parent)})
"""
    anchor = ""
    if has_baseline and spec.asset == "minilm-l6":
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

The goal set in issue 8 for variant 3 against variant 1, and again in issue 17, was at least 3.0x less
total training time at a mean final accuracy no more than 0.3 points below the baseline's; issue 25
asks {GOAL_SPEEDUP:g}x within the same 0.3 points.
"""
    variants_intro = (
        "Variants, run in one invocation with the seed loop outside and the variants inside, so that every\n"
        "variant sees the same machine noise:"
        if len(variants) > 1 else "One variant ran:"
    )
    seeds_note = (
        "mean ± sd over seeds" if len(args.seed_list) > 1 else "one seed: single runs, no spread measured"
    )
    checks_caveat = (
        f"Validation checks run every {every} optimizer steps on a fixed subset of the validation set: the time to\n"
        "  accuracy is that of a check, and the subset's accuracy differs from the whole set's by its own sampling\n"
        "  error (the target is on the subset, so the comparison between rows is on the same snippets)."
        if every is not None else "Validation runs once per epoch, so their time to accuracy is an epoch boundary too."
    )
    epoch_acc_note = (
        "\"val acc at the epoch's last check\" is on the check subset, at the epoch's last check (the final accuracy on the "
        "whole set is in the results table)." if every is not None else "\"val acc\" is on the whole validation set at the epoch's end."
    )
    n_val = args.val_size or 5134  # the whole held-out side of the movie split
    n_val_text = f"~{n_val:,}" if args.val_size is None else f"{n_val:,}"
    split_error = 100 * (0.8 * 0.2 / n_val) ** 0.5  # the sd of a proportion near 80%: 0.6 at 5,134 (the MiniLM pages)
    heading = (
        ("Time to accuracy: MiniLM-L6 on Rotten Tomatoes (issues 8, 17 and 25)" if spec.asset == "minilm-l6"
         else f"Time to accuracy: {spec.title} on Rotten Tomatoes (issue {getattr(args, 'issue', None) or 34})") if has_baseline
        else f"AutoCache off vs on: {spec.title} on Rotten Tomatoes (issue 6)"
    )
    text = f"""# Benchmarks

## {heading}

Generated by `benchmarks/time_to_accuracy/` on {datetime.date.today().isoformat()}.
{smoke}{note}
Command:

```bash
{body['command']}
```

Machine:

{machine_text()}

Setting: {body['setting']}

Ran: {body['ran']}.{body.get('commits', '')}

{variants_intro}

{listed}

Every variant of a seed gets the same data, the same batches in the same order and the same
classifier-head initialisation. The LightningModule (`examples/text_classification.py`) uses fused
AdamW with lr {args.lr}, 10% linear warm-up and then linear decay over the whole run.

### Results ({seeds_note})

{body['table']}

- "train time" is the sum of the epochs' training parts. Validation is excluded; "wall time" includes it.
{speedup_note}
{goal}
![accuracy vs training time]({os.path.relpath(plot.resolve(), path.resolve().parent)})

### How each variant trains

{body['training']}

- "trainable params" counts the parameters with `requires_grad` at the end of the first seed's run
  (AutoFreeze: what is left active; the peers: what they train throughout).
- "freezes": AutoFreeze's freeze events of the first seed, as global optimizer step : frozen blocks
  ({body['steps']} optimizer steps per epoch).
- "train s (steps) at k frozen": training seconds and optimizer steps spent with k of {spec.blocks} blocks frozen,
  mean over seeds. A step's time runs from the previous step's end, so a freeze and a cache advance
  count with the step they precede. Only for AutoFreeze variants.
- "cache MB, peak" is the most the cache held at an epoch end, in host memory / on disk (the
  strategy's `cache_stats()`: the current frozen boundary's store), each run's largest, mean over
  seeds; "-" for a variant without a cache.

### Per epoch

{body['epochs']}

"cache MB at epoch end" is "-" while nothing is cached (no block frozen yet, or no cache). {epoch_acc_note}

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
- Epoch-level rows freeze at epoch starts (`freeze_every_n_epochs=1`): their first epoch trains the
  whole model, which bounds their speed-up over a short epoch budget. Sub-epoch rows freeze inside
  epochs. {checks_caveat}
- Determinism: each seed fixes the data order, the classifier-head initialisation and dropout. A
  frozen block runs in eval mode (no dropout), so frozen variants draw fewer random numbers, and
  their dropout masks differ from an unfrozen run's after the first freeze. The peers run under the
  single-device strategy like the baseline; LoRA draws its adapters' initialisation after the head's.
- Length buckets (`--padding bucket`, the default, the same for every variant): a batch holds
  samples of one padded length, so each bucket ends with a partial batch (a few % more, smaller
  steps per epoch than plain batching), and a batch's label mix follows its length bucket's.
  `--padding trim` reproduces the example's loader, at about twice the tokens per batch.
- The validation set is one fixed split by movie, so the spread over seeds does not include the
  split's own sampling error. At {n_val_text} snippets that error is about {split_error:.1f} points.

## Other benchmark tables

{others}
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)

def check_steps(args: argparse.Namespace) -> int | None:
    """Optimizer steps between validation checks (None: the whole set at every epoch end, the older schedule)."""
    from .runner import check_interval

    if not hasattr(args, "val_every"):
        return None
    return check_interval(args, args.steps_per_epoch)


def bound_text(rows: list[dict[str, Any]], epochs: int) -> str:
    """What the measured epochs allow an epoch-level row: the best total if every frozen epoch were the cheapest one."""
    base = next((r for r in rows if r["variant"] == "full fine-tuning" and r.get("runs")), None)
    cached = [r for r in rows if r["kind"] == "cache" and "every" not in r["variant"] and r.get("runs")]
    if base is None or not cached:
        return ""
    best = min(cached, key=lambda r: r["train"][0])
    first, cheapest = best["per_epoch"][0], min(best["per_epoch"])
    floor = first + (epochs - 1) * cheapest
    return (
        f"\n- The bound on freezing at epoch starts: epoch 0 trains the whole "
        f"model ({first:.0f} s for {best['variant']}). Even if every later epoch cost as little as the cheapest "
        f"measured cached epoch ({cheapest:.0f} s, {best['frozen'][-1]} blocks frozen), the total would be "
        f"{floor:.0f} s, a speed-up of at most {base['train'][0] / floor:.2f}x over the baseline's "
        f"{base['train'][0]:.0f} s. Freeze points inside the first epoch (the sub-epoch rows) lift that bound."
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


def commits_text(records: list[RunRecord]) -> str:
    """The commits the runs' code came from (records before the field have none): one commit, or which runs came from which."""
    commits = sorted({r.code_commit for r in records if r.code_commit})
    if not commits:
        return ""
    if len(commits) == 1:
        return f" Code: commit `{commits[0]}` for every run that records it."
    counts = {c: sum(r.code_commit == c for r in records) for c in commits}
    return " Code: " + ", ".join(f"`{c}` ({n} runs)" for c, n in counts.items()) + "."


def exactness_text(records: list[RunRecord], variants: list[Variant]) -> str:
    """Cache off vs on, seed by seed: AutoCache is exact, so every epoch's validation accuracy must match."""
    lines = []
    for on in (v for v in variants if v.kind == "cache" and not v.sub_epoch):
        off = next((v for v in variants if v.kind == "freeze" and not v.sub_epoch and v.alpha == on.alpha), None)
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
    parts, spilled = [], False
    for r in rows:
        mem, disk = r.get("cache_peak_mb", (None, None))
        if mem is None and disk is None:
            continue
        spilled |= bool(disk)
        parts.append(f"{r['variant']} {mem or 0.0:.1f} MB in host memory and {disk or 0.0:.1f} MB on disk")
    if not parts:
        return ""
    return (
        "\n- Cache footprint at an epoch end (mean over seeds of each run's largest): " + "; ".join(parts) + ". It is "
        "the current frozen boundary's store only, validation snippets included when validation runs through the "
        "cached prefix (see the lookups in the per-epoch cache hits): the previous boundary's entries are dropped "
        "when the boundary moves, and while it advances both stores exist for a moment, so the footprint within an "
        "epoch can be higher than at its end."
        + ("" if spilled else " Nothing spilled to disk: the entries fit the strategy's host-memory budget.")
    )
