"""LightningModules over each supported model family, for strategy equivalence tests."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from tests.helpers.models import NUM_LABELS, SEQ, VOCAB, TimmStyleViT, TorchEncoderClassifier, tiny_bert, tiny_vit


def _ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, NUM_LABELS, (n,), generator=g)


def _images(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, NUM_LABELS, (n,), generator=g)


def inputs_and_labels(batch):
    """Tuple batches, or dict batches with their dataset index (``cache_key="index"``)."""
    return (batch["x"], batch["y"]) if isinstance(batch, dict) else batch


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
            # torch's default enable_nested_tensor=True, and a padded batch: the nested-tensor fast path in eval mode.
            "torch-nested": lambda: TorchEncoderClassifier(depth=num_layers, enable_nested_tensor=True),
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
        if self.kind == "torch-nested":
            padding = torch.zeros_like(x, dtype=torch.bool)
            padding[::2, -2:] = True  # padded at the end (left-aligned), as the nested-tensor path requires
            return self.model(x, padding)
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = inputs_and_labels(batch)
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = inputs_and_labels(batch)
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=0.01)


class IndexedSamples(Dataset):
    """``{"x", "y", "index"}`` samples; ``augment``: replace one random token per read (own generator)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, augment: bool = False) -> None:
        self.x, self.y = x, y
        self.augment = torch.Generator().manual_seed(1) if augment else None

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict:
        x = self.x[index]
        if self.augment is not None:
            x = x.clone()
            position = int(torch.randint(0, x.shape[0], (), generator=self.augment))
            x[position] = int(torch.randint(0, VOCAB, (), generator=self.augment))
        return {"x": x, "y": self.y[index], "index": index}


def indexed_text(n: int = 24, seed: int = 0, augment: bool = False, shuffle: bool = False) -> DataLoader:
    """Token ids as dict batches with dataset indices; ``shuffle`` with a seeded order (same every fit)."""
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(IndexedSamples(*_ids(n, seed), augment=augment), batch_size=8, shuffle=shuffle, generator=generator)


def data_for(kind: str, n: int = 24, seed: int = 0, batch_size: int = 8) -> DataLoader:
    x, y = _images(n, seed) if kind in ("vit", "timm") else _ids(n, seed)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)
