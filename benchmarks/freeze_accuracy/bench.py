"""Where does progressive freezing lose accuracy? Ablations of AutoFreeze on the time-to-accuracy setting (issue 17).

The setting of ``benchmarks/time_to_accuracy/`` (MiniLM-L6, Rotten Tomatoes, the same data module,
batches and head initialisation per seed, fused AdamW with warm-up and linear decay), but every
variant runs under the plain single-device strategy (``"auto"``) without AutoCache: the cache is
exact (``docs/cache_benchmark.md``: identical accuracy, epoch by epoch), so what costs accuracy is
the freezing, and plain Lightning gives every variant the same dropout stream up to its first
freeze. Accuracy only: the times printed are of a shared machine and are not a benchmark.

Validation runs at the end of the epochs in ``--eval-epochs`` only (default: 1 and the last),
through the whole validation side, in eval mode and without gradients, by a callback rather than
Lightning's loop (cheaper on a 2-core machine; the same numbers)::

    python -m benchmarks.freeze_accuracy --list
    python -m benchmarks.freeze_accuracy --variants full,sched,sched-emb --seeds 0 --threads 1

Each finished run is appended as one JSON line to ``--out`` (default
``outputs/freeze_accuracy/runs.jsonl``); ``--summary`` prints the table of what is there.
The knobs that are not AutoFreeze options (dropout kept on in frozen blocks, dropout at the frozen
boundary, a learning-rate boost after the first freeze) are experiment-side callbacks here, to
measure what a change in the package would buy; they are not package features.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from benchmarks.time_to_accuracy.data import BenchData
from benchmarks.time_to_accuracy.runner import lora_config, quiet
from examples.assets import fetch
from examples.text_classification import SentimentClassifier
from lightning_pipetransformer import AutoFreeze

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------- callbacks


class EvalAt(pl.Callback):
    """Validation accuracy at the end of the chosen epochs (whole validation side, eval mode, no grad)."""

    def __init__(self, dm: BenchData, epochs: set[int]) -> None:
        self.dm, self.epochs = dm, epochs
        self.acc: dict[int, float] = {}
        self.train_s: dict[int, float] = {}
        self._t = 0.0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epoch = trainer.current_epoch
        self.train_s[epoch] = time.perf_counter() - self._t
        if epoch in self.epochs or epoch == trainer.max_epochs - 1:
            self.acc[epoch] = evaluate(pl_module, self.dm)


def evaluate(model: pl.LightningModule, dm: BenchData) -> float:
    modes = {m: m.training for m in model.modules()}
    model.eval()
    correct = total = 0
    try:
        with torch.inference_mode():
            for batch in dm.val_dataloader():
                logits = model(batch["input_ids"], batch["attention_mask"])
                correct += int((logits.argmax(-1) == batch["labels"]).sum())
                total += int(batch["labels"].numel())
    finally:
        for m, mode in modes.items():
            m.training = mode
    return correct / total


def _autofreeze(trainer: pl.Trainer) -> AutoFreeze | None:
    return next((c for c in trainer.callbacks if isinstance(c, AutoFreeze)), None)  # type: ignore[attr-defined]


class DropoutInFrozen(pl.Callback):
    """Put AutoFreeze's frozen blocks (and embeddings) back in train mode after it set them to eval:
    their dropout stays on, as under Lightning's BaseFinetuning. Not cacheable; an experiment only."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        af = _autofreeze(trainer)
        if af is None or af.stack is None or not af.num_frozen:
            return
        modules: list[nn.Module] = list(af.stack.blocks[: af.num_frozen])
        if af.freeze_embeddings:
            modules += [m for _, m in af.stack.pre]
        for m in modules:
            m.train()


class BoundaryDropout(pl.Callback):
    """Dropout (p) on the hidden states entering the first active block, while training and while any
    block is frozen: what a cache-compatible substitute for the frozen blocks' own dropout would do."""

    def __init__(self, p: float = 0.1) -> None:
        self.p = p
        self._handles: list[Any] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        af = _autofreeze(trainer)
        assert af is not None and af.stack is not None
        for index, block in enumerate(af.stack.blocks):
            self._handles.append(block.register_forward_pre_hook(self._hook(af, index), with_kwargs=True))

    def _hook(self, af: AutoFreeze, index: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if not module.training or af.num_frozen == 0 or index != af.num_frozen:
                return None
            if args:
                return (nn.functional.dropout(args[0], self.p, True), *args[1:]), kwargs
            kwargs = dict(kwargs)
            kwargs["hidden_states"] = nn.functional.dropout(kwargs["hidden_states"], self.p, True)
            return args, kwargs

        return hook

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class LrBoostAfterFreeze(pl.Callback):
    """Multiply the schedule's base learning rates by ``factor`` once, at the first freeze."""

    def __init__(self, factor: float) -> None:
        self.factor, self.done = factor, False

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        af = _autofreeze(trainer)
        if self.done or af is None or not af.num_frozen:
            return
        self.done = True
        for config in trainer.lr_scheduler_configs:
            sched = config.scheduler
            sched.base_lrs = [b * self.factor for b in sched.base_lrs]  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------- variants


@dataclass
class Spec:
    """One ablation: callbacks to add (built per run) and the peak learning rate."""

    help: str
    callbacks: Callable[[], list[pl.Callback]] = field(default=lambda: [])
    lr: float | None = None
    model: Callable[[str, float], pl.LightningModule] | None = None


def _sched(plan: dict[int, int], **kw: Any) -> Callable[[], list[pl.Callback]]:
    return lambda: [AutoFreeze(schedule=plan, **kw)]


def _rule(rule: str, interval: float | int, alpha: float = 1 / 3, extra: Callable[[], list[pl.Callback]] | None = None, **kw: Any) -> Callable[[], list[pl.Callback]]:
    return lambda: [AutoFreeze(rule=rule, alpha=alpha, freeze_interval=interval, **kw)] + (extra() if extra else [])  # type: ignore[arg-type]


SCHED = {1: 2, 2: 4, 3: 5}  # rule="schedule", alpha=1/3, L=6: 0 2 4 5 5 (the freeze+cache row)


def _basefinetuning(blocks: int) -> Callable[[], list[pl.Callback]]:
    from lightning.pytorch.callbacks import BaseFinetuning

    class FreezeLower(BaseFinetuning):
        def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
            bert = pl_module.model.bert  # type: ignore[union-attr]
            self.freeze([bert.embeddings, *bert.encoder.layer[:blocks]])

        def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: Any) -> None:
            pass

    return lambda: [FreezeLower()]


def _lora(r: int = 8) -> Callable[[str, float], pl.LightningModule]:
    def build(model_dir: str, lr: float) -> pl.LightningModule:
        from peft import get_peft_model

        model = SentimentClassifier(pretrained=model_dir, lr=lr)
        model.model = get_peft_model(model.model, lora_config(argparse.Namespace(lora_r=r, lora_alpha=2 * r, lora_dropout=0.1)))
        return model

    return build


SPECS: dict[str, Spec] = {
    "full": Spec("full fine-tuning (plain Lightning)"),
    "sched": Spec("AutoFreeze schedule 0 2 4 5 5 (rule=schedule, alpha=1/3), embeddings frozen with block 0", _sched(SCHED)),
    "sched-emb": Spec("as sched, freeze_embeddings=False (embeddings train all run)", _sched(SCHED, freeze_embeddings=False)),
    "sched-drop": Spec("as sched, frozen blocks and embeddings kept in train mode (dropout on)", lambda: [AutoFreeze(schedule=SCHED), DropoutInFrozen()]),
    "sched-bdrop": Spec("as sched, dropout p=0.1 on the hidden states entering the first active block", lambda: [AutoFreeze(schedule=SCHED), BoundaryDropout(0.1)]),
    "sched-max4": Spec("schedule 0 2 4 4 4 (min_active=2)", _sched({1: 2, 2: 4})),
    "sched-max3": Spec("schedule 0 2 3 3 3 (min_active=3)", _sched({1: 2, 2: 3})),
    "sched-late": Spec("schedule 0 0 2 4 5 (a freeze step later)", _sched({2: 2, 3: 4, 4: 5})),
    "sched-lr2": Spec("as sched, learning rate x2 from the first freeze on", lambda: [AutoFreeze(schedule=SCHED), LrBoostAfterFreeze(2.0)]),
    "static3": Spec("AutoFreeze schedule {0: 3}: embeddings + 3 blocks frozen all run (eval mode)", _sched({0: 3})),
    "bft3": Spec("BaseFinetuning: embeddings + 3 blocks frozen all run, dropout on", _basefinetuning(3)),
    "a2-emb5": Spec("schedule 0 3 5 5 5 (alpha=1/2)", _sched({1: 3, 2: 5})),
    "lora": Spec("LoRA r=8 alpha=16 dropout 0.1 on query/value, classifier trained, lr 5e-5", model=_lora()),
    "lora-5e-4": Spec("as lora, lr 5e-4", model=_lora(), lr=5e-4),
    # sub-epoch (freeze_interval), cache-compatible settings unless said
    "p25": Spec("rule=paper, alpha=1/3, freeze_interval=0.25", _rule("paper", 0.25)),
    "p50": Spec("rule=paper, alpha=1/3, freeze_interval=0.5", _rule("paper", 0.5)),
    "af25": Spec("rule=autofreeze, freeze_interval=0.25", _rule("autofreeze", 0.25)),
    "af50": Spec("rule=autofreeze, freeze_interval=0.5", _rule("autofreeze", 0.5)),
    "s25": Spec("rule=schedule, alpha=1/3, freeze_interval=0.25", _rule("schedule", 0.25)),
    "s50": Spec("rule=schedule, alpha=1/3, freeze_interval=0.5", _rule("schedule", 0.5)),
}


def run(name: str, spec: Spec, seed: int, dm: BenchData, args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    dm.seed = seed
    pl.seed_everything(seed, workers=True, verbose=False)
    lr = spec.lr or args.lr
    model = spec.model(model_dir, lr) if spec.model else SentimentClassifier(pretrained=model_dir, lr=lr)
    evals = EvalAt(dm, set(args.eval_epochs))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy="auto", precision="32-true", max_epochs=args.epochs,
        callbacks=[*spec.callbacks(), evals], num_sanity_val_steps=0, limit_val_batches=0, enable_checkpointing=False,
        logger=False, enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    af = _autofreeze(trainer)
    return {
        "variant": name, "seed": seed, "epochs": args.epochs, "train_size": args.train_size, "lr": lr,
        "acc": {str(k): v for k, v in sorted(evals.acc.items())}, "final": evals.acc.get(args.epochs - 1),
        "train_s": [evals.train_s[e] for e in sorted(evals.train_s)], "fit_s": time.perf_counter() - start,
        "step_history": af.step_history if af is not None else None, "threads": torch.get_num_threads(),
    }  # fmt: skip


def summary(path: Path) -> str:
    rows: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        rows.setdefault((r["variant"], r["train_size"], r["epochs"]), []).append(r)
    base: dict[tuple[int, int, int], float] = {}
    for (v, n, e), rs in rows.items():
        if v == "full":
            for r in rs:
                base[(n, e, r["seed"])] = r["final"]
    out = ["| variant | train | epochs | seeds | final acc per seed (%) | mean | vs full, same seeds (pt) | acc after epoch 1, the 2nd (%) | freezes (step, F) of the first seed |",
           "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for (v, n, e), rs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0] != "full", kv[0][0])):
        rs = sorted(rs, key=lambda r: r["seed"])
        finals = [100 * r["final"] for r in rs]
        diffs = [100 * (r["final"] - base[(n, e, r["seed"])]) for r in rs if (n, e, r["seed"]) in base]
        e1 = [100 * r["acc"]["1"] for r in rs if "1" in r["acc"]]
        out.append(
            f"| {v} | {n} | {e} | {','.join(str(r['seed']) for r in rs)} | {' / '.join(f'{a:.2f}' for a in finals)} | "
            f"{statistics.fmean(finals):.2f} | {statistics.fmean(diffs):+.2f} ({len(diffs)}) | "
            f"{' / '.join(f'{a:.2f}' for a in e1) or '-'} | {rs[0]['step_history']} |"
        )
    return "\n".join(out)


def docs_page(table: str, records: Path, docs: Path) -> str:
    """The summary as a docs page: what ran, where, and what each variant means (findings are in docs/autofreeze.md)."""
    runs = [json.loads(line) for line in records.read_text().splitlines()]
    seen = {r["variant"] for r in runs}
    threads = sorted({r.get("threads") for r in runs} - {None})
    meanings = "\n".join(f"- `{name}`: {spec.help}" for name, spec in SPECS.items() if name in seen)

    def shown(path: Path) -> Path:
        return path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path

    return f"""# Where freezing loses accuracy: ablations (issue 17)

Generated by `python -m benchmarks.freeze_accuracy --summary --out {shown(records)} --docs {shown(docs)}` on
{time.strftime("%Y-%m-%d")} from the records in `{shown(records)}`
(one JSON line per run, appended as runs finish: runs of one variant may come from different sittings).
What the numbers say is in [autofreeze.md](autofreeze.md#where-the-accuracy-goes-measured).

Setting: the time-to-accuracy benchmark's (MiniLM-L6, Rotten Tomatoes, 3,000 training and 5,134
validation snippets, 5 epochs, batch 32, fused AdamW lr 5e-5 with 10% warm-up and linear decay, the
same batches and head initialisation per seed), every variant under the plain single-device
strategy without AutoCache (the cache is exact). Accuracy only, on the whole validation side after
epoch 1 (the second) and the last; times are not reported (the runs shared a 2-core machine;
torch threads per run: {threads}).
One seed is one run: seed-to-seed spread of the baseline on this setting is about 0.2-0.3 points
(docs/benchmarks.md), so single-seed differences below that are noise.

{table}

Variants:

{meanings}
"""


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.freeze_accuracy", description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="full,sched")
    p.add_argument("--seeds", default="0")
    p.add_argument("--train-size", type=int, default=3000)
    p.add_argument("--val-size", type=int, default=None)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--eval-epochs", default="1")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "freeze_accuracy" / "runs.jsonl")
    p.add_argument("--list", action="store_true")
    p.add_argument("--summary", action="store_true")
    p.add_argument("--docs", type=Path, default=None, help="with --summary: also write the table, the variants' meanings and the machine to this markdown file")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(f"{k:12s} {s.help}" for k, s in SPECS.items()))
        return 0
    if args.summary:
        table = summary(args.out)
        print(table)
        if args.docs is not None:
            args.docs.write_text(docs_page(table, args.out, args.docs))
            print(f"freeze_accuracy: wrote {args.docs}")
        return 0
    args.eval_epochs = [int(e) for e in args.eval_epochs.split(",") if e.strip()]
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in SPECS]
    if unknown:
        p.error(f"unknown variants {unknown}; --list shows them")
    quiet()
    torch.set_num_threads(args.threads)
    model_dir = str(fetch("minilm-l6"))
    dm = BenchData(seed=0, padding="bucket", tokenizer=model_dir, train_size=args.train_size, val_size=args.val_size, max_length=64, batch_size=32)
    dm.setup("fit")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    failed = 0
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name in names:
            try:
                rec = run(name, SPECS[name], seed, dm, args, model_dir)
            except Exception:
                traceback.print_exc()
                failed += 1
                continue
            finally:
                gc.collect()
            with args.out.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"freeze_accuracy: seed {seed} {name}: acc {rec['acc']} freezes {rec['step_history']} ({rec['fit_s']:.0f} s)", flush=True)
    return 1 if failed else 0
