"""What the benchmark runs: its variants (the rows of the report) and one run's record."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from .models import MODELS

__all__ = [
    "KINDS", "Kind", "RunRecord", "Variant", "early_stopping_variants", "issue41_variants", "llrd_variants", "peer_variants",
    "smooth_variants", "sub_epoch_variants",
]  # fmt: skip

Kind = Literal["full", "freeze", "cache", "lora", "bft", "llrd", "es", "bftc", "early", "lorac"]
#: What --variants takes: the kinds, ``sub`` for the sub-epoch freeze+cache rows, ``smooth`` for those rows
#: with smooth freezing (``--anneal``, with and without ``--llrd``) and ``llrd`` for full fine-tuning with
#: layer-wise learning-rate decay, ``es`` for full fine-tuning stopped by Lightning's ``EarlyStopping``; issue 41's rows:
#: ``bftc`` (the BaseFinetuning callback under the cache), ``early`` (AutoFreeze's early rule + cache), ``lorac`` (LoRA
#: on the upper blocks, the lower ones frozen and served by the cache).
KINDS = ("full", "freeze", "cache", "sub", "smooth", "llrd", "lora", "bft", "es", "bftc", "early", "lorac")


@dataclass(frozen=True)
class Variant:
    """One line of the benchmark: what runs, under which name.

    ``kind``: ``full`` (the baseline), ``freeze`` / ``cache`` (AutoFreeze without / with AutoCache;
    with ``interval`` set, freeze points inside epochs; with ``anneal`` set, smooth freezing), ``llrd``
    (full fine-tuning with layer-wise learning-rate decay), ``es`` (full fine-tuning with Lightning's
    ``EarlyStopping`` on the validation checks), ``lora`` (peft LoRA) or ``bft`` (Lightning's
    ``BaseFinetuning`` freezing the embeddings and the lower blocks for the whole run). ``llrd`` (a
    decay factor) on a freeze row builds the module's optimizer with layer-wise decay. The names of
    the rows without ``anneal`` and ``llrd`` are those of the earlier records (``--resume``).

    Issue 41's rows: ``bftc`` (the same ``BaseFinetuning`` callback, ``blocks`` lower blocks, under
    ``PipeTransformerStrategy(cache=True, cache_frozen_eval=True)``), ``early`` (``AutoFreeze`` with the
    ``rule`` named, ``PlasticityRule(ratio=alpha)`` for ``"plasticity"``, every ``interval`` of an epoch,
    + cache) and ``lorac`` (LoRA on the blocks above ``blocks``, the embeddings and ``blocks`` lower blocks
    frozen by peft and served by the cache, ``cache_frozen_eval=True``).
    """

    kind: Kind
    alpha: float | None = None
    alpha_text: str = ""
    rule: str | None = None  # None: --rule (the epoch-level rows)
    interval: float | int | None = None  # AutoFreeze(freeze_interval=...); None: freeze points at epoch starts
    interval_text: str = ""
    detail: str = ""  # the peers' settings, in their names
    min_active: int = 1  # AutoFreeze(min_active=...) of the sub-epoch rows
    anneal: str | None = None  # AutoFreeze(anneal=...): smooth freezing
    llrd: float | None = None  # SentimentClassifier(llrd=...): layer-wise learning-rate decay
    blocks: int | None = None  # bftc, lorac: the lower blocks frozen for the whole run (a hand-chosen count)

    @property
    def name(self) -> str:
        return self._base_name + (f", anneal {self.anneal}" if self.anneal else "") + (f", LLRD {self.llrd:g}" if self.llrd else "")

    @property
    def baseline(self) -> bool:
        """Full fine-tuning as it is: what speed-ups and targets are measured against."""
        return self.kind == "full"

    @property
    def _base_name(self) -> str:
        if self.kind in ("full", "llrd"):
            return "full fine-tuning"
        if self.kind == "es":
            return f"full fine-tuning, EarlyStopping {self.detail}"
        if self.kind == "lora":
            return f"LoRA {self.detail}"
        if self.kind == "bft":
            return f"BaseFinetuning {self.detail}"
        if self.kind == "bftc":
            return f"BaseFinetuning (embeddings + {self.blocks} lower blocks) + cache"
        if self.kind == "lorac":
            return f"LoRA {self.detail} on the upper blocks, embeddings + {self.blocks} lower blocks frozen + cache"
        if self.kind == "early":
            return f"AutoFreeze {self.rule} {self.alpha_text}, every {self.interval_text} epoch + cache"
        base = "freeze" if self.kind == "freeze" else "freeze+cache"
        if self.interval is None:
            return f"{base} a={self.alpha_text}"  # the epoch-level rows keep their issue-8 names
        what = f"p{self.detail}" if self.rule == "autofreeze" else f"a={self.alpha_text}"
        every = f"{self.interval_text} epoch" if isinstance(self.interval, float) else f"{self.interval_text} steps"
        floor = f", min_active={self.min_active}" if self.min_active != 1 else ""
        return f"{base} {self.rule} {what}, every {every}{floor}"

    @property
    def sub_epoch(self) -> bool:
        return self.interval is not None

    @property
    def autofreeze(self) -> bool:
        """Whether the variant runs AutoFreeze with the ``alpha``/``rule`` rows' settings (issues 8-34)."""
        return self.kind in ("freeze", "cache")

    @property
    def ours(self) -> bool:
        """A row of this package (AutoFreeze, or AutoCache under another freeze), as opposed to the baseline and the peers."""
        return self.autofreeze or self.kind in ("bftc", "early", "lorac")

    @property
    def cached(self) -> bool:
        """Whether the row trains under ``PipeTransformerStrategy(cache=True)``."""
        return self.kind in ("cache", "bftc", "early", "lorac")

    @property
    def hand_chosen(self) -> str | None:
        """The number a person chose for how much the row freezes, as text; None for the automatic rule and the rows
        that freeze nothing (the baseline, LoRA, EarlyStopping)."""
        if self.kind in ("bft", "bftc", "lorac"):
            n = self.blocks if self.blocks is not None else self.detail.split("+ ")[-1].split(" ")[0]
            return f"{n} lower blocks"
        if self.autofreeze and self.rule != "autofreeze":
            return f"alpha {self.alpha_text}" + (f", every {self.interval_text}" if self.sub_epoch else "")
        if self.autofreeze:
            return f"percentile {self.detail}, every {self.interval_text}"
        return None


@dataclass
class RunRecord:
    """One (variant, seed) run: per-epoch rows from the PipeTransformerTimeline, plus the fit's wall time."""

    variant: str
    seed: int
    epochs: list[dict[str, Any]] = field(default_factory=list)
    fit_s: float = 0.0
    error: str | None = None
    #: AutoFreeze's freeze events, ``[global step, frozen blocks]`` ([] for the baseline and the peers).
    freezes: list[list[int]] = field(default_factory=list)
    #: Training seconds and optimizer steps spent with F blocks frozen, keyed by ``str(F)`` (from :class:`StepClock`;
    #: each batch's time runs from the previous batch's end, so a freeze or cache advance at its start counts too).
    frozen_s: dict[str, float] = field(default_factory=dict)
    frozen_steps: dict[str, int] = field(default_factory=dict)
    trainable_params: int = 0  # at the end of the run
    #: Validation check points on the fixed subset (``--val-every``, ``--val-subset``): ``{"step", "train_s", "acc"}``,
    #: ``train_s`` the training seconds up to the check (validation excluded); the last one is the end of training.
    #: Empty in records from before issue 25 (validation on the whole set at epoch ends only).
    checks: list[dict[str, Any]] = field(default_factory=list)
    #: Accuracy on the whole validation set at the end of training (``None`` in the older records: their last
    #: epoch's validation was on the whole set), and the seconds that final evaluation took (outside ``fit_s``).
    final_full_acc: float | None = None
    final_eval_s: float = 0.0
    #: The commit of the code that ran (``git rev-parse --short HEAD``, ``+changes`` when the package or the benchmark
    #: had uncommitted changes); empty in older records. The report lists the commits its runs came from.
    code_commit: str = ""

    @property
    def train_s(self) -> float:
        return sum(e["train_s"] for e in self.epochs)

    @property
    def val_s(self) -> float:
        """Validation seconds inside ``fit`` (the checks); the final evaluation after it is ``final_eval_s``."""
        return sum(e["epoch_s"] - e["train_s"] for e in self.epochs)

    @property
    def final_acc(self) -> float | None:
        """The final accuracy on the whole validation set."""
        if self.final_full_acc is not None:
            return self.final_full_acc
        return self.epochs[-1]["metric"] if self.epochs else None

    @property
    def points(self) -> list[tuple[float, float]]:
        """(training seconds, accuracy) of every validation check: the time-to-accuracy curve. The older
        records' checks are their epoch ends (on the whole validation set)."""
        if self.checks:
            return [(c["train_s"], c["acc"]) for c in self.checks if c["acc"] is not None]
        out, elapsed = [], 0.0
        for e in self.epochs:
            elapsed += e["train_s"]
            if e["metric"] is not None:
                out.append((elapsed, e["metric"]))
        return out

    @property
    def final_check_acc(self) -> float | None:
        """The accuracy at the last check (the end of training), on what the checks measure: the subset."""
        points = self.points
        return points[-1][1] if points else None

    def cache_peak(self, field_name: Literal["cache_mem_bytes", "cache_disk_bytes"]) -> int | None:
        """The largest cache footprint at an epoch end (``None``: no epoch reported one, e.g. no cache).

        Epoch ends only: while the boundary advances, the previous boundary's store briefly coexists
        with the new one, so the footprint within an epoch can be higher than this.
        """
        values = [e[field_name] for e in self.epochs if e.get(field_name) is not None]  # .get: older JSON rows lack it
        return max(values) if values else None

    def time_to(self, target: float) -> float | None:
        """Training seconds (validation excluded) until the first check at or above ``target``; nothing is
        interpolated between checks."""
        return next((t for t, acc in self.points if acc >= target), None)


def sub_epoch_variants(args: argparse.Namespace) -> list[Variant]:
    """freeze+cache rows with freeze points inside epochs: every interval x rule (x alpha for paper/schedule)."""
    out = []
    for interval, itext in args.interval_list:
        for rule in args.sub_rule_list:
            if rule == "autofreeze":  # alpha is unused by the rule; keep a valid one for AutoFreeze's check
                a, t = args.sub_alpha_list[0]
                out.append(Variant("cache", a, t, rule=rule, interval=interval, interval_text=itext, detail=f"{args.percentile:g}"))
            else:
                out += [Variant("cache", a, t, rule=rule, interval=interval, interval_text=itext) for a, t in args.sub_alpha_list]
    return [dataclasses.replace(v, min_active=args.sub_min_active) for v in out]


def smooth_variants(args: argparse.Namespace) -> list[Variant]:
    """Smooth freezing (``AutoFreeze(anneal=...)``) on the rule@interval rows of ``--smooth``, freeze+cache,
    each without and (with ``--llrd``) with layer-wise learning-rate decay."""
    out = []
    for rule, interval, itext in args.smooth_list:
        for llrd in (None, args.llrd) if args.llrd else (None,):
            a, t = args.sub_alpha_list[0]
            detail = f"{args.percentile:g}" if rule == "autofreeze" else ""
            out.append(Variant("cache", a, t, rule=rule, interval=interval, interval_text=itext, detail=detail,
                               min_active=args.sub_min_active, anneal=args.anneal, llrd=llrd))  # fmt: skip
    return out


def llrd_variants(args: argparse.Namespace) -> list[Variant]:
    """Full fine-tuning with layer-wise learning-rate decay: what LLRD alone does, beside the freeze rows that use it."""
    return [Variant("llrd", llrd=args.llrd)] if args.llrd else []


def peer_variants(args: argparse.Namespace) -> list[Variant]:
    """The peers: LoRA through peft, and Lightning's BaseFinetuning."""
    out = []
    if "lora" in args.kinds:
        lr = "" if args.lora_lr is None or args.lora_lr == args.lr else f" lr={args.lora_lr:g}"
        targets = ", ".join(MODELS[getattr(args, "model", "minilm-l6")].lora_targets)  # (query, value) on BERT, (q, v) on MPNet
        out.append(Variant("lora", detail=f"r={args.lora_r} ({targets}){lr}"))
    if "bft" in args.kinds:
        out.append(Variant("bft", detail=f"(embeddings + {args.bft_blocks} lower blocks)", blocks=args.bft_blocks))
    return out


def early_stopping_variants(args: argparse.Namespace) -> list[Variant]:
    """Full fine-tuning stopped by Lightning's ``EarlyStopping`` on the validation checks: the speed peer."""
    return [Variant("es", detail=f"patience {args.es_patience}")] if "es" in args.kinds else []


def issue41_variants(args: argparse.Namespace) -> list[Variant]:
    """Issue 41's rows of ours: BaseFinetuning under the cache (``--bftc-blocks``, one row per count), AutoFreeze's
    early rule + cache (``--early-rule``, ``--early-ratio``, ``--early-interval``), and LoRA on the upper blocks with
    the lower ones frozen and cached (``--lorac-blocks``)."""
    out = []
    if "bftc" in args.kinds:
        out += [Variant("bftc", blocks=n) for n in args.bftc_block_list]
    if "early" in args.kinds:
        ratio, text = args.early_ratio_value
        interval, itext = args.early_interval_value, args.early_interval
        out.append(Variant("early", ratio, text, rule=args.early_rule, interval=interval, interval_text=itext))
    if "lorac" in args.kinds:
        lr = "" if args.lora_lr is None or args.lora_lr == args.lr else f" lr={args.lora_lr:g}"
        targets = ", ".join(MODELS[getattr(args, "model", "minilm-l6")].lora_targets)
        out.append(Variant("lorac", detail=f"r={args.lora_r} ({targets}){lr}", blocks=args.lorac_blocks))
    return out
