"""LightningModules over each supported model family, for strategy equivalence tests."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from models import NUM_LABELS, SEQ, VOCAB, TimmStyleViT, TorchEncoderClassifier, tiny_bert, tiny_vit


def _ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, NUM_LABELS, (n,), generator=g)


def _images(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, NUM_LABELS, (n,), generator=g)


class Classifier(pl.LightningModule):
    """``kind`` picks the model; SGD with momentum and weight decay."""

    def __init__(self, kind: str = "bert", num_layers: int = 4, seed: int = 0, lr: float = 0.05) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.kind = kind
        self.model = {
            "bert": lambda: tiny_bert(num_layers),
            "vit": lambda: tiny_vit(num_layers),
            "timm": lambda: TimmStyleViT(depth=num_layers),
            "torch": lambda: TorchEncoderClassifier(depth=num_layers),
        }[kind]()
        self.lr = lr

    def forward(self, x):
        if self.kind == "bert":
            # A padded batch: the attention mask is a batch-shaped argument of every block.
            mask = torch.ones_like(x)
            mask[::2, -2:] = 0
            return self.model(input_ids=x, attention_mask=mask).logits
        if self.kind == "vit":
            return self.model(pixel_values=x).logits
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=0.01)


def data_for(kind: str, n: int = 24, seed: int = 0, batch_size: int = 8) -> DataLoader:
    x, y = _images(n, seed) if kind in ("vit", "timm") else _ids(n, seed)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)
