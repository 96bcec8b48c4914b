"""The duration estimate of ``--dry-run``: seconds per run from calibrated per-token costs."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from lightning_pipetransformer.freeze.rules import geometric_num_frozen

from .variants import Variant

#: The duration estimate's costs. Per token, calibrated on the 2026-12-01 run of this benchmark (docs/benchmarks.md
#: then: an idle 2-core CPU, 2 torch threads, 3,000 / 5,134 snippets, length buckets): full fine-tuning trained
#: 57 s per epoch of 90,792 tokens (~0.63 ms per token) and validated 27 s per pass over 161,664 tokens
#: (~0.17 ms per token); the 2026-11-30 run's 85 s and 43 s made the estimate ~1.5x too long. Relative step
#: cost with F of 6 blocks frozen, without the cache (the frozen prefix runs forward) and served from it (the
#: per-epoch times of freeze and freeze+cache a=1/3 on 2026-11-30):
TRAIN_S_PER_TOKEN = 57.2 / 90792
VAL_S_PER_TOKEN = 27.4 / 161664
STEP_RATIO = {0: 1.0, 2: 0.74, 4: 0.54, 5: 0.40, 6: 0.33}
STEP_RATIO_CACHED = {0: 1.0, 2: 0.62, 4: 0.29, 5: 0.14, 6: 0.06}
#: The peers' step cost relative to full fine-tuning, measured on 2026-12-01 (train time 254 and 211 s against
#: 286 s): LoRA still back-propagates through every block (activation gradients) but computes no weight
#: gradient of the frozen matrices; BaseFinetuning trains the upper 3 of 6 blocks (its lower half keeps dropout).
LORA_STEP_RATIO = 0.89
BFT_STEP_RATIO = 0.74
ADVANCE_S_PER_BLOCK_PER_SAMPLE = 2.0 / 3000  # cache boundary advance, per block moved and stored snippet
SETUP_S = 10.0  # model load + Trainer set-up per run


@dataclass(frozen=True)
class Calibration:
    """What one model costs on the machine its estimate is for. Without tables of its own (``step_ratio``,
    ``cached_ratio``: step cost relative to full fine-tuning by frozen blocks of this model), ``STEP_RATIO`` and
    ``STEP_RATIO_CACHED`` are read at the same SHARE of frozen blocks (F of 6 for MiniLM)."""

    train_s_per_token: float
    val_s_per_token: float
    setup_s: float
    machine: str
    step_ratio: dict[int, float] | None = None  # keyed by frozen blocks of this model; None: the MiniLM share tables
    cached_ratio: dict[int, float] | None = None
    bft_ratio: float = BFT_STEP_RATIO
    lora_ratio: float = LORA_STEP_RATIO


CALIBRATIONS = {
    "minilm-l6": Calibration(TRAIN_S_PER_TOKEN, VAL_S_PER_TOKEN, SETUP_S, "an idle 2-core CPU with 2 threads"),
    # MPNet-base, ONE torch thread pinned to one core (taskset -c 1), measured on 2026-12-03: a training step of
    # 32 x 32 tokens (fused AdamW, all 109.5 M parameters) took 7.3-8.0 s with the other core busy (load ~1.6),
    # 7.1 ms per token; a no-grad forward of the same batch 2.6 s (2.5 ms per token). MiniLM-L6 costs ~0.9 ms
    # per token on one thread: 8x less, as its blocks' sizes say (6 x 384-wide against 12 x 768-wide).
    # Under the heavy load of that session (load average 6-8 on 2 cores) the same step took 20-34 s.
    # Step costs with F frozen from issue 41's measurement on one core (batch 32 x 64 tokens): the frozen prefix run
    # forward (a filling epoch, or no cache) 0.67 / 0.56 / 0.44 at F = 6 / 8 / 10, served from the cache 0.53 / 0.34 /
    # 0.16 (11: extrapolated); BaseFinetuning-6 and LoRA from issue 34's records (651 and 733 s against 1043 s).
    "mpnet-base": Calibration(
        7.1e-3, 2.5e-3, 25.0, "one idle core (1 torch thread)",
        step_ratio={0: 1.0, 6: 0.67, 8: 0.56, 10: 0.44, 11: 0.38}, cached_ratio={0: 1.0, 6: 0.53, 8: 0.34, 10: 0.16, 11: 0.12},
        bft_ratio=0.62, lora_ratio=0.70,
    ),
}  # fmt: skip


def _interp(table: dict[int, float], f: float) -> float:
    keys = sorted(table)
    lo = max(k for k in keys if k <= f)
    hi = min(k for k in keys if k >= f)
    return table[lo] if lo == hi else table[lo] + (table[hi] - table[lo]) * (f - lo) / (hi - lo)


def planned_frozen(variant: Variant, epochs: int, steps: int, args: argparse.Namespace, blocks: int = 6) -> list[int]:
    """Frozen blocks at each optimizer step of a run, as the duration estimate assumes it.

    Epoch-level rows follow the geometric schedule (the paper rule freezes no more). Sub-epoch rows
    decide every ``interval``: ``schedule`` the geometric count of the point, ``paper`` one block more per
    point from the geometric first step (its slowest: each point freezes at least one block, the geometric
    step is its upper bound), ``autofreeze`` as it did on 2026-12-01 (its decisions follow the gradients: every
    0.25 and 0.5 epoch it first froze 1.5-2.5 epochs in, then about one block per half epoch; taken here as 2
    blocks at the first point from epoch 2 on, then one more per half epoch; on a deeper stack, the same share
    of the blocks: 4 of 12, then 2 more per half epoch; in a run shorter than 5 epochs, from 40% of the run).
    With ``anneal`` the gradient rules freeze one interval after their decision (the blocks anneal in between):
    their plan is shifted by one interval; ``schedule`` freezes at the same points as without.
    """
    total = epochs * steps
    if variant.kind in ("bft", "bftc", "lorac"):
        return [variant.blocks if variant.blocks is not None else args.bft_blocks] * total
    if variant.kind == "early":
        return early_plan(epochs, steps, blocks)
    if not variant.autofreeze:
        return [0] * total
    limit = blocks - variant.min_active
    alpha = variant.alpha or 1 / 3
    if not variant.sub_epoch:
        return [min(limit, geometric_num_frozen(blocks, alpha, s // steps)) for s in range(total)]
    every = variant.interval if isinstance(variant.interval, int) else max(1, round(float(variant.interval or 1) * steps))
    lag = 1 if variant.anneal and variant.rule in ("paper", "autofreeze") else 0
    out, frozen = [], 0
    for s in range(total):
        if s and s % every == 0 and s // every > lag:
            point = s // every - lag
            if variant.rule == "schedule":
                frozen = geometric_num_frozen(blocks, alpha, point)
            elif variant.rule == "paper":
                frozen = geometric_num_frozen(blocks, alpha, 1) if frozen == 0 else frozen + 1
            elif point * every >= (start := min(2 * steps, round(0.4 * total))):
                per = max(1, blocks // 6)
                frozen = max(frozen, 2 * per + per * ((point * every - start) // max(1, steps // 2)))
            frozen = min(frozen, limit)
        out.append(frozen)
    return out


def early_plan(epochs: int, steps: int, blocks: int) -> list[int]:
    """What the duration estimate assumes of AutoFreeze's early rule (``"plasticity"``, issue 41), from its pilots on
    MPNet-base (every 1/16 epoch, seed 0: 6 of 12 blocks at step 21 of 51, 7 at step 39, nothing after; every 1/8
    epoch, seeds 0 and 1: 6-7 by step 42): nothing frozen for the first 0.4 epoch (the warm-up and two readings),
    then half the stack for the rest of the run."""
    first = round(0.4 * steps)
    return [0 if s < first else blocks // 2 for s in range(epochs * steps)]


def estimate_seconds(
    variant: Variant, epochs: int, steps: int, tokens: float, val_tokens: float, n_train: int, n_val: int, args: argparse.Namespace,
    check_every: int | None = None, check_tokens: float | None = None,
) -> float:
    """Rough seconds of one run (training, validation, set-up) on an idle 2-core CPU.

    Step time is taken proportional to tokens per batch. With the cache, a step is served when its
    snippets were stored at an earlier epoch's step with blocks frozen (batches are reshuffled every
    epoch: the served share is the share of snippets stored before the epoch); moving the boundary
    advances the stored entries. Validation through a stored boundary runs the active blocks only.
    Validation: ``check_every`` None is the whole set (``val_tokens``) at every epoch end; otherwise a check of
    ``check_tokens`` every ``check_every`` optimizer steps across epochs, and after training the whole set once
    more at full cost (a plain forward, no cache; the subset's end-of-training point is read from it).
    """
    blocks = getattr(args, "blocks", 6)
    cal = CALIBRATIONS[getattr(args, "model", "minilm-l6")]
    frozen = planned_frozen(variant, epochs, steps, args, blocks)
    share = 6 / blocks  # the step-ratio tables are per 6 blocks (Calibration)
    full_step = cal.train_s_per_token * tokens
    full_val = cal.val_s_per_token * val_tokens
    check = cal.val_s_per_token * (check_tokens if check_tokens is not None else val_tokens)
    total, stored, prev, val_at = cal.setup_s, 0.0, 0, 0  # stored: share of training snippets in the cache
    cached = variant.cached
    own, own_cached = cal.step_ratio, cal.cached_ratio

    def ratio(f: int) -> float:  # a step with f frozen, the prefix run forward (no cache, or a miss)
        return _interp(own, f) if own else _interp(STEP_RATIO, f * share)

    def served(f: int) -> float:  # a step served from the cache
        return _interp(own_cached, f) if own_cached else _interp(STEP_RATIO_CACHED, f * share)

    val_stored = n_val if check_every is None or not val_tokens else n_val * check / full_val  # validation snippets in the cache
    step = 0
    for e in range(epochs):
        seen_frozen = 0
        for f in frozen[e * steps : (e + 1) * steps]:
            step += 1
            if check_every is not None and step % check_every == 0:  # a check after this step, on the subset
                total += check * (blocks_active(f, blocks) if cached and val_at else 1.0)
                val_at = f if cached and f > 0 else 0
            if variant.kind in ("lora", "bft"):
                total += full_step * (cal.lora_ratio if variant.kind == "lora" else cal.bft_ratio)
                continue
            if cached and f > prev:
                now = 1 - (1 - stored) * (1 - seen_frozen / steps)
                per_block = ADVANCE_S_PER_BLOCK_PER_SAMPLE * cal.train_s_per_token / TRAIN_S_PER_TOKEN
                total += (f - prev) * per_block * (now * n_train + (val_stored if val_at else 0))
            hit = stored if cached and f > 0 else 0.0
            total += full_step * (hit * served(f) + (1 - hit) * ratio(f))
            seen_frozen += f > 0
            prev = f
        stored = 1 - (1 - stored) * (1 - seen_frozen / steps) if cached else 0.0
        if check_every is None:
            f = frozen[(e + 1) * steps - 1]
            total += full_val * (blocks_active(f, blocks) if cached and val_at else 1.0)
            val_at = f if cached and f > 0 else 0
    if check_every is not None:
        total += full_val  # the end of training: one plain forward of the whole set gives the subset's point too
    return total


def blocks_active(frozen: int, blocks: int = 6) -> float:
    """Share of a validation forward left when ``frozen`` blocks (and the embeddings) are served from the cache."""
    return (blocks - frozen) / blocks
