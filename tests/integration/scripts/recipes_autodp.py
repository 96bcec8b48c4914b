"""A recipe under AutoDP on 2 CPU processes (gloo); run by tests/integration/distributed/test_recipes_autodp.py.

Lightning re-launches this script once per extra rank. A tiny Llama with PEFT LoRA adapters on
every layer and reentrant gradient checkpointing (``enable_input_require_grads``: the embeddings'
output is marked as requiring grad), pipe length 2 and ``frozen_cost=0``: epoch 0 runs one replica
of 2 stages (rank 1 idle), the freeze {1: 3} compresses K to 1 and rank 1 joins. ``--cache 1``
serves the frozen prefix from a cache directory the two ranks share. Each rank writes its final
weights, its plan per epoch and its cache counters to ``--out``.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for tests.helpers

import lightning.pytorch as pl
import peft
import torch
from lightning.pytorch.callbacks import Callback

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from tests.helpers.families import FamilyModule, family_data
from tests.helpers.launch import fit_recording_errors


class Record(Callback):
    def __init__(self) -> None:
        self.epochs: dict[int, dict] = {}

    def on_train_epoch_start(self, trainer, pl_module):
        plan = trainer.strategy.plan
        self.epochs[trainer.current_epoch] = {"num_frozen": plan.num_frozen, "pipe_len": plan.pipe_len, "replicas": plan.num_replicas}

    def on_train_epoch_end(self, trainer, pl_module):
        self.epochs[trainer.current_epoch]["cache"] = trainer.strategy.cache_stats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cache", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    out = Path(args.out)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.set_num_threads(1)

    module = FamilyModule("llama")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    module.model = peft.get_peft_model(module.model, config)
    with torch.no_grad():  # LoRA's B starts at zero: non-zero, every adapter's gradient shows
        for name, p in module.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    module.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    record = Record()
    strategy = PipeTransformerStrategy(
        pipe_len=2, frozen_cost=0.0, process_group_backend="gloo", timeout=args.timeout, batch_policy="global",
        cache=bool(args.cache), cache_dir=str(out / "cache"), cache_memory=10**8,
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=3, callbacks=[AutoFreeze(schedule={1: 3}), record],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    data = family_data("llama", n=24)
    # Every sample padded: Lightning's distributed sampler reshuffles the training data each epoch, and a
    # batch without padding gets no attention mask from Llama (sdpa), hence other keys for its samples.
    data.dataset.tensors[1][:, -1] = 0
    fit_recording_errors(trainer, module, data, None, out / f"error{rank}")
    torch.save({"state": module.state_dict(), "epochs": record.epochs}, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
