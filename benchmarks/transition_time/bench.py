"""Time one AutoDP transition (1 -> 4 replicas) of a BERT-base-sized model on 4 CPU processes.

Run from the repository root (Lightning re-launches the module for ranks 1..3, ``python -m`` included)::

    MASTER_PORT=29700 python -m benchmarks.transition_time --out docs/transition_time.json

``--pipe-len 2`` starts with two replicas (ranks 0 and 2) instead, so that only ranks 1 and 3
join: replicas that were already active receive no parameters or optimizer state.

Epoch 0 trains with pipe length 4 (rank 0 is the only replica, ranks 1..3 idle); at the start of
epoch 1 AutoFreeze freezes 9 of 12 blocks, the planner (``frozen_cost=0``) compresses to K = 1,
and ranks 1..3 become replicas: plan broadcast, pipeline rebuild, new gloo group, model +
optimizer + scheduler state from rank 0, DDP rebuild, train-loader rebuild. Each rank records
:attr:`PipeTransformerStrategy.last_transition` (seconds per phase); rank 0 writes them all
(JSON) and prints a Markdown table.
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
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy

PHASES = ("plan_broadcast", "partition", "new_group", "model_state", "optimizer_state", "ddp_rebuild", "loader_rebuild")


class BertBase(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = BertConfig(num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # BERT-base sizes
        self.model = BertForSequenceClassification(config)

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        return nn.functional.cross_entropy(self.model(input_ids=ids).logits, labels)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)]


class Collect(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            record = {"rank": trainer.global_rank, "phases": trainer.strategy.last_transition}
            (self.out.parent / f".transition_rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.transition_time")
    parser.add_argument("--out", default="transition_time.json")
    parser.add_argument(
        "--pipe-len", type=int, default=4, choices=[2, 4],
        help="pipe length in epoch 0: 4 (1 replica, ranks 1-3 join) or 2 (replicas 0 and 2, ranks 1 and 3 join)",
    )
    args = parser.parse_args()
    load_before = os.getloadavg()
    out = Path(args.out).resolve()
    module = BertBase()
    params = sum(p.numel() for p in module.parameters())
    data = TensorDataset(torch.randint(0, 30522, (16, 16)), torch.randint(0, 2, (16,)))
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, max_epochs=2, limit_train_batches=2,
        strategy=PipeTransformerStrategy(pipe_len=args.pipe_len, frozen_cost=0.0, process_group_backend="gloo", timeout=600),
        callbacks=[AutoFreeze(schedule={1: 9}), Collect(out)], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(module, DataLoader(data, batch_size=2))
    if trainer.global_rank != 0:
        return
    ranks = [json.loads((out.parent / f".transition_rank{r}.json").read_text()) for r in range(4)]
    for r in range(4):
        (out.parent / f".transition_rank{r}.json").unlink()
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "command": f"MASTER_PORT={os.environ.get('MASTER_PORT', '')} python -m benchmarks.transition_time --out {args.out}"
        + (f" --pipe-len {args.pipe_len}" if args.pipe_len != 4 else ""),
        "model": f"BertForSequenceClassification (BERT-base config), {params / 1e6:.1f}M parameters, SGD momentum + StepLR",
        "transition": f"pipe length {args.pipe_len} -> 1, replicas {4 // args.pipe_len} -> 4 "
        f"({4 - 4 // args.pipe_len} ranks receive state)",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), torch {torch.__version__}",
        "fit_seconds": time.perf_counter() - start,
        "load_average_1_5_15": {"start": list(load_before), "end": list(os.getloadavg())},
        "ranks": ranks,
    }
    out.write_text(json.dumps(result, indent=2))
    print(table(result))


def table(result: dict) -> str:
    lines = ["| phase | " + " | ".join(f"rank {r['rank']}" for r in result["ranks"]) + " |"]
    lines.append("|---" * (len(result["ranks"]) + 1) + "|")
    for phase in PHASES:
        lines.append(f"| {phase} | " + " | ".join(f"{r['phases'].get(phase, 0.0):.2f}" for r in result["ranks"]) + " |")
    lines.append("| **total** | " + " | ".join(f"**{sum(r['phases'].values()):.2f}**" for r in result["ranks"]) + " |")
    return "\n".join(lines)
