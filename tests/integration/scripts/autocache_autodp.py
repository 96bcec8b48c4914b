"""AutoCache under AutoDP on 4 CPU processes (gloo); run by tests/integration/distributed/test_autocache_autodp.py.

Lightning re-launches this script once per extra rank (same arguments). Tiny BERT with 4 blocks,
``frozen_cost=0`` and the schedule {1: 2, 2: 3} make the planner compress K 4 -> 2 -> 1, so the
active replicas grow 1 -> 2 -> 4 while the frozen boundary moves 0 -> 2 -> 3. ``--cache 1`` turns
AutoCache on with a cache directory shared by the four processes. Each rank writes, per epoch,
its plan, whether it was active and its ``strategy.cache_stats`` at the end of the epoch (after
validation), and its final weights to ``--out``. Samples are dicts with their dataset index,
so ``--key index`` (``cache_key="index"``) runs on the same data as ``--key content``.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for tests.helpers

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from tests.helpers.launch import fit_recording_errors
from tests.helpers.models import IndexedDataset, TextClassifier, text_dataset

SCHEDULE = {1: 2, 2: 3}
NUM_SAMPLES = 32


class Record(Callback):
    """Per epoch: plan, activity, and AutoCache's counters at the epoch's end (validation included)."""

    def __init__(self) -> None:
        self.epochs: dict[int, dict] = {}

    def on_train_epoch_start(self, trainer, pl_module):
        plan = trainer.strategy.plan
        self.epochs[trainer.current_epoch] = {
            "pipe_len": plan.pipe_len, "replicas": plan.num_replicas, "active": trainer.strategy.is_active,
            "num_frozen": plan.num_frozen, "block2_start": _block2_sum(pl_module),
        }

    def on_train_epoch_end(self, trainer, pl_module):
        strategy = trainer.strategy
        record = self.epochs[trainer.current_epoch]
        record["cache"] = strategy.cache_stats
        record["block2_end"] = _block2_sum(pl_module)
        record["val_loss"] = float(trainer.callback_metrics["val_loss"])
        cache = getattr(strategy, "autocache", None)
        store = cache.store if cache is not None else None
        record["cache_directory"] = store.directory.name if store is not None else None
        record["memory_budget"] = cache.memory_budget if cache is not None else None


def _block2_sum(pl_module) -> float:
    return float(sum(p.detach().double().sum() for p in pl_module.model.bert.encoder.layer[2].parameters()))


class UnfreezeBlock2(Callback):
    """At the start of ``epoch``: block 2 (frozen at epoch 2) trains again, as a user's callback would unfreeze it."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            pl_module.model.bert.encoder.layer[2].requires_grad_(True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cache", type=int, default=1)
    parser.add_argument("--key", choices=("content", "index"), default="content")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--unfreeze-at", type=int, default=None, help="epoch whose start unfreezes block 2")
    args = parser.parse_args()
    out = Path(args.out)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.set_num_threads(1)  # 4 processes on a small machine: no OpenMP contention

    record = Record()
    module = TextClassifier(num_layers=4)
    strategy = PipeTransformerStrategy(
        pipe_len=4, frozen_cost=0.0, process_group_backend="gloo", timeout=args.timeout,
        cache=bool(args.cache), cache_key=args.key, cache_dir=str(out / "cache"),
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_epochs=args.epochs,
        callbacks=[AutoFreeze(schedule=SCHEDULE), *([UnfreezeBlock2(args.unfreeze_at)] if args.unfreeze_at else []), record],
        logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    train = DataLoader(IndexedDataset(text_dataset(NUM_SAMPLES)), batch_size=8, shuffle=False)
    val = DataLoader(IndexedDataset(text_dataset(16, seed=1)), batch_size=4, shuffle=False)
    fit_recording_errors(trainer, module, train, val, out / f"error{rank}")
    torch.save(
        {"state": module.state_dict(), "epochs": record.epochs},
        out / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
