"""Small models and a LightningModule shared by the tests; built from configs, never downloaded."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from transformers import BertConfig, BertForSequenceClassification, ViTConfig, ViTForImageClassification

VOCAB, SEQ, NUM_LABELS = 50, 8, 3


def tiny_bert(num_layers: int = 4, dropout: float = 0.0) -> BertForSequenceClassification:
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=num_layers, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=NUM_LABELS,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )
    return BertForSequenceClassification(config)


def tiny_llama(num_layers: int = 4) -> nn.Module:
    """A Llama-style decoder classifying the last token (grouped-query attention, rotary embeddings)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(
        vocab_size=VOCAB + 1, pad_token_id=VOCAB, hidden_size=32, num_hidden_layers=num_layers, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, max_position_embeddings=32, num_labels=NUM_LABELS,
    )
    return LlamaForSequenceClassification(config)


def tiny_vit(num_layers: int = 3, dropout: float = 0.0) -> ViTForImageClassification:
    config = ViTConfig(
        hidden_size=32, num_hidden_layers=num_layers, num_attention_heads=2, intermediate_size=64,
        image_size=8, patch_size=4, num_channels=1, num_labels=NUM_LABELS,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )
    return ViTForImageClassification(config)


class TimmStyleViT(nn.Module):
    """The shape of a timm VisionTransformer: patch_embed, cls_token, pos_drop, blocks (Sequential), norm, head."""

    def __init__(self, dim: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(16, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_drop = nn.Dropout(0.0)
        self.blocks = nn.Sequential(
            *[nn.TransformerEncoderLayer(dim, 2, 64, dropout=0.0, batch_first=True) for _ in range(depth)]
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, NUM_LABELS)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        patches = images.unfold(2, 4, 4).unfold(3, 4, 4).reshape(images.shape[0], -1, 16)
        x = self.patch_embed(patches)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.blocks(self.pos_drop(x))
        return self.head(self.norm(x[:, 0]))


class TorchEncoderClassifier(nn.Module):
    """An nn.TransformerEncoder with an embedding before it and a head after it.

    ``enable_nested_tensor``: torch's default is True; with a ``padding_mask`` (True at padded positions)
    the encoder then takes its nested-tensor fast path whenever its first layer is in eval mode.
    """

    def __init__(self, dim: int = 32, depth: int = 3, enable_nested_tensor: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        layer = nn.TransformerEncoderLayer(dim, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=enable_nested_tensor)
        self.head = nn.Linear(dim, NUM_LABELS)

    def forward(self, input_ids: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.encoder(self.embed(input_ids), src_key_padding_mask=padding_mask).mean(dim=1))


def text_dataset(n: int = 32, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    labels = torch.randint(0, NUM_LABELS, (n,), generator=g)
    return TensorDataset(ids, labels)


class IndexedDataset(Dataset):
    """``{"ids", "labels", "index"}`` samples: what ``cache_key="index"`` needs (the dataset index)."""

    def __init__(self, dataset: TensorDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        ids, labels = self.dataset[index]
        return {"ids": ids, "labels": labels, "index": index}


def ids_and_labels(batch):
    return (batch["ids"], batch["labels"]) if isinstance(batch, dict) else batch


class TextClassifier(pl.LightningModule):
    """A LightningModule around a tiny BERT (or a Llama-style decoder); SGD with momentum so
    frozen-vs-active differences show."""

    def __init__(self, num_layers: int = 4, lr: float = 0.05, seed: int = 0, arch: str = "bert") -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = tiny_llama(num_layers) if arch == "llama" else tiny_bert(num_layers)
        self.lr = lr

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits

    def training_step(self, batch, batch_idx):
        ids, labels = ids_and_labels(batch)
        loss = nn.functional.cross_entropy(self(ids), labels)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        ids, labels = ids_and_labels(batch)
        self.log("val_loss", nn.functional.cross_entropy(self(ids), labels), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=0.01)


def loader(dataset: TensorDataset, batch_size: int = 8) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)


class ResumableLoader(DataLoader):
    """A DataLoader that resumes where its checkpoint left it (Lightning saves the state of loaders
    that have ``state_dict``). Without one, Lightning's mid-epoch resume restarts the epoch's data
    from its first batch, under any strategy: not the uninterrupted run."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._yielded, self._skip = 0, 0

    def __iter__(self):
        skip, self._skip = self._skip, 0
        self._yielded = skip
        for index, batch in enumerate(super().__iter__()):
            if index >= skip:
                self._yielded = index + 1
                yield batch

    def state_dict(self) -> dict:
        return {"yielded": self._yielded}

    def load_state_dict(self, state: dict) -> None:
        self._skip = state["yielded"]
