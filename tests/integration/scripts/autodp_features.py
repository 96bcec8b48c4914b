"""Lightning's features with idle ranks, in one 4-process CPU run; run by tests/integration/distributed/test_autodp_features.py.

Lightning re-launches this script once per extra rank. Tiny BERT with 4 blocks, pipe length 4,
``frozen_cost=0`` and the schedule {1: 2, 2: 3}: epoch 0 has one replica (ranks 1-3 idle),
epoch 1 two (two ranks idle). EarlyStopping stops the run at the end of epoch 1, while ranks are
idle, on a metric only the replicas compute. Then ``validate``, ``test`` and ``predict`` run with
the same idle ranks. Each rank writes what it saw to ``--out/rank{r}.pt``.

Features in the run: ModelCheckpoint (top-k on a monitored metric, save_last, one checking at
train-epoch end and one at validation end), two EarlyStopping callbacks (train-epoch end and
validation end), LearningRateMonitor with a StepLR scheduler, ``self.log(sync_dist=True)`` in
steps and epoch ends, torchmetrics Accuracy, validation every epoch, CSV and TensorBoard
loggers, the progress bar, ``trainer.validate/test/predict`` after fit.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for tests.helpers

import lightning.pytorch as pl
import torch
import torchmetrics
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from tests.helpers.models import NUM_LABELS, TextClassifier, text_dataset

SCHEDULE = {1: 2, 2: 3}
STOP_AFTER_EPOCH = 1


class FeaturesModule(TextClassifier):
    def __init__(self) -> None:
        super().__init__(num_layers=4)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=NUM_LABELS)
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=NUM_LABELS)
        self.hook_calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.hook_calls[name] = self.hook_calls.get(name, 0) + 1

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        loss = nn.functional.cross_entropy(self(ids), labels)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True, prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self._count("on_train_batch_end")
        assert batch[0].shape[0] > 0  # a real batch: idle ranks must not get here

    def on_after_backward(self):
        self._count("on_after_backward")
        assert any(p.grad is not None for p in self.parameters())

    def on_train_epoch_end(self):
        self._count("on_train_epoch_end")
        self.log("epoch_marker", float(self.current_epoch), sync_dist=True)

    def validation_step(self, batch, batch_idx):
        ids, labels = batch
        logits = self(ids)
        self.val_acc.update(logits.argmax(-1), labels)
        self.log("val_loss", nn.functional.cross_entropy(logits, labels), sync_dist=True)
        # Drives EarlyStopping: below its threshold from the end of epoch STOP_AFTER_EPOCH on.
        self.log("val_countdown", torch.tensor(float(STOP_AFTER_EPOCH - self.current_epoch)), sync_dist=True)

    def on_validation_epoch_end(self):
        self._count("on_validation_epoch_end")
        self.log("val_acc", self.val_acc.compute(), sync_dist=True)  # compute() syncs over the replicas
        self.val_acc.reset()

    def test_step(self, batch, batch_idx):
        ids, labels = batch
        logits = self(ids)
        self.test_acc.update(logits.argmax(-1), labels)
        self.log("test_loss", nn.functional.cross_entropy(logits, labels), sync_dist=True)

    def on_test_epoch_end(self):
        self._count("on_test_epoch_end")
        self.log("test_acc", self.test_acc.compute())
        self.test_acc.reset()

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    out = Path(args.out)
    (out / f"pid{os.environ.get('LOCAL_RANK', 0)}").write_text(str(os.getpid()))

    best_loss = ModelCheckpoint(dirpath=out / "ckpt", monitor="val_loss", save_top_k=2, save_last=True,
                                filename="loss-{epoch}-{val_loss:.4f}")
    best_acc = ModelCheckpoint(dirpath=out / "ckpt_acc", monitor="val_acc", mode="max", save_top_k=1,
                               save_on_train_epoch_end=False, filename="acc-{epoch}")
    stop = EarlyStopping(monitor="val_countdown", mode="min", stopping_threshold=0.5, patience=100)
    watch_train = EarlyStopping(monitor="train_loss_epoch", patience=100, check_on_train_epoch_end=True)
    watch_val = EarlyStopping(monitor="val_acc", mode="max", patience=100, check_on_train_epoch_end=False)
    module = FeaturesModule()
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, max_epochs=4, num_sanity_val_steps=1, enable_model_summary=False,
        strategy=PipeTransformerStrategy(pipe_len=4, frozen_cost=0.0, process_group_backend="gloo", timeout=args.timeout),
        callbacks=[AutoFreeze(schedule=SCHEDULE), best_loss, best_acc, stop, watch_train, watch_val,
                   LearningRateMonitor(logging_interval="epoch")],
        logger=[CSVLogger(out / "logs", name="csv", version=0), TensorBoardLogger(out / "logs", name="tb", version=0)],
        log_every_n_steps=1,
    )
    train = DataLoader(text_dataset(32), batch_size=4)
    val = DataLoader(text_dataset(16, seed=1), batch_size=4)
    trainer.fit(module, train, val)
    fit = {
        "current_epoch": trainer.current_epoch, "global_step": trainer.global_step,
        "should_stop": trainer.should_stop, "stopped_epoch": stop.stopped_epoch,
        "best_loss_path": best_loss.best_model_path, "best_loss_score": float(best_loss.best_model_score),
        "best_acc_path": best_acc.best_model_path, "last_path": best_loss.last_model_path,
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "is_active": trainer.strategy.is_active, "plan": trainer.strategy.plan.to_dict(),
        "hook_calls": dict(module.hook_calls),
    }
    validated = trainer.validate(module, val, verbose=False)
    tested = trainer.test(module, DataLoader(text_dataset(16, seed=2), batch_size=4), verbose=False)
    predicted = trainer.predict(module, DataLoader(text_dataset(16, seed=2), batch_size=4))
    torch.save(
        {
            "fit": fit, "validate": validated, "test": tested, "active_after": trainer.strategy.is_active,
            "predicted": [p.tolist() for p in predicted if p is not None], "predict_batches": len(predicted),
            "hook_calls": dict(module.hook_calls), "state": module.state_dict(),
        },
        out / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
