"""One run: the Trainer of a variant (callbacks, strategy, the peers' set-up) and the fit that fills its record."""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
import traceback
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch

from examples.text_classification import SentimentClassifier
from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy, PipeTransformerTimeline
from lightning_pipetransformer.freeze.policies import FreezeRule, PlasticityRule

from .data import BenchData
from .models import MODELS, ModelSpec
from .variants import RunRecord, Variant

__all__ = [
    "CheckClock", "CudaSync", "StepClock", "build_model", "build_trainer", "check_interval", "correct_by_position", "evaluate", "lora_config",
    "lower_blocks_finetuning", "quiet", "run_one",
]

def cache_supported() -> bool:
    """Whether this build's strategy takes AutoCache's arguments (``cache=``)."""
    try:
        PipeTransformerStrategy(pipe_len=1, cache=True)  # type: ignore[call-arg]
    except TypeError:
        return False
    return True


def interval_supported() -> bool:
    """Whether this build's AutoFreeze takes ``freeze_interval`` and ``rule="autofreeze"`` (issue 17)."""
    try:
        AutoFreeze(rule="autofreeze", freeze_interval=0.5)  # type: ignore[call-arg, arg-type]
    except (TypeError, ValueError):
        return False
    return True


def anneal_supported() -> bool:
    """Whether this build's AutoFreeze takes ``anneal=`` (smooth freezing, issue 25)."""
    try:
        AutoFreeze(anneal="cosine")  # type: ignore[call-arg]
    except (TypeError, ValueError):
        return False
    return True


def peft_supported() -> bool:
    """Whether ``peft`` (the LoRA peer, ``pip install -e ".[benchmarks]"``) is installed."""
    try:
        import peft  # noqa: F401
    except ImportError:
        return False
    return True

class StepClock(pl.Callback):
    """Training seconds and optimizer steps per number of frozen blocks (what bounds a variant's speed-up).

    A batch's time runs from the previous batch's end (or the epoch's start) to its own end, so the
    data loading, a freeze and a cache advance at its start count with it. The frozen count is
    AutoFreeze's during the step; without AutoFreeze, ``frozen``: the blocks a static freeze holds
    (BaseFinetuning, LoRA's untouched lower blocks), 0 for the rest. One ``perf_counter`` per batch.
    """

    def __init__(self, frozen: int = 0) -> None:
        self.seconds: dict[str, float] = {}
        self.steps: dict[str, int] = {}
        self.frozen = frozen
        self._mark = 0.0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        af = next((c for c in trainer.callbacks if isinstance(c, AutoFreeze)), None)  # type: ignore[attr-defined]
        key = str(af.num_frozen if af is not None else self.frozen)
        self.seconds[key] = self.seconds.get(key, 0.0) + (now - self._mark)
        self.steps[key] = self.steps.get(key, 0) + 1
        self._mark = now

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A check inside the epoch runs after a batch's end: the next batch's time starts after it.
        self._mark = time.perf_counter()


class CudaSync(pl.Callback):
    """First in the callback list of a GPU run: waits for the queued kernels where the clocks after it read
    the time (epoch start and end, validation start and end), so a segment does not end before its work."""

    def _sync(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sync(pl_module.device)

    on_train_epoch_start = on_train_epoch_end = on_validation_start = on_validation_end = _sync  # type: ignore[assignment]


class CheckClock(pl.Callback):
    """Every validation check of ``fit``: the global step, the training seconds up to it and the accuracy.

    The training clock runs from each train-epoch start to its end and stops during validation, the
    segments :class:`~lightning_pipetransformer.PipeTransformerTimeline` counts as ``train_s`` (so the last check's seconds add
    up to the run's training time). Listed before AutoFreeze: an epoch-start freeze counts as training.
    """

    def __init__(self, monitor: str = "val/acc") -> None:
        self.monitor = monitor
        self.checks: list[dict[str, Any]] = []
        self.train_s = 0.0
        self._mark: float | None = None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark = time.perf_counter()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._mark is not None and not trainer.sanity_checking:
            self.train_s += time.perf_counter() - self._mark
            self._mark = None

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.monitor)
        self.checks.append({"step": int(trainer.global_step), "train_s": self.train_s, "acc": None if value is None else float(value)})
        self._mark = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._mark is not None:
            self.train_s += time.perf_counter() - self._mark
            self._mark = None


def check_interval(args: argparse.Namespace, steps_per_epoch: int) -> int | None:
    """Optimizer steps between validation checks (``--val-every`` of an epoch, rounded as AutoFreeze rounds
    ``freeze_interval``, so the 0.25-epoch rows' freeze points fall on checks); ``None``: the older schedule,
    the whole validation set at every epoch end."""
    if args.val_every >= 1.0 and args.val_subset is None:
        return None
    return max(1, round(args.val_every * steps_per_epoch))


@torch.inference_mode()
def evaluate(model: pl.LightningModule, loader: Any, device: str | torch.device = "cpu") -> float:
    """Accuracy of ``model`` over ``loader`` with a plain loop (after ``fit``: no strategy, no cache, eval mode),
    on ``device`` (Lightning's teardown leaves the module on the CPU; a GPU run evaluates on the GPU)."""
    was_training = model.training
    model.to(device).eval()
    right = total = 0
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(batch["input_ids"], batch["attention_mask"])
        right += int((logits.argmax(dim=-1) == batch["labels"]).sum())
        total += int(batch["labels"].numel())
    model.train(was_training)
    return right / max(total, 1)


@torch.inference_mode()
def correct_by_position(model: pl.LightningModule, loader: Any, device: str | torch.device = "cpu") -> dict[int, bool]:
    """Whether ``model`` classifies each validation snippet right, keyed by its position in the validation
    set (the loader's ``batch_sampler`` lists the positions of each batch). One pass over the whole set gives
    the final accuracy and the subset's end-of-training point both, instead of a second forward of the subset."""
    was_training = model.training
    model.to(device).eval()
    out: dict[int, bool] = {}
    for positions, batch in zip(loader.batch_sampler, loader, strict=True):
        batch = {k: v.to(device) for k, v in batch.items()}
        right = (model(batch["input_ids"], batch["attention_mask"]).argmax(dim=-1) == batch["labels"]).tolist()
        out.update(zip(positions, right, strict=True))
    model.train(was_training)
    return out


def eval_device(args: argparse.Namespace) -> torch.device:
    """Where the plain evaluation after ``fit`` runs: the GPU of a ``--device cuda`` run, else the CPU."""
    return torch.device("cuda") if args.accelerator in ("cuda", "gpu") else torch.device("cpu")


def sync(device: torch.device) -> None:
    """Wait for the GPU's queued work before reading a clock (kernels run asynchronously on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def lower_blocks_finetuning(blocks: int, backbone: str = "bert") -> pl.Callback:
    """Lightning's own way to freeze part of a model: a ``BaseFinetuning`` subclass that freezes the
    embeddings and the first ``blocks`` encoder blocks before training and keeps them frozen.

    ``BaseFinetuning.freeze`` turns ``requires_grad`` off and leaves the modules in train mode (their
    dropout stays on). The example's ``configure_optimizers`` keeps only trainable parameters, as
    ``BaseFinetuning`` asks, so the frozen ones are not in the optimizer and LambdaLR schedules the
    rest as usual. (``BackboneFinetuning``, the other stock subclass, needs a ``backbone`` attribute and
    unfreezes it into a new parameter group that the example's LambdaLR does not schedule; it also
    trains the whole model after its unfreeze epoch, so it does not cut training time.)
    """
    from lightning.pytorch.callbacks import BaseFinetuning

    class FreezeLowerBlocks(BaseFinetuning):
        def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
            encoder = getattr(pl_module.model, backbone)  # BertModel, MPNetModel
            # MPNet's relative-position bias (encoder.relative_attention_bias) feeds every block: a user
            # freezing the lower blocks would freeze it too, or its gradient flows through all of them.
            extra = [encoder.encoder.relative_attention_bias] if hasattr(encoder.encoder, "relative_attention_bias") else []
            self.freeze([encoder.embeddings, *extra, *list(encoder.encoder.layer)[:blocks]])

        def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: Any) -> None:
            pass  # frozen for the whole run

    return FreezeLowerBlocks()


def model_spec(args: argparse.Namespace) -> ModelSpec:
    """The ``--model`` being fine-tuned (MiniLM-L6 for namespaces that predate the flag)."""
    return MODELS[getattr(args, "model", "minilm-l6")]


def lora_config(args: argparse.Namespace, above: int | None = None) -> Any:
    """LoRA on the attention query and value projections; the classifier trained in full. ``above``: only on the
    blocks from that index up (issue 41's LoRA + cache row), so the lower blocks and the embeddings keep no
    trainable parameter: a frozen prefix the cache serves."""
    from peft import LoraConfig, TaskType

    spec = model_spec(args)
    where: dict[str, Any] = {}
    if above is not None:
        where = {"layers_to_transform": list(range(above, spec.blocks)), "layers_pattern": "layer"}
    return LoraConfig(
        task_type=TaskType.SEQ_CLS, r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
        target_modules=list(spec.lora_targets), modules_to_save=["classifier"], **where,
    )  # fmt: skip


def build_model(variant: Variant, args: argparse.Namespace, model_dir: str) -> pl.LightningModule:
    """The example's LightningModule; for LoRA its ``model`` wrapped by ``peft.get_peft_model`` (after the
    classifier head is initialised, so the head starts the same as in every other variant of the seed)."""
    if variant.kind not in ("lora", "lorac"):
        return SentimentClassifier(pretrained=model_dir, lr=args.lr, llrd=variant.llrd)
    from peft import get_peft_model

    model = SentimentClassifier(pretrained=model_dir, lr=args.lora_lr if args.lora_lr is not None else args.lr)
    model.model = get_peft_model(model.model, lora_config(args, variant.blocks if variant.kind == "lorac" else None))
    return model


def build_trainer(variant: Variant, args: argparse.Namespace, cache_dir: str) -> pl.Trainer:
    """The Trainer of one run: the same settings for every variant except callbacks and strategy."""
    # The clocks first: callbacks run in list order, and AutoFreeze's epoch-start freeze (re-plan, cache
    # advance over every stored sample) must fall inside the epoch they time.
    static = variant.blocks if variant.kind in ("bft", "bftc", "lorac") and variant.blocks is not None else 0
    timeline = PipeTransformerTimeline(print_table=False, save_json=False, save_plot=False)
    callbacks: list[pl.Callback] = [timeline, StepClock(frozen=static), CheckClock()]
    if eval_device(args).type == "cuda":
        callbacks.insert(0, CudaSync())
    strategy: Any = "auto"
    if variant.autofreeze:
        assert variant.alpha is not None
        extra: dict[str, Any] = {}
        if variant.sub_epoch:
            extra = {"freeze_interval": variant.interval, "percentile": args.percentile, "min_active": variant.min_active}
        if variant.anneal:
            extra["anneal"] = variant.anneal
        spec = model_spec(args)
        if spec.pre is not None:
            extra["pre"] = list(spec.pre)  # MPNet: the relative-position bias runs before the blocks (models.py)
        callbacks.append(AutoFreeze(alpha=variant.alpha, rule=variant.rule or args.rule, **extra))  # type: ignore[arg-type]
        # The same strategy for freeze and freeze+cache: the cache is the only difference (module docstring).
        cache = variant.kind == "cache"
        strategy = PipeTransformerStrategy(pipe_len=1, cache=cache, cache_dir=cache_dir if cache else None)  # type: ignore[call-arg]
    elif variant.kind == "bft":
        callbacks.append(lower_blocks_finetuning(args.bft_blocks, model_spec(args).backbone))
    elif variant.kind == "early":
        assert variant.rule is not None and variant.interval is not None
        spec = model_spec(args)
        rule: str | FreezeRule = PlasticityRule(ratio=variant.alpha or 2 / 3) if variant.rule == "plasticity" else variant.rule
        pre = {"pre": list(spec.pre)} if spec.pre is not None else {}
        callbacks.append(AutoFreeze(rule=rule, freeze_interval=variant.interval, **pre))  # type: ignore[arg-type]
        strategy = PipeTransformerStrategy(pipe_len=1, cache=True, cache_dir=cache_dir)  # type: ignore[call-arg]
    elif variant.kind in ("bftc", "lorac"):
        # Issue 41: a freeze that is not AutoFreeze's, served by the cache. BaseFinetuning (and peft) leave the frozen
        # blocks in train mode, their dropout on: the cache keeps them in eval mode instead (cache_frozen_eval),
        # since a stored output must be the one the block would compute.
        if variant.kind == "bftc":
            assert variant.blocks is not None
            callbacks.append(lower_blocks_finetuning(variant.blocks, model_spec(args).backbone))
        strategy = PipeTransformerStrategy(  # type: ignore[call-arg]
            pipe_len=1, cache=True, cache_frozen_eval=True, cache_dir=cache_dir
        )
    elif variant.kind == "es":
        # The peer a user who wants speed picks: stop once the validation checks stop improving. It watches
        # the same checks as every row (every --val-every epoch, on the subset); the learning-rate schedule
        # is the baseline's, planned for the whole epoch budget.
        from lightning.pytorch.callbacks import EarlyStopping

        callbacks.append(EarlyStopping(monitor="val/acc", mode="max", patience=args.es_patience, min_delta=0.0))
    every = check_interval(args, args.steps_per_epoch)
    # Checks every `every` optimizer steps counted across epochs (no accumulation here: a batch is a step).
    checks: dict[str, Any] = {} if every is None else {"val_check_interval": every, "check_val_every_n_epoch": None}
    return pl.Trainer(
        accelerator=args.accelerator, devices=1, strategy=strategy, precision="32-true", max_epochs=args.epochs,
        callbacks=callbacks, num_sanity_val_steps=0, enable_checkpointing=False, logger=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False, **checks,
    )  # fmt: skip


def code_commit() -> str:
    """The commit the package and the benchmark come from, ``+changes`` when either differs from it (``""``: no git)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "lightning_pipetransformer", "benchmarks"], cwd=root, capture_output=True,
            text=True, check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+changes" if dirty else "")


def run_one(variant: Variant, seed: int, dm: BenchData, args: argparse.Namespace, model_dir: str) -> RunRecord:
    """Fit one variant with one seed and return its per-epoch timeline."""
    record = RunRecord(variant=variant.name, seed=seed, code_commit=code_commit())
    cache_dir = tempfile.mkdtemp(prefix="ttacc-cache-")  # a fresh cache per run: never a hit from another run
    try:
        dm.seed = seed
        pl.seed_everything(seed, workers=True, verbose=False)  # classifier head init, dropout
        model = build_model(variant, args, model_dir)
        trainer = build_trainer(variant, args, cache_dir)
        start = time.perf_counter()
        trainer.fit(model, datamodule=dm)
        record.fit_s = time.perf_counter() - start
        timeline = next(c for c in trainer.callbacks if isinstance(c, PipeTransformerTimeline))  # type: ignore[attr-defined]
        record.epochs = [asdict(r) for r in timeline.rows]
        clock = next(c for c in trainer.callbacks if isinstance(c, StepClock))  # type: ignore[attr-defined]
        record.frozen_s, record.frozen_steps = dict(clock.seconds), dict(clock.steps)
        if check_interval(args, args.steps_per_epoch) is not None:
            # The end of training: the subset (the last point of the curve, at the whole training time) and the
            # whole validation set (the final accuracy), by a plain loop after fit, outside every clock above.
            checks = next(c for c in trainer.callbacks if isinstance(c, CheckClock)).checks  # type: ignore[attr-defined]
            start = time.perf_counter()
            correct = correct_by_position(model, dm.full_val_dataloader(), eval_device(args))
            subset_positions = dm.subset_indices() or list(correct)
            subset = sum(correct[p] for p in subset_positions) / len(subset_positions)
            record.final_full_acc = sum(correct.values()) / len(correct)
            record.final_eval_s = time.perf_counter() - start
            end = {"step": int(trainer.global_step), "train_s": record.train_s, "acc": subset}
            record.checks = [c for c in checks if c["step"] < end["step"]] + [end]
        af = next((c for c in trainer.callbacks if isinstance(c, AutoFreeze)), None)  # type: ignore[attr-defined]
        record.freezes = [[int(a), int(b)] for a, b in (af.step_history if af is not None else [])]
        record.trainable_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    except Exception as err:  # one failed run must not lose the others of a long benchmark
        record.error = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
        gc.collect()
    return record


def quiet() -> None:
    """Keep the output to the benchmark's own lines: no per-run load reports or Trainer banners."""
    import logging

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_pipetransformer"):
        logging.getLogger(name).setLevel(logging.WARNING)
