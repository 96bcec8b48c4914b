"""What AutoCache's validity check costs, on the 12-layer setting's model shape (MPNet-base from its config).

The embeddings and the lower ``--frozen`` blocks are frozen (eval mode, no grad) and a
:class:`~lightning_pipetransformer.cache.watch.PrefixWatch` armed on them, as AutoCache arms it when
a store opens. Timed, each the median of ``--repeats``:

- the check before every forward the cache would serve (``changed()``, the host walk: modules,
  parameters, buffers; nothing is read from a device);
- the check at a pass start (``changed(full=True)``: the walk and a checksum of every frozen tensor's bits);
- for scale, the store's fingerprint (BLAKE2b over the same bits, once per boundary move);
- the step it is set against: a training step (forward, backward, AdamW) of the same model, batch
  32 x 64 tokens, its frozen part run under ``no_grad`` as the cache's misses are, on the same threads.

Prints a markdown table (for docs/cache.md) and one JSON line.

    python -m benchmarks.prefix_watch [--frozen 6] [--repeats 50] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers as T

from lightning_pipetransformer.cache.validity import prefix_fingerprint, prefix_modules
from lightning_pipetransformer.cache.watch import PrefixWatch
from lightning_pipetransformer.freeze.apply import apply_freeze
from lightning_pipetransformer.stack.discovery import find_block_stack

BATCH, SEQ = 32, 64


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frozen", type=int, default=6, help="frozen blocks of 12 (the embeddings with them)")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--steps", type=int, default=5, help="training steps timed (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = T.MPNetForSequenceClassification(T.MPNetConfig(num_labels=2))  # MPNet-base's shape: 12 x 768
    stack = find_block_stack(model)
    apply_freeze(stack, args.frozen, include_pre=True)
    modules = prefix_modules(stack, args.frozen, True)
    watch = PrefixWatch()
    watch.arm(modules, list(stack.pre_params))
    fingerprint = _median_seconds(lambda: prefix_fingerprint(stack, args.frozen, True), 3)
    walk = _median_seconds(lambda: watch.changed(), args.repeats)
    full = _median_seconds(lambda: watch.changed(full=True), max(3, args.repeats // 10))
    assert watch.changed(full=True) is None
    params = sum(1 for _, m in modules for _ in m.parameters())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
    labels = torch.randint(0, 2, (BATCH,))

    def step() -> None:
        optimizer.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()

    step()
    train_step = _median_seconds(step, args.steps)
    row = {
        "frozen": args.frozen, "prefix_parameters": params, "walk_ms": walk * 1e3, "full_ms": full * 1e3,
        "fingerprint_ms": fingerprint * 1e3, "step_ms": train_step * 1e3, "walk_share": walk / train_step, "threads": args.threads,
    }
    print("| frozen blocks (+ embeddings) | prefix tensors | check per served forward | check at a pass start "
          "(checksums) | the store's fingerprint | training step (32 x 64) | per-forward check / step |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.frozen} of 12 | {params} | {walk * 1e3:.2f} ms | {full * 1e3:.0f} ms | {fingerprint * 1e3:.0f} ms | "
          f"{train_step * 1e3:.0f} ms | {walk / train_step:.3%} |")
    print(json.dumps(row))
    return 0
