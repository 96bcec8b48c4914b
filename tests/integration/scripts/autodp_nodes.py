"""AutoDP over 2 simulated nodes of 2 CPU processes each (gloo); run by tests/integration/distributed/test_autodp_nodes.py.

The test starts this script twice on localhost, with ``NODE_RANK=0`` and ``NODE_RANK=1`` and the
same ``MASTER_ADDR``/``MASTER_PORT``; on each "node" Lightning's subprocess launcher starts local
rank 1 itself (same arguments). Tiny BERT with 4 blocks, ``pipe_len=2``, ``frozen_cost=0`` and the
schedule {1: 2, 2: 3} make the planner compress K 2 -> 1, so the replicas grow 2 (one per node)
-> 4. Each rank writes what it saw (plan, its own activity and replica index, the dataset
positions of its batches) and its final state to ``--out/rank{global_rank}.pt``.

Which ranks are active is read from the strategy (``plan.active_ranks``, ``is_active``,
``plan.replica_index``), never assumed here: the test checks it for consistency.
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
from lightning_pipetransformer.dp.idle import is_idle_batch
from tests.helpers.launch import fit_recording_errors
from tests.helpers.models import TextClassifier, text_dataset
from tests.integration.scripts.autodp import final_record

SCHEDULE = {1: 2, 2: 3}
NUM_SAMPLES = 32


class Record(Callback):
    """Per epoch: the plan, this rank's activity and replica index, the dataset positions of its batches."""

    def __init__(self, dataset) -> None:
        self.epochs: dict[int, dict] = {}
        # Row -> dataset position (the rows are random token ids: unique, checked below).
        self.position = {tuple(ids.tolist()): i for i, ids in enumerate(dataset.tensors[0])}
        assert len(self.position) == len(dataset)

    def on_train_epoch_start(self, trainer, pl_module):
        strategy = trainer.strategy
        plan = strategy.plan
        active = strategy.is_active
        self.epochs[trainer.current_epoch] = {
            "pipe_len": plan.pipe_len, "replicas": plan.num_replicas, "num_frozen": plan.num_frozen,
            "partition": list(plan.partition), "active_ranks": list(plan.active_ranks), "active": active,
            "replica_index": plan.replica_index(trainer.global_rank) if active else None,
            "stage_devices": [str(d) for d in strategy.stage_devices],
            "sampler": dict(strategy.distributed_sampler_kwargs),
            "ddp_group_size": (
                torch.distributed.get_world_size(strategy.gradient_group)
                if strategy.gradient_group is not None else None
            ),
            "batches": [], "idle_batches": 0,
        }

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        record = self.epochs[trainer.current_epoch]
        if is_idle_batch(batch):
            record["idle_batches"] += 1
        else:
            record["batches"].append([self.position[tuple(ids.tolist())] for ids in batch[0]])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--policy", default="global")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    out = Path(args.out)
    node, local = int(os.environ.get("NODE_RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    (out / f"pid{node}_{local}").write_text(str(os.getpid()))

    dataset = text_dataset(NUM_SAMPLES)
    record = Record(dataset)
    module = TextClassifier(num_layers=4)
    strategy = PipeTransformerStrategy(
        pipe_len=2, frozen_cost=0.0, process_group_backend="gloo", timeout=args.timeout, batch_policy=args.policy
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, max_epochs=3,
        callbacks=[AutoFreeze(schedule=SCHEDULE), record], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
        default_root_dir=str(out),
    )
    train = DataLoader(dataset, batch_size=args.batch_size, shuffle=False)
    val = DataLoader(text_dataset(16, seed=1), batch_size=4, shuffle=False)
    fit_recording_errors(trainer, module, train, val, out / f"error{node}_{local}")
    torch.save(
        {
            **final_record(trainer, module, record),
            "node_rank": trainer.node_rank, "local_rank": trainer.local_rank, "global_rank": trainer.global_rank,
            "world_size": trainer.world_size, "env_node_rank": node, "env_local_rank": local,
        },
        out / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
