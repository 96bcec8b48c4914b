"""AutoFreeze's paper rule every 2 epochs under AutoDP on 4 CPU processes; run by tests/integration/distributed/test_autodp_paths.py.

The gradient norms the rule reads are shaped per epoch (``on_after_backward``) so that rank 0's
decision is known: at epoch 2 it freezes 2 of 4 blocks (K 4 -> 2, rank 2 joins). Before the fix,
ranks 1-3 decided from rank 0's half-finished norm sums (received with every epoch's plan) and
froze 3, so a joining replica's DDP buckets did not match rank 0's. Each rank writes, per epoch
start, the plan's frozen count, the blocks it actually froze and its trainable parameter count.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for tests.helpers

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from tests.helpers.models import TextClassifier, text_dataset

#: epoch -> {block: gradient scale}: epoch 0 makes blocks 0-2 look converged, epoch 1 block 1.
SCALES = {0: {0: 0.1, 1: 0.1, 2: 0.01}, 1: {1: 1e-4}}


class Shaped(TextClassifier):
    def on_after_backward(self):
        layers = self.model.bert.encoder.layer
        for index, scale in SCALES.get(self.current_epoch, {}).items():
            for p in layers[index].parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)


class Record(Callback):
    def __init__(self) -> None:
        self.epochs: dict[int, dict] = {}

    def on_train_epoch_start(self, trainer, pl_module):
        layers = pl_module.model.bert.encoder.layer
        self.epochs[trainer.current_epoch] = {
            "active": trainer.strategy.is_active,
            "plan_frozen": trainer.strategy.plan.num_frozen,
            # By index: iterating the container yields the installed pipeline.
            "frozen_blocks": sum(not any(p.requires_grad for p in layers[i].parameters()) for i in range(len(layers))),
            "trainable": sum(p.requires_grad for p in pl_module.parameters()),
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    torch.set_num_threads(1)
    record = Record()
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, max_epochs=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        strategy=PipeTransformerStrategy(pipe_len=4, frozen_cost=0.0, process_group_backend="gloo", timeout=60),
        callbacks=[AutoFreeze(rule="paper", alpha=0.75, freeze_every_n_epochs=2), record],
    )
    module = Shaped(num_layers=4)
    trainer.fit(module, DataLoader(text_dataset(32), batch_size=8), DataLoader(text_dataset(8, seed=1), batch_size=4))
    torch.save({"epochs": record.epochs, "state": module.state_dict()}, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
