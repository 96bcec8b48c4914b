"""The pipeline executor's overhead on CPU, against the plain loop over a BERT-shaped stack.

Times one forward + backward of a stack of Hugging Face ``BertLayer`` blocks, run four ways:
the plain loop ``for layer in layers: hidden = layer(hidden, mask)``, the executor with one stage
and one micro-batch (target: within 3% of the loop), and two and four stages with four
micro-batches, all on the CPU. A CPU has no streams, so the stages do not overlap: those rows
show what micro-batching alone costs (smaller matmuls, more Python), not a pipeline speed-up.

Variants are interleaved round by round so drift in machine load hits all of them alike; the
table reports medians and, per variant, the median of the per-round ratios to the plain loop.

    python -m benchmarks.executor_overhead                 # print the table
    python -m benchmarks.executor_overhead --write-docs    # and put it into docs/executor.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertLayer

from lightning_pipetransformer.pipe.partition import optimal_partition
from lightning_pipetransformer.pipe.pipeline import Pipeline

DOCS = Path(__file__).resolve().parents[2] / "docs" / "executor.md"
BEGIN, END = "<!-- executor_overhead:begin -->", "<!-- executor_overhead:end -->"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.executor_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=30, help="timed rounds (each runs every variant once)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    p.add_argument("--write-docs", action="store_true", help=f"replace the table in {DOCS.name}")
    return p.parse_args()


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    config._attn_implementation = "sdpa"  # what BertModel picks by default on CPU
    layers = [BertLayer(config, layer_idx=i) for i in range(args.layers)]
    params = [p for layer in layers for p in layer.parameters()]
    hidden = torch.randn(args.batch, args.seq, args.hidden)
    # A padding mask in the additive 4D form the encoder passes its layers: batch-shaped, so split.
    mask = torch.zeros(args.batch, 1, 1, args.seq)
    mask[: args.batch // 2, ..., -args.seq // 4 :] = torch.finfo(torch.float32).min

    def plain(h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            h = layer(h, m)
        return h

    def pipe(stages: int, chunks: int) -> Pipeline:
        balance = optimal_partition([1.0] * args.layers, stages)
        return Pipeline(layers, balance, ["cpu"] * stages, chunks)

    variants: dict[str, Callable[..., torch.Tensor]] = {
        "plain loop": plain,
        "K=1, M=1": pipe(1, 1),
        "K=2, M=4": pipe(2, 4),
        "K=4, M=4": pipe(4, 4),
    }

    def step(fn: Callable[..., torch.Tensor]) -> float:
        for p in params:
            p.grad = None
        start = time.perf_counter()
        fn(hidden, mask).sum().backward()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.warmup + args.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate who goes first
        for name in order:
            t = step(variants[name])
            if r >= args.warmup:
                times[name].append(t)

    base = times["plain loop"]
    rows = [
        "| variant | median fwd+bwd (ms) | median / plain median | median of per-round ratios | IQR (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=4)
        ratios = [t / b for t, b in zip(ts, base)]
        rows.append(
            f"| {name} | {1000 * statistics.median(ts):.1f} | {statistics.median(ts) / statistics.median(base):.3f} "
            f"| {statistics.median(ratios):.3f} | {1000 * q[0]:.1f} - {1000 * q[2]:.1f} |"
        )
    command = "python -m benchmarks.executor_overhead " + " ".join(sys.argv[1:])
    header = (
        f"{datetime.date.today().isoformat()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}, {os.cpu_count()} CPU cores, {args.threads} torch thread(s); "
        f"{args.layers} x BertLayer (hidden {args.hidden}, {args.heads} heads, FFN {4 * args.hidden}), "
        f"batch {args.batch} x seq {args.seq}, {args.repeats} interleaved rounds after {args.warmup} warm-up.\n"
        f"Reproduce: `{command.strip()}`"
    )
    table = header + "\n\n" + "\n".join(rows)
    print(table)
    if args.write_docs:
        text = DOCS.read_text()
        block = f"{BEGIN}\n{table}\n{END}"
        if BEGIN not in text:
            raise SystemExit(f"{DOCS} has no {BEGIN} marker to replace.")
        DOCS.write_text(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S))
        print(f"wrote {DOCS}")
