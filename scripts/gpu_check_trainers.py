"""The GPU check's Trainer parts: real fits on ``cuda:0`` (or the CPU, for a dry run) against ``strategy="auto"``.

``trainers`` (fp32: a tiny BERT and a tiny Llama-style decoder; ``pipe_len=2`` with ``chunks`` 1
and 2, ``cache=True``, both together, an AutoFreeze schedule over 3 short epochs, an in-place op on
the stack's output), ``precisions`` (the pipeline with the cache in bf16-mixed and 16-mixed),
``lora`` (PEFT LoRA + gradient checkpointing through the pipeline and the cache) and ``compile``
(``model.compile()`` of the whole model with ``pipe_len=2``).

Each case is one row: its final weights against a plain Trainer's on the same data and seed, and
whether the feature engaged, read while it was in force. The pipeline is read in epoch 0 and (without
the cache) epoch 1, where the plan has K=2: every block runs once per micro-batch (plus the one
probe pass in epoch 0) and, on CUDA, each stage on a stream of its own, not the training loop's.
The schedule's last epoch has shrunk the plan to K=1, where a pipeline that never ran looks the
same as one that did, so engagement is not read there. The cache is read in the last epoch, once it serves: its frozen blocks ran only for the
one-off check of the first hits.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from gpu_check import FAIL, PASS, RAN, SKIP, Row
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from lightning_pipetransformer.stack.discovery import find_block_stack
from lightning_pipetransformer.stack.observers import sees_block_runs

VOCAB, SEQ, SAMPLES, BATCH, EPOCHS = 64, 16, 96, 16, 3
STEPS = SAMPLES // BATCH
SCHEDULE = {1: 2, 2: 3}
#: Final-weight tolerance against strategy="auto" per precision: fp32 matches to rounding; AMP runs
#: see other kernels for other (micro-)batch shapes, and 18 SGD steps carry the rounding on.
TOLERANCE = {"32-true": (1e-3, 1e-4), "bf16-mixed": (1e-1, 2e-2), "16-mixed": (5e-2, 5e-3)}
Emit = Callable[[Row], None]


def tiny(arch: str) -> nn.Module:
    """A 4-block BERT encoder or Llama-style decoder, hidden 64, from a config (no download)."""
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaModel

    if arch == "bert":
        return BertModel(BertConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        ), add_pooling_layer=False)
    return LlamaModel(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=64,
    ))


class Classifier(pl.LightningModule):
    """A backbone, an in-place op on the stack's output (the pipeline's output must allow it), a head."""

    def __init__(self, arch: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = tiny(arch)
        self.head = nn.Linear(64, 2)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        hidden.mul_(1.0)  # in place on what the stack returned
        return self.head(hidden[:, -1])

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        ids, mask, labels = batch
        loss = nn.functional.cross_entropy(self(ids, mask).float(), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)


def data() -> DataLoader:
    """96 samples in 6 batches of 16, a third of them padded at the end: the same for every fit."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (SAMPLES, SEQ), generator=g)
    mask = torch.ones(SAMPLES, SEQ, dtype=torch.long)
    mask[::3, -4:] = 0
    labels = torch.randint(0, 2, (SAMPLES,), generator=g)
    return DataLoader(TensorDataset(ids, mask, labels), batch_size=BATCH, shuffle=False)


# ---------------------------------------------------------------------------------- what engaged, per epoch


@dataclass
class Epoch:
    """One training epoch as the blocks saw it."""

    runs: list[int]
    #: per block: the CUDA stream (its handle) each real run computed on, counted; empty off CUDA
    streams: list[Counter[int]]
    #: the training loop's own streams (where the plain loop, and the probe pass, run)
    caller: set[int] = field(default_factory=set)
    #: the strategy's plan in force during the epoch (read at its end; ``None`` for strategy="auto")
    plan: Any = None


class Engagement(pl.Callback):
    """Counts each block's real forward runs per epoch (a pre-hook fires only when a block computes),
    the stream each ran on, the loop's stream and the plan in force. The hooks go on at
    ``on_fit_start``, on the strategy's stack once it is set up (a PEFT or compiled model too)."""

    def __init__(self) -> None:
        self.epochs: list[Epoch] = []
        self.blocks = 0
        self.cuda = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stack = getattr(trainer.strategy, "stack", None) or find_block_stack(pl_module)
        self.cuda = pl_module.device.type == "cuda"
        self.blocks = len(stack.blocks)
        for index, block in enumerate(stack.blocks):
            block.register_forward_pre_hook(sees_block_runs(lambda *_, i=index: self._ran(i)))

    def _ran(self, index: int) -> None:
        if not self.epochs:
            return
        epoch = self.epochs[-1]
        epoch.runs[index] += 1
        if self.cuda:
            epoch.streams[index][torch.cuda.current_stream().cuda_stream] += 1

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epochs.append(Epoch(runs=[0] * self.blocks, streams=[Counter() for _ in range(self.blocks)]))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.cuda:
            self.epochs[-1].caller.add(torch.cuda.current_stream().cuda_stream)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epochs[-1].plan = getattr(trainer.strategy, "plan", None)


def pipeline_engaged(epoch: Epoch, chunks: int, probe: int, steps: int = STEPS) -> tuple[bool, str]:
    """Whether ``epoch`` ran as a K=2 pipeline of ``chunks`` micro-batches.

    The plan must say K=2; every block must have run ``chunks`` times per step (``probe`` more: the
    first pass over a stack runs the blocks once as the model calls them, to learn its outputs);
    on CUDA the blocks of each stage must have run on that stage's stream, one per stage, none of
    them the loop's (the K=1, M=1 path and the plain loop run there).
    """
    plan = epoch.plan
    if plan is None or plan.pipe_len != 2:
        return False, f"plan in force {describe_plan(plan)}, not K=2: the pipeline was not checked"
    expected = probe + chunks * steps
    ok = epoch.runs == [expected] * len(epoch.runs) and plan.chunks == chunks
    text = f"plan {describe_plan(plan)}, runs per block {epoch.runs} (expected {expected})"
    if not any(epoch.streams):
        return ok, text + "; streams not checked (CPU)"
    streams_ok, streams_text = stage_streams_ok(epoch, plan.partition, chunks * steps)
    return ok and streams_ok, f"{text}; {streams_text}"


def stage_streams_ok(epoch: Epoch, partition: tuple[int, ...], per_block: int) -> tuple[bool, str]:
    """Each stage's blocks ran ``per_block`` times on one stream of their own, not the loop's."""
    names: dict[int, str] = {s: f"loop{i}" for i, s in enumerate(sorted(epoch.caller))}
    stage_of_stream: dict[int, int] = {}
    ok, start, shown = True, 0, []
    for stage, size in enumerate(partition):
        counts = Counter[int]()
        for block in range(start, start + size):
            counts.update(epoch.streams[block])
            stream, calls = epoch.streams[block].most_common(1)[0] if epoch.streams[block] else (0, 0)
            ok &= calls == per_block and stream not in epoch.caller and stage_of_stream.setdefault(stream, stage) == stage
        start += size
        for stream in counts:
            names.setdefault(stream, f"s{len(names)}")
        shown.append(f"stage {stage} on {dict((names[s], n) for s, n in counts.items())}")
    return ok, "streams: " + ", ".join(shown)


def cache_served(epoch: Epoch, stats: dict[str, float] | None, steps: int = STEPS, previous: Epoch | None = None) -> tuple[bool, str]:
    """In an epoch the cache serves, the frozen blocks ran at most once (the first hits' check), the rest every micro-batch.

    Right after a boundary move F -> F' (``previous`` ran at F) the entries advance lazily, as each
    batch reads them: blocks F..F'-1 then run once per batch (no micro-batches), blocks below F never.
    """
    plan = epoch.plan
    hits = int((stats or {}).get("autocache/hits", 0))
    if plan is None:
        return False, "no plan: the cache was not checked"
    frozen, chunks = plan.num_frozen, plan.chunks
    before = previous.plan.num_frozen if previous is not None and previous.plan is not None else frozen
    active = [chunks * steps] * (len(epoch.runs) - frozen)
    if before < frozen:  # advanced in this epoch: blocks before..frozen-1 per batch
        expected = [0] * before + [steps] * (frozen - before) + active
    else:
        expected = [1] * frozen + active
    return hits > 0 and epoch.runs == expected, (
        f"last epoch ({frozen} frozen{f', advanced from {before}' if before < frozen else ''}): runs per block "
        f"{epoch.runs} (expected {expected}), cache hits {hits}"
    )


def describe_plan(plan: Any) -> str:
    if plan is None:
        return "none"
    return f"F={plan.num_frozen} K={plan.pipe_len} M={plan.chunks} {tuple(plan.partition)}"


# ---------------------------------------------------------------------------------- fits and comparisons


def fit(
    module: pl.LightningModule, strategy: Any, precision: str, accelerator: str, *,
    schedule: dict[int, int] | None, loader: DataLoader, epochs: int = EPOCHS,
) -> tuple[Engagement, float]:
    """One fit on one device; returns what engaged and the seconds it took (device work included)."""
    engagement = Engagement()
    callbacks: list[pl.Callback] = [engagement]
    if schedule is not None:
        callbacks.insert(0, AutoFreeze(schedule=schedule))
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as root:
        trainer = pl.Trainer(
            accelerator=accelerator, devices=1, strategy=strategy, precision=precision, max_epochs=epochs,
            callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
        )
        pl.seed_everything(0, verbose=False)
        start = time.perf_counter()
        trainer.fit(module, loader)
        if accelerator != "cpu":
            torch.cuda.synchronize()
        return engagement, time.perf_counter() - start


def same_weights(module: nn.Module, reference: nn.Module, precision: str) -> tuple[bool, float]:
    """Every tensor of the state dicts within the precision's tolerance (a compiled model's ``_orig_mod.`` ignored)."""
    rtol, atol = TOLERANCE[precision]
    ours = {k.replace("_orig_mod.", ""): v for k, v in module.state_dict().items()}
    theirs = {k.replace("_orig_mod.", ""): v for k, v in reference.state_dict().items()}
    if ours.keys() != theirs.keys():
        return False, float("inf")
    worst, ok = 0.0, True
    for key, a in ours.items():
        a, b = a.float().cpu(), theirs[key].float().cpu()
        worst = max(worst, float((a - b).abs().max()) if a.numel() else 0.0)
        ok &= bool(torch.isfinite(a).all()) and bool(torch.allclose(a, b, rtol=rtol, atol=atol))
    return ok, worst


def tolerance_text(precision: str) -> str:
    """The limit the weights' difference is checked against, for the row beside the number."""
    rtol, atol = TOLERANCE[precision]
    return f"limit rtol {rtol:g}, atol {atol:g}"


def cache_dir() -> str:
    """A fresh folder per fit: no entry of an earlier fit (or run) can serve this one."""
    return tempfile.mkdtemp(prefix="gpu_check_cache_")


def failed(part: str, case: str, err: BaseException, seconds: float = 0.0) -> Row:
    """A case that raised is a failed row, not the end of the part."""
    return Row(part, case, FAIL, f"{type(err).__name__}: {str(err)[:300]}", seconds)


# ---------------------------------------------------------------------------------- the parts


@dataclass(frozen=True)
class Case:
    name: str
    strategy: Callable[[], PipeTransformerStrategy]
    pipe: bool
    cache: bool
    chunks: int = 1


def trainer_cases() -> list[Case]:
    return [
        Case("pipe_len=2 chunks=1", lambda: PipeTransformerStrategy(pipe_len=2, chunks=1), pipe=True, cache=False, chunks=1),
        Case("pipe_len=2 chunks=2", lambda: PipeTransformerStrategy(pipe_len=2, chunks=2), pipe=True, cache=False, chunks=2),
        Case("cache=True", lambda: PipeTransformerStrategy(cache=True, cache_dir=cache_dir()), pipe=False, cache=True),
        Case("pipe_len=2 chunks=2 cache=True", lambda: PipeTransformerStrategy(pipe_len=2, chunks=2, cache=True, cache_dir=cache_dir()),
             pipe=True, cache=True, chunks=2),
    ]


def run_case(part: str, arch: str, case: Case, precision: str, accelerator: str, reference: nn.Module) -> Row:
    """Fit ``case`` and compare: the weights with ``reference``'s, the pipeline in epoch 0 (K=2), the cache in the last."""
    label = f"{arch} {precision} {case.name}"
    start = time.perf_counter()
    try:
        strategy = case.strategy()
        module = Classifier(arch)
        engagement, seconds = fit(module, strategy, precision, accelerator, schedule=SCHEDULE, loader=data())
    except Exception as err:  # noqa: BLE001 - a failure is a row of the table
        return failed(part, label, err, time.perf_counter() - start)
    same, worst = same_weights(module, reference, precision)
    ok, details = same, [f"max |w - w_auto| {worst:.2e} ({tolerance_text(precision)})"]
    if case.pipe:  # epoch 0: K=2, nothing frozen; epoch 1: still K=2, 2 frozen blocks in stage 0 (without the cache)
        for index in (0,) if case.cache else (0, 1):
            engaged, text = pipeline_engaged(engagement.epochs[index], case.chunks, probe=1 if index == 0 else 0)
            ok &= engaged
            details.append(f"epoch {index}: {text}")
    if case.cache:
        served, text = cache_served(engagement.epochs[-1], strategy.cache_stats, previous=engagement.epochs[-2])
        ok &= served
        details.append(text)
    return Row(part, label, PASS if ok else FAIL, "; ".join(details), seconds)


def reference_fit(part: str, arch: str, precision: str, accelerator: str, emit: Emit) -> nn.Module | None:
    """strategy="auto" with the same schedule, data and seed; a row that says it ran (it checks nothing itself)."""
    label = f"{arch} {precision} strategy=auto (reference)"
    try:
        module = Classifier(arch)
        _, seconds = fit(module, "auto", precision, accelerator, schedule=SCHEDULE, loader=data())
    except Exception as err:  # noqa: BLE001
        emit(failed(part, label, err))
        return None
    emit(Row(part, label, RAN, "the rows below compare with it", seconds))
    return module


def part_trainers(accelerator: str, emit: Emit) -> None:
    """fp32: both architectures, every case against its reference."""
    part = "2 Trainers fp32"
    for arch in ("bert", "llama"):
        reference = reference_fit(part, arch, "32-true", accelerator, emit)
        for case in trainer_cases():
            if reference is None:
                emit(Row(part, f"{arch} 32-true {case.name}", FAIL, "not compared: the reference fit failed", 0.0))
                continue
            emit(run_case(part, arch, case, "32-true", accelerator, reference))


def part_precisions(accelerator: str, emit: Emit) -> None:
    """The pipeline with the cache under AMP, against strategy="auto" under the same precision."""
    part = "4 AMP"
    case = trainer_cases()[-1]
    for arch in ("bert", "llama"):
        for precision in ("bf16-mixed", "16-mixed"):
            if precision == "16-mixed" and accelerator == "cpu":
                emit(Row(part, f"{arch} {precision} {case.name}", SKIP, "needs CUDA (fp16 autocast with a GradScaler)", 0.0))
                continue
            reference = reference_fit(part, arch, precision, accelerator, emit)
            if reference is None:
                emit(Row(part, f"{arch} {precision} {case.name}", FAIL, "not compared: the reference fit failed", 0.0))
                continue
            emit(run_case(part, arch, case, precision, accelerator, reference))


def lora_module(lora: str, checkpointing: str) -> pl.LightningModule:
    """The recipes test's tiny Llama with PEFT LoRA on q/v (``lora``: "all" or "upper" layers) and HF checkpointing."""
    import peft

    from tests.helpers.families import FamilyModule

    module = FamilyModule("llama")
    layers = {} if lora == "all" else {"layers_to_transform": [2, 3]}
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, **layers)
    module.model = peft.get_peft_model(module.model, config)
    with torch.no_grad():  # LoRA's B starts at zero: a non-zero start makes every adapter's gradient show
        for index, (name, p) in enumerate(module.model.named_parameters()):
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(index))
    module.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    return module


def recipe_row(
    part: str, label: str, build: Callable[[], pl.LightningModule], strategy: Callable[[], PipeTransformerStrategy],
    schedule: dict[int, int] | None, accelerator: str, check: Callable[[Engagement, PipeTransformerStrategy], tuple[bool, str]],
    build_reference: Callable[[], pl.LightningModule] | None = None,
) -> Row:
    """A recipe through the strategy against the same model under a plain Trainer (fp32, the recipes' data)."""
    from tests.helpers.families import family_data

    start = time.perf_counter()
    try:
        reference = (build_reference or build)()
        fit(reference, "auto", "32-true", accelerator, schedule=schedule, loader=family_data("llama"))
        module, chosen = build(), strategy()
        engagement, seconds = fit(module, chosen, "32-true", accelerator, schedule=schedule, loader=family_data("llama"))
    except Exception as err:  # noqa: BLE001
        return failed(part, label, err, time.perf_counter() - start)
    same, worst = same_weights(module, reference, "32-true")
    engaged, text = check(engagement, chosen)
    return Row(part, label, PASS if same and engaged else FAIL, f"max |w - w_auto| {worst:.2e} ({tolerance_text('32-true')}); {text}",
               seconds)


def recipe_steps() -> int:
    """Steps per epoch of the recipes' data (``tests/helpers/families.py``: 3 batches of 6)."""
    from tests.helpers.families import family_data

    return len(family_data("llama"))


def part_lora(accelerator: str, emit: Emit) -> None:
    """PEFT LoRA on every layer + reentrant gradient checkpointing, pipelined at K=2 (epoch 0) and cached (epoch 2)."""
    part, steps = "5 LoRA + checkpointing + cache", recipe_steps()

    def check(engagement: Engagement, strategy: PipeTransformerStrategy) -> tuple[bool, str]:
        piped, piped_text = pipeline_engaged(engagement.epochs[0], 2, probe=1, steps=steps)
        served, served_text = cache_served(engagement.epochs[-1], strategy.cache_stats, steps=steps, previous=engagement.epochs[-2])
        return piped and served, f"epoch 0: {piped_text}; {served_text}"

    emit(recipe_row(
        part, "llama LoRA(all) + reentrant checkpointing, pipe_len=2 chunks=2 cache=True, freeze {1: 3}",
        lambda: lora_module("all", "reentrant"),
        lambda: PipeTransformerStrategy(pipe_len=2, chunks=2, cache=True, cache_memory=10**8, cache_dir=cache_dir()),
        {1: 3}, accelerator, check,
    ))


def part_compile(accelerator: str, emit: Emit) -> None:
    """``model.compile()`` of the whole model, pipelined at K=2 in every epoch, against the eager model.

    The backend is ``aot_eager`` unless ``GPU_CHECK_COMPILE_BACKEND`` names another: what this part
    checks (Dynamo tracing through the block interception, AOT autograd's backward through the
    pipeline's stages, the pipeline engaged under compile) happens before code generation, and
    inductor's cold Triton compile of every graph between the blocks' breaks could take minutes,
    more than the part's 45 s. ``GPU_CHECK_COMPILE_BACKEND=inductor`` (with ``--only compile`` and a
    larger ``--timeout compile=``) runs the real kernels.
    """
    from tests.helpers.families import FamilyModule

    part, steps = "6 model.compile()", recipe_steps()
    backend = os.environ.get("GPU_CHECK_COMPILE_BACKEND", "aot_eager")

    def build_compiled() -> pl.LightningModule:
        module = FamilyModule("llama")
        module.model.compile(backend=backend)
        return module

    def check(engagement: Engagement, strategy: PipeTransformerStrategy) -> tuple[bool, str]:
        results = [pipeline_engaged(epoch, 2, probe=1 if i == 0 else 0, steps=steps) for i, epoch in enumerate(engagement.epochs)]
        return all(ok for ok, _ in results), "; ".join(f"epoch {i}: {text}" for i, (_, text) in enumerate(results))

    torch._dynamo.reset()
    emit(recipe_row(
        part, f"llama model.compile(backend={backend!r}), pipe_len=2 chunks=2, no freeze", build_compiled,
        lambda: PipeTransformerStrategy(pipe_len=2, chunks=2), None, accelerator, check,
        build_reference=lambda: FamilyModule("llama"),
    ))
