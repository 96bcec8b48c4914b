"""AutoDP with Trainer options the other multi-process scripts leave at their defaults; run by tests/integration/distributed/test_autodp_paths.py.

Lightning re-launches this script once per extra rank (same arguments). Tiny BERT with 4 blocks,
``pipe_len=4``, ``frozen_cost=0`` and the schedule {1: 2, 2: 3}: K 4 -> 2 -> 1, replicas 1 -> 2 -> 4.
Options: batch policy, dataset size (not a multiple of the replicas or of the batch), the
loader's ``drop_last``, ``precision``, ``accumulate_grad_batches``, ``gradient_clip_val``, an LR
scheduler stepping every optimizer step, ``chunks``, ``val_check_interval``, ``limit_train_batches``,
``max_steps``, ``cache``, ``last.ckpt`` and resuming from ``--ckpt``. Each rank writes
its per-epoch plan and batch sizes, its optimizer steps and LRs, and its final state to ``--out``.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for tests.helpers

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from tests.helpers.launch import fit_recording_errors
from tests.helpers.models import TextClassifier, text_dataset
from tests.integration.scripts.autodp import Record as EpochRecord

SCHEDULE = {1: 2, 2: 3}
GAMMA = 0.9  # StepLR(step_size=1) per optimizer step


class StepScheduled(TextClassifier):
    def __init__(self, scheduler: bool) -> None:
        super().__init__(num_layers=4)
        self.scheduler = scheduler

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        if not self.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Record(EpochRecord):
    """autodp.py's per-epoch record (plan, activity, batch sizes), plus the validations that ran."""

    def __init__(self) -> None:
        super().__init__()
        self.validations = 0

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.validations += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--policy", default="global")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--drop-last", type=int, default=0)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--scheduler", type=int, default=0)
    parser.add_argument("--chunks", default="1")
    parser.add_argument("--pipe-len", type=int, default=4)
    parser.add_argument("--val-check-interval", default=None)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--limit-train", default=None)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--cache", type=int, default=0)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--save-last", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    out = Path(args.out)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.set_num_threads(1)  # 4 processes on a small machine: no OpenMP contention

    record = Record()
    callbacks = [AutoFreeze(schedule=SCHEDULE), record]
    if args.save_last:
        callbacks.append(ModelCheckpoint(dirpath=out / "ckpt", save_last=True, save_top_k=0))
    vci = args.val_check_interval
    vci = None if vci is None else (float(vci) if "." in vci else int(vci))
    module = StepScheduled(scheduler=bool(args.scheduler))
    strategy = PipeTransformerStrategy(
        pipe_len=args.pipe_len, chunks=args.chunks if args.chunks == "auto" else int(args.chunks), frozen_cost=0.0,
        process_group_backend="gloo", timeout=args.timeout, batch_policy=args.policy,
        cache=bool(args.cache), cache_dir=str(out / "cache"),
    )
    limit = args.limit_train
    limit = None if limit is None else (float(limit) if "." in limit else int(limit))
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_epochs=args.epochs, precision=args.precision,
        accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip, val_check_interval=vci,
        callbacks=callbacks, logger=False, enable_checkpointing=bool(args.save_last), enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_train_batches=limit, max_steps=args.max_steps,
    )
    train = DataLoader(text_dataset(args.num_samples), batch_size=args.batch_size, shuffle=False, drop_last=bool(args.drop_last))
    val = DataLoader(text_dataset(8, seed=1), batch_size=4, shuffle=False)
    fit_recording_errors(trainer, module, train, val, out / f"error{rank}", ckpt_path=args.ckpt)
    optimizer = trainer.strategy.optimizers[0]
    torch.save(
        {
            "state": module.state_dict(), "epochs": record.epochs, "global_step": trainer.global_step,
            "lr": optimizer.param_groups[0]["lr"], "validations": record.validations,
            "scheduler": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "momentum": {n: optimizer.state[p]["momentum_buffer"] for n, p in module.named_parameters()
                         if p in optimizer.state and p.requires_grad},
        },
        out / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
