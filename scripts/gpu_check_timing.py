"""The GPU check's timing part: the pipeline's forward + backward at K=2 on one GPU's streams against K=1.

Same model (a stack of Hugging Face ``BertLayer`` blocks), same batch, several M; every variant
runs once per round, in an order that rotates each round, so drift hits all alike; medians over
the rounds after warm-up, each timed with CUDA events on the caller's stream (backward orders its
side-stream work against that stream) and, as a cross-check, with the host clock between two
``torch.cuda.synchronize()``.

What the ratio means: on ONE GPU the two stages share the same SMs. K=2 against K=1 at the same M
measures the executor's overhead (a second stream, the events between the stages, more launches
from one Python thread) against whatever the two streams overlap (one stage's kernels filling the
SMs the other leaves idle). It is not a speed-up from more devices, which needs two GPUs: a ratio
above 1 is the price of the pipeline on one GPU, below 1 the overlap it finds.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from gpu_check import FAIL, INFO, PASS, Row
from torch import nn

from lightning_pipetransformer.pipe.partition import optimal_partition
from lightning_pipetransformer.pipe.pipeline import Pipeline

PART = "3 K=2 vs K=1 time"
Step = Callable[[], None]


@dataclass(frozen=True)
class Shape:
    """The stack and the batch that every variant runs."""

    layers: int = 8
    hidden: int = 1024
    heads: int = 16
    batch: int = 16
    seq: int = 256
    chunks: tuple[int, ...] = (1, 2, 4, 8)
    warmup: int = 2
    rounds: int = 15
    min_rounds: int = 3

    def describe(self) -> str:
        return (f"{self.layers} x BertLayer (hidden {self.hidden}, {self.heads} heads, FFN {4 * self.hidden}), "
                f"batch {self.batch} x seq {self.seq}")


def build_blocks(shape: Shape, device: torch.device, dtype: torch.dtype) -> list[nn.Module]:
    """``shape.layers`` BERT layers, dropout off, seeded: every variant runs these very blocks."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    config = BertConfig(
        hidden_size=shape.hidden, num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        intermediate_size=4 * shape.hidden, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return [BertLayer(config, layer_idx=i).to(device=device, dtype=dtype) for i in range(shape.layers)]


def batch_inputs(shape: Shape, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A hidden state and an additive padding mask (batch-shaped, so the pipeline splits it), half the rows padded."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(shape.batch, shape.seq, shape.hidden, generator=g).to(device=device, dtype=dtype)
    mask = torch.zeros(shape.batch, 1, 1, shape.seq, dtype=dtype)
    mask[: shape.batch // 2, ..., -shape.seq // 4:] = torch.finfo(dtype).min
    return hidden, mask.to(device)


def variants(blocks: list[nn.Module], shape: Shape, device: torch.device) -> dict[str, Callable[..., torch.Tensor]]:
    """The plain loop, and for each M: one stage (K=1) and two stages on two streams of the one device (K=2)."""

    def plain(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            out = block(hidden, mask)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    found: dict[str, Callable[..., torch.Tensor]] = {"plain loop": plain}
    for m in shape.chunks:
        for k in (1, 2):
            balance = optimal_partition([1.0] * len(blocks), k)
            found[f"K={k} M={m}"] = Pipeline(blocks, balance, [device] * k, m)
    return found


def train_step(fn: Callable[..., torch.Tensor], blocks: list[nn.Module], hidden: torch.Tensor, mask: torch.Tensor) -> Step:
    """One forward + backward of ``fn`` from fresh gradients (a weighted sum, so every output element matters)."""
    params = [p for b in blocks for p in b.parameters()]
    weight = torch.linspace(-1, 1, hidden.numel(), device=hidden.device).reshape(hidden.shape)

    def step() -> None:
        for p in params:
            p.grad = None
        (fn(hidden, mask).float() * weight).sum().backward()

    return step


class Timer:
    """Milliseconds of one step: CUDA events on the caller's stream, and the host clock between synchronizes.

    Off CUDA (the unit test's dry run) both are the host clock.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, step: Step) -> tuple[float, float]:
        if not self.cuda:
            start = time.perf_counter()
            step()
            wall = 1e3 * (time.perf_counter() - start)
            return wall, wall
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        begin.record()
        step()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end), 1e3 * (time.perf_counter() - start)


def measure(steps: dict[str, Step], timer: Callable[[Step], tuple[float, float]], shape: Shape, deadline: float) -> dict[str, list[tuple[float, float]]]:
    """Warm-up rounds, then timed rounds (each runs every variant once, rotated) until ``shape.rounds`` or ``deadline``
    (``time.perf_counter()``), but at least ``shape.min_rounds``."""
    names = list(steps)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(shape.warmup + shape.rounds):
        timed = r >= shape.warmup
        if timed and r - shape.warmup >= shape.min_rounds and time.perf_counter() > deadline:
            break
        for name in names[r % len(names):] + names[: r % len(names)]:
            sample = timer(steps[name])
            if timed:
                times[name].append(sample)
    return times


@dataclass(frozen=True)
class Summary:
    name: str
    median_ms: float
    q1_ms: float
    q3_ms: float
    wall_ms: float


def summarize(samples: Sequence[tuple[float, float]], name: str) -> Summary:
    """Median and quartiles of the event times, and the median host-clock time."""
    events = [e for e, _ in samples]
    q1, _, q3 = statistics.quantiles(events, n=4) if len(events) > 1 else (events[0], 0.0, events[0])
    return Summary(name, statistics.median(events), q1, q3, statistics.median(w for _, w in samples))


def ratio_rows(times: dict[str, list[tuple[float, float]]], label: str) -> list[Row]:
    """One row per M: K=2's median over K=1's, and the median of the per-round ratios."""
    rows = []
    plain = summarize(times["plain loop"], "plain loop")
    rows.append(Row(PART, f"{label} plain loop", INFO, f"median {plain.median_ms:.2f} ms (IQR {plain.q1_ms:.2f}-{plain.q3_ms:.2f}), "
                    f"host clock {plain.wall_ms:.2f} ms; {len(times['plain loop'])} rounds", 0.0))
    for name in times:
        if not name.startswith("K=1 "):
            continue
        m = name.split("M=")[1]
        one, two = summarize(times[name], name), summarize(times[f"K=2 M={m}"], f"K=2 M={m}")
        per_round = statistics.median(b[0] / a[0] for a, b in zip(times[name], times[f"K=2 M={m}"]))
        rows.append(Row(
            PART, f"{label} M={m}: K=2 / K=1", INFO,
            f"K=1 {one.median_ms:.2f} ms (IQR {one.q1_ms:.2f}-{one.q3_ms:.2f}), K=2 {two.median_ms:.2f} ms "
            f"(IQR {two.q1_ms:.2f}-{two.q3_ms:.2f}): ratio {two.median_ms / one.median_ms:.3f} "
            f"(per-round median {per_round:.3f}); host clock {one.wall_ms:.2f} / {two.wall_ms:.2f} ms",
            0.0,
        ))
    return rows


def same_results(blocks: list[nn.Module], found: dict[str, Callable[..., torch.Tensor]], hidden: torch.Tensor,
                 mask: torch.Tensor, dtype: torch.dtype) -> tuple[bool, str]:
    """What is timed must compute the same thing: K=2 with the most micro-batches against the plain loop, output and gradients."""
    params = [p for b in blocks for p in b.parameters()]

    def run(fn: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        out = fn(hidden, mask)
        out.float().square().mean().backward()
        return [out.detach().float().clone()] + [p.grad.detach().float().clone() for p in params]

    reference = run(found["plain loop"])
    name = [n for n in found if n.startswith("K=2 ")][-1]
    ours = run(found[name])
    # Relative error of each tensor as a whole (bf16 gradients summed over micro-batches round differently per
    # element), against a floor: some gradients are zero in exact arithmetic (attention's key bias) and only rounding.
    floor = 1e-3 * sum(float(b.norm()) for b in reference) / len(reference)
    limit = 1e-4 if dtype == torch.float32 else 3e-2
    worst = max(relative_error(a, b, floor) for a, b in zip(ours, reference))
    return worst <= limit, (f"{name} against the plain loop: output and {len(params)} gradients, worst ||a - b|| / ||b|| "
                            f"{worst:.2e} (limit {limit:.0e})")


def relative_error(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    """``||a - b|| / max(||b||, floor)``; NaN anywhere is infinitely wrong."""
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    return float((a - b).norm()) / max(float(b.norm()), floor, 1e-30)


def time_dtype(shape: Shape, device: torch.device, dtype: torch.dtype, deadline: float) -> list[Row]:
    """Check, then time, every variant in one dtype."""
    label = str(dtype).removeprefix("torch.")
    start = time.perf_counter()
    blocks = build_blocks(shape, device, dtype)
    hidden, mask = batch_inputs(shape, device, dtype)
    found = variants(blocks, shape, device)
    ok, text = same_results(blocks, found, hidden, mask, dtype)
    steps = {name: train_step(fn, blocks, hidden, mask) for name, fn in found.items()}
    times = measure(steps, Timer(device), shape, deadline)
    check = Row(PART, f"{label}: K=2 computes what the plain loop does (seconds: this dtype's check and timing)",
                PASS if ok else FAIL, text, time.perf_counter() - start)
    return [check, *ratio_rows(times, label)]


#: Seconds kept back from the part's deadline: the last rounds past a dtype's stop (``min_rounds``) and the exit.
RESERVE = 4.0


def part_deadline() -> float:
    """When (``time.time()``) the driver kills this part: ``GPU_CHECK_PART_DEADLINE``, else ``GPU_CHECK_PART_TIMEOUT`` from now."""
    if os.environ.get("GPU_CHECK_PART_DEADLINE"):
        return float(os.environ["GPU_CHECK_PART_DEADLINE"])
    return time.time() + float(os.environ.get("GPU_CHECK_PART_TIMEOUT", "60"))


def part_timing(accelerator: str, emit: Callable[[Row], None], shape: Shape | None = None) -> None:
    """fp32 (TF32 as torch's default leaves it) then bf16 weights. The time left before the part's deadline (its
    imports and CUDA start already spent), less ``RESERVE``, is shared: each dtype builds, checks and times its variants
    until its share ends (at least ``min_rounds`` timed rounds), so the part ends before it is killed."""
    shape = shape or Shape()
    device = torch.device("cuda:0" if accelerator == "gpu" else "cpu")
    deadline = part_deadline()
    emit(Row(PART, shape.describe(), INFO,
             "ONE GPU: both stages share its SMs, so K=2 / K=1 is the executor's overhead against any overlap of the "
             f"two streams, not a speed-up from more devices; TF32 matmul {torch.backends.cuda.matmul.allow_tf32}", 0.0))
    dtypes = (torch.float32, torch.bfloat16)
    for index, dtype in enumerate(dtypes):
        share = max(0.0, deadline - time.time() - RESERVE) / (len(dtypes) - index)
        try:
            for row in time_dtype(shape, device, dtype, time.perf_counter() + share):
                emit(row)
        except Exception as err:  # noqa: BLE001 - the other dtype still runs
            emit(Row(PART, f"{str(dtype).removeprefix('torch.')}", FAIL, f"{type(err).__name__}: {str(err)[:300]}", 0.0))
        if device.type == "cuda":
            torch.cuda.empty_cache()
