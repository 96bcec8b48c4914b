"""LightningCLI with strategy="pipetransformer" on a small BERT built from a config and synthetic data.

It needs no downloads, so it shows the YAML forms and runs in seconds on a CPU::

    python examples/synthetic_cli.py fit --config examples/configs/synthetic_by_name.yaml
    python examples/synthetic_cli.py fit --config examples/configs/synthetic_class_path.yaml

The LightningModule knows nothing about pipelining or freezing: both come from the YAML.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification  # noqa: E402

import lightning_pipetransformer  # noqa: E402,F401  (registers strategy="pipetransformer")


class SyntheticText(pl.LightningDataModule):
    """Random token ids whose label is the parity of the first token: learnable, tiny."""

    def __init__(self, num_samples: int = 256, seq_len: int = 16, vocab: int = 100, batch_size: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(0)
        h = self.hparams
        ids = torch.randint(0, h.vocab, (h.num_samples, h.seq_len), generator=g)
        self.train_set = TensorDataset(ids, ids[:, 0] % 2)
        self.val_set = TensorDataset(ids[: h.num_samples // 4], ids[: h.num_samples // 4, 0] % 2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)


class TinyBert(pl.LightningModule):
    """A BERT classifier from a config (no pretrained weights)."""

    def __init__(self, num_layers: int = 4, hidden: int = 64, vocab: int = 100, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = BertConfig(
            vocab_size=vocab, hidden_size=hidden, num_hidden_layers=num_layers, num_attention_heads=4,
            intermediate_size=4 * hidden, max_position_embeddings=64, num_labels=2,
        )
        self.model = BertForSequenceClassification(config)

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        loss = nn.functional.cross_entropy(self.model(input_ids=ids).logits, labels)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        ids, labels = batch
        accuracy = (self.model(input_ids=ids).logits.argmax(-1) == labels).float().mean()
        self.log("val_acc", accuracy)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    LightningCLI(TinyBert, SyntheticText)


if __name__ == "__main__":
    main()
