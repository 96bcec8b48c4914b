"""Two CPU processes (gloo) under Lightning's DDPStrategy with AutoFreeze; run by tests/integration/distributed/test_autofreeze_ddp.py.

Lightning re-launches this script once per extra rank. Each rank saves its final weights and,
per optimizer step, how many gradient elements DDP all-reduced, into ``--out``.
"""

import argparse
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for tests.helpers

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pipetransformer import AutoFreeze
from tests.helpers.models import TextClassifier, text_dataset

SCHEDULE = {1: 1, 2: 3}


class CountAllReduced(Callback):
    """Counts gradient elements each DDP wrapper all-reduces (the wrapper is rebuilt after a freeze)."""

    def __init__(self):
        self.per_epoch: dict[int, int] = {}
        self._wrapper = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        ddp = trainer.strategy.model
        if ddp is not self._wrapper:
            self._wrapper = ddp
            epoch = trainer.current_epoch

            def hook(state, bucket):
                self.per_epoch[epoch] = self.per_epoch.get(epoch, 0) + bucket.buffer().numel()
                return default_hooks.allreduce_hook(state, bucket)

            ddp.register_comm_hook(None, hook)


class InOrder(TextClassifier):
    """Each rank reads its DistributedSampler share in order (Lightning's own sampler would shuffle).

    The classifier head is registered before the backbone (as transformers 5.x XLMRobertaFor...
    does): what freezes with the first block must be what runs before it, the embeddings, on every
    rank, while the head keeps training.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        modules = self.model._modules
        self.model._modules = type(modules)([("classifier", modules.pop("classifier")), *modules.items()])

    def train_dataloader(self):
        data = text_dataset(32)
        sampler = DistributedSampler(data, num_replicas=2, rank=self.global_rank, shuffle=False)
        return DataLoader(data, batch_size=4, sampler=sampler)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    counter = CountAllReduced()
    module = InOrder(num_layers=4)
    assert list(module.model._modules)[0] == "classifier"
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=120)),
        max_epochs=3, callbacks=[AutoFreeze(schedule=SCHEDULE), counter], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    # 32 samples, 4 per rank per step: rank 0 sees 0,2,4,6 and rank 1 sees 1,3,5,7 in step 0.
    trainer.fit(module)
    trainable = {
        epoch: sum(p.numel() for n, p in module.named_parameters() if not _frozen(n, frozen))
        for epoch, frozen in enumerate([0, 1, 3])
    }
    torch.save(
        {"state": module.state_dict(), "all_reduced": counter.per_epoch, "trainable": trainable},
        out / f"rank{trainer.global_rank}.pt",
    )


def _frozen(name: str, num_frozen: int) -> bool:
    if num_frozen and name.startswith("model.bert.embeddings."):
        return True
    return any(name.startswith(f"model.bert.encoder.layer.{i}.") for i in range(num_frozen))


if __name__ == "__main__":
    main()
