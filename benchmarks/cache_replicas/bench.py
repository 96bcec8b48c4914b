"""Where a replica's cache hits come from: its own memory, or the node's shared directory (issue 24, item 7).

Run from the repository root (Lightning re-launches the module for the other ranks)::

    python -m benchmarks.cache_replicas --processes 2 --write     # then --processes 4

Each process of a node keeps its own memory tier (``cache_memory`` / processes) and writes every
entry through to the node's ``cache_dir``. Lightning's distributed sampler reshuffles the training
samples over the replicas every epoch, so a replica's sample of epoch e was most often stored by
another replica in epoch e-1: its hit comes from disk. This measures the share of hits served
from memory, per epoch, for a tiny BERT (4 blocks, 3 frozen from epoch 1 on, 256 training
samples, batch 8 per replica), and writes a section of docs/cache_replicas.md with ``--write``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy

DOCS = Path("docs/cache_replicas.md")


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
                            max_position_embeddings=32, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.model = BertForSequenceClassification(config)

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        return torch.nn.functional.cross_entropy(self.model(input_ids=ids).logits, labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class HitSources(Callback):
    """Per training epoch: hits from this process's memory and from disk (the counters' differences)."""

    def __init__(self) -> None:
        self.epochs: list[dict[str, float]] = []
        self._last = (0.0, 0.0, 0.0)

    def on_train_epoch_end(self, trainer, pl_module):
        stats = trainer.strategy.cache_stats or {}
        now = (stats.get("autocache/memory_hits", 0.0), stats.get("autocache/disk_hits", 0.0), stats.get("autocache/misses", 0.0))
        memory, disk, misses = (a - b for a, b in zip(now, self._last))
        self._last = now
        self.epochs.append({"epoch": trainer.current_epoch, "memory_hits": memory, "disk_hits": disk, "misses": misses})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--out", default="outputs/cache_replicas")
    parser.add_argument("--write", action="store_true", help=f"add the table to {DOCS}")
    args = parser.parse_args()
    out = Path(args.out) / f"p{args.processes}"
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(1, 64, (args.samples, 16), generator=g), torch.randint(0, 2, (args.samples,), generator=g))
    sources = HitSources()
    strategy = PipeTransformerStrategy(process_group_backend="gloo", cache=True, cache_dir=str(out / "cache"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.processes, strategy=strategy, max_epochs=args.epochs,
        callbacks=[AutoFreeze(schedule={1: 3}), sources], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(Classifier(), DataLoader(data, batch_size=8))
    seconds = time.perf_counter() - start
    mine = out / f"rank{trainer.global_rank}.json"
    mine.write_text(json.dumps(sources.epochs))
    strategy.barrier()
    if trainer.global_rank != 0:
        return
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.processes)]
    lines = [
        f"### {args.processes} processes ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"`python -m benchmarks.cache_replicas --processes {args.processes}` on {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}; fit {seconds:.0f} s. Hits per epoch, summed over the ranks:",
        "",
        "| epoch | lookups | hits from this process's memory | hits from the shared directory | share from memory |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for e in range(args.epochs):
        memory = sum(r[e]["memory_hits"] for r in ranks)
        disk = sum(r[e]["disk_hits"] for r in ranks)
        lookups = memory + disk + sum(r[e]["misses"] for r in ranks)
        share = f"{memory / (memory + disk):.0%}" if memory + disk else "-"
        lines.append(f"| {e} | {lookups:.0f} | {memory:.0f} | {disk:.0f} | {share} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.write:
        text = DOCS.read_text() if DOCS.exists() else ""
        DOCS.write_text(_page(text, f"### {args.processes} processes", table))


def _page(text: str, marker: str, table: str) -> str:
    """The page with this process count's section replaced (or added)."""
    intro = (
        "# Where a replica's cache hits come from\n\n"
        "Generated by `benchmarks/cache_replicas/` (issue 24, item 7). See docs/cache.md for what it means.\n\n"
    )
    sections = {}
    for block in text.split("\n### ")[1:]:
        sections["### " + block.split("\n", 1)[0].split(" (")[0]] = "### " + block.rstrip("\n") + "\n"
    sections[marker] = table
    return intro + "\n".join(sections[k] for k in sorted(sections))


if __name__ == "__main__":
    main()
