"""Step time of a MiniLM-L6-shaped BERT on this machine with 0..L-1 leading blocks frozen.

Measures what AutoFreeze saves per optimizer step without a cache: a frozen block still runs
forward (under no_grad when nothing before it trains) but has no backward and no optimizer
update. The model is built from a config shaped like all-MiniLM-L6-v2 (6 layers, hidden 384,
12 heads, FFN 1536); weights do not matter for timing.

    python -m benchmarks.freeze_step_time [--repeats 5] [--write docs/autofreeze.md]

Variants are interleaved round by round and medians reported, because machines here are noisy.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch
from transformers import BertConfig, BertForSequenceClassification

from lightning_pipetransformer.freeze.apply import apply_freeze
from lightning_pipetransformer.stack.discovery import find_block_stack


def build(seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
        intermediate_size=1536, num_labels=2, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
    )
    return BertForSequenceClassification(config).train()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.freeze_step_time", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--frozen", default="0,2,4,5")
    parser.add_argument("--write", default=None, help="markdown file whose benchmark section is replaced")
    args = parser.parse_args()
    frozen_counts = [int(f) for f in args.frozen.split(",")]
    ids = torch.randint(0, 30522, (args.batch, args.seq))
    labels = torch.randint(0, 2, (args.batch,))
    setups = {}
    for f in frozen_counts:
        model = build()
        apply_freeze(find_block_stack(model), f, include_pre=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5, fused=True)
        setups[f] = (model, optimizer)

    def step(f: int) -> float:
        model, optimizer = setups[f]
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(input_ids=ids).logits, labels)
        loss.backward()
        optimizer.step()
        return time.perf_counter() - start

    for f in frozen_counts:  # warm-up
        step(f)
    times = {f: [] for f in frozen_counts}
    for _ in range(args.repeats):
        for f in frozen_counts:
            times[f].append(step(f))
    base = statistics.median(times[frozen_counts[0]])
    lines = [
        f"| frozen blocks (of 6) + embeddings | median step (ms) | speed-up vs {frozen_counts[0]} frozen |",
        "| --- | --- | --- |",
    ]
    for f in frozen_counts:
        med = statistics.median(times[f])
        lines.append(f"| {f} | {med * 1000:.0f} | {base / med:.2f}x |")
    table = "\n".join(lines)
    header = (
        f"Measured {datetime.date.today()} on {platform.machine()} with {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}; batch {args.batch} x {args.seq} tokens, AdamW (fused), "
        f"{args.repeats} interleaved rounds, medians. Command: `python -m benchmarks.freeze_step_time`."
    )
    print(header)
    print(table)
    if args.write:
        path = args.write
        text = open(path).read()
        start, end = "<!-- freeze-step-time:start -->", "<!-- freeze-step-time:end -->"
        before, rest = text.split(start)
        _, after = rest.split(end)
        open(path, "w").write(f"{before}{start}\n{header}\n\n{table}\n{end}{after}")
