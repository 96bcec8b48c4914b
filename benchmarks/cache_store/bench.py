"""AutoCache on CPU: lookup + gather of a batch from memory and from disk, against recomputing the prefix.

MiniLM-shaped activations (64 tokens x 384 fp32 = 96 KiB per sample), batch 32. Times, per
batch: the content keys of the batch (token ids + masks), a lookup that gathers 32 hits from host
memory, the same from disk (files just written, so from the page cache: a cold read adds the
disk's own time; every file read is checked against its CRC-32), the checksum alone with the
candidate stdlib hashes (what a disk lookup pays for integrity, and why CRC-32), storing a batch
(memory / disk; the finite check and, on disk, the checksums included), and the no-grad forward
of the embeddings plus k BERT layers (hidden 384, 12 heads, FFN 1536) that a hit replaces. Variants are
interleaved round by round so a change in machine load hits all of them alike; medians shown.

    python -m benchmarks.cache_store                 # print the table
    python -m benchmarks.cache_store --write-docs    # and put it into docs/cache.md
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import BertConfig, BertModel

from lightning_pipetransformer.cache.entry_file import checksum
from lightning_pipetransformer.cache.keys import content_keys
from lightning_pipetransformer.cache.store import ActivationStore

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cache.md"
BEGIN, END = "<!-- cache_store:begin -->", "<!-- cache_store:end -->"
FP = "0" * 32


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cache_store", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batches", type=int, default=8, help="batches held by each store")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--write-docs", action="store_true")
    return p.parse_args()


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    args = parse()
    load = os.getloadavg()  # other work on the machine slows every row alike (rounds interleave variants)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    model = BertModel(config).eval()
    b, s = args.batch, args.seq
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[::2, s * 3 // 4 :] = 0  # half the rows padded, as in a real batch
    types = torch.zeros_like(ids)

    captured: dict[str, object] = {}

    def grab(_m, a, kw):  # the block arguments the encoder passes (the sdpa mask)
        captured["args"], captured["kwargs"] = a[1:], kw

    hook = model.encoder.layer[0].register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, token_type_ids=types)
    hook.remove()
    block_args, block_kwargs = captured["args"], captured["kwargs"]

    def prefix(k: int) -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                h = model.embeddings(input_ids=ids, token_type_ids=types)
                for layer in model.encoder.layer[:k]:
                    h = layer(h, *block_args, **block_kwargs)
            return h

        return run

    per_sample = s * config.hidden_size * 4
    tmp = tempfile.mkdtemp(prefix="cache-bench-")
    mem = ActivationStore(tmp, FP, 1, memory_budget=args.batches * b * per_sample)
    disk = ActivationStore(tmp, FP, 2, memory_budget=0)
    half = ActivationStore(tmp, FP, 3, memory_budget=args.batches * b * per_sample, storage_dtype=torch.bfloat16)
    batches = []
    for i in range(args.batches):
        keys = [f"b{i}-{j}" for j in range(b)]
        acts = torch.randn(b, s, config.hidden_size)
        batches.append((keys, acts))
        for store in (mem, disk, half):
            store.store(keys, acts)

    fresh = iter(range(10**9))

    def store_new(store: ActivationStore) -> Callable[[], object]:
        acts = batches[0][1]

        def run() -> object:
            n = next(fresh)
            keys = [f"new{n}-{j}" for j in range(b)]
            store.store(keys, acts)
            return keys

        return run

    mem_writes = ActivationStore(tmp, FP, 4, memory_budget=(args.rounds + 1) * b * per_sample)
    disk_writes = ActivationStore(tmp, FP, 5, memory_budget=0)
    pick = lambda r: batches[r % len(batches)][0]  # noqa: E731
    rows = lambda r: list(batches[r % len(batches)][1])  # noqa: E731  (one sample's activation each)

    def hash_all(fn: Callable[[memoryview], object]) -> Callable[[int], object]:
        return lambda r: [fn(row.view(torch.uint8).reshape(-1).numpy()) for row in rows(r)]

    variants: dict[str, Callable[[int], object]] = {
        "content keys of the batch (ids, mask, types)": lambda r: content_keys(
            {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        ),
        "lookup + gather, memory": lambda r: mem.lookup(pick(r)),
        "lookup + gather, memory, bf16 storage": lambda r: half.lookup(pick(r)),
        "lookup + gather, disk (page cache, CRC-32 checked)": lambda r: disk.lookup(pick(r)),
        "CRC-32 of the batch's activations (what that check costs)": lambda r: [checksum(row) for row in rows(r)],
        "  for comparison: Adler-32": hash_all(zlib.adler32),
        "  for comparison: BLAKE2b-64": hash_all(lambda b: hashlib.blake2b(b, digest_size=8).digest()),
        "store a batch, memory": lambda r: store_new(mem_writes)(),
        "store a batch, disk": lambda r: store_new(disk_writes)(),
    }
    for k in (0, 1, 2, 4, 6):
        variants[f"recompute: embeddings + {k} layer(s)"] = lambda r, k=k: prefix(k)()
    for name, fn in variants.items():  # warm-up
        fn(0)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, fn in variants.items():
            times[name].append(timed(lambda: fn(r)))
    # Sanity: what comes back is what went in.
    assert torch.equal(disk.lookup(batches[1][0])[1], batches[1][1])

    medians = {name: statistics.median(t) for name, t in times.items()}
    one_layer = medians["recompute: embeddings + 1 layer(s)"] - medians["recompute: embeddings + 0 layer(s)"]
    lines = [
        f"| operation (batch {b} x {s} tokens, {per_sample // 1024} KiB/sample) | ms per batch | x one layer's forward |",
        "|---|---:|---:|",
    ]
    for name, ms in medians.items():
        lines.append(f"| {name} | {ms:.1f} | {ms / one_layer:.2f} |")
    stats = disk.stats()
    lines.append("")
    lines.append(
        f"One layer's no-grad forward ~{one_layer:.0f} ms per batch; disk store: {stats.files_on_disk} files, "
        f"{stats.bytes_on_disk / 2**20:.1f} MiB ({stats.bytes_on_disk / max(stats.files_on_disk, 1) / 1024:.1f} KiB per file)."
    )
    crc = medians["CRC-32 of the batch's activations (what that check costs)"]
    disk_lookup = medians["lookup + gather, disk (page cache, CRC-32 checked)"]
    lines.append(
        f"Integrity check per lookup from disk: {crc / b * 1e3:.0f} us per sample ({crc:.1f} ms per batch), "
        f"{crc / disk_lookup:.0%} of the disk lookup it is part of; memory hits are not checked."
    )
    table = "\n".join(lines)
    header = (
        f"Measured {datetime.date.today().isoformat()} on {platform.machine()} {platform.processor() or platform.platform()}, "
        f"{os.cpu_count()} CPU core(s) visible, {args.threads} torch thread(s), torch {torch.__version__}, "
        f"{args.rounds} rounds (medians), shared machine (load average {load[0]:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end). Command: `python -m benchmarks.cache_store"
        f"{' --write-docs' if args.write_docs else ''}`."
    )
    print(header)
    print()
    print(table)
    for store in (mem, disk, half, mem_writes, disk_writes):
        store.close(delete=True)
    if args.write_docs:
        text = DOCS.read_text()
        block = f"{BEGIN}\n{header}\n\n{table}\n{END}"
        if BEGIN not in text:
            sys.exit(f"{DOCS} has no {BEGIN} marker")
        DOCS.write_text(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _m: block, text, flags=re.S))
        print(f"\nwrote {DOCS}")
