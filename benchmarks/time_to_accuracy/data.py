"""The benchmark's data: the example's Rotten Tomatoes data module with seeded loaders and length buckets."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, Sampler

from examples.rotten_tomatoes import Batch, EncodedDataset, RottenTomatoesDataModule, collate_trimmed

__all__ = ["BenchData", "LengthBucketBatches", "Padding", "collate_to_multiple", "padded_length", "tokens_per_batch"]

Padding = Literal["bucket", "trim", "max"]


def padded_length(lengths: torch.Tensor, multiple: int, max_length: int) -> torch.Tensor:
    """Each sample's length rounded up to ``multiple`` (capped at ``max_length``)."""
    return torch.clamp(((lengths + multiple - 1) // multiple) * multiple, max=max_length)


class LengthBucketBatches(Sampler[list[int]]):
    """Batches drawn from samples of one padded length: random composition, seeded per epoch.

    Each epoch the samples of every length bucket are shuffled and cut into batches, and the
    batches of all buckets are shuffled together. The generator is seeded with ``(seed, epoch)``:
    Lightning calls ``set_epoch`` on ``batch_sampler.sampler`` (this object's :attr:`sampler`).
    """

    def __init__(self, bucket_of: torch.Tensor, batch_size: int, seed: int, shuffle: bool = True) -> None:
        self.bucket_of = bucket_of
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.sampler = _EpochClock()
        self._buckets = {int(b): torch.nonzero(bucket_of == b).flatten() for b in torch.unique(bucket_of)}

    def __len__(self) -> int:
        return sum(math.ceil(len(idx) / self.batch_size) for idx in self._buckets.values())

    def __iter__(self) -> Iterator[list[int]]:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + self.sampler.epoch)
        batches: list[list[int]] = []
        for bucket in sorted(self._buckets):
            idx = self._buckets[bucket]
            if self.shuffle:
                idx = idx[torch.randperm(len(idx), generator=gen)]
            batches.extend(idx[i : i + self.batch_size].tolist() for i in range(0, len(idx), self.batch_size))
        order = torch.randperm(len(batches), generator=gen).tolist() if self.shuffle else range(len(batches))
        yield from (batches[i] for i in order)


class _EpochClock:
    """Receives Lightning's ``set_epoch`` for :class:`LengthBucketBatches`."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def collate_to_multiple(multiple: int) -> Any:
    """Cut a batch to its longest sample rounded up to ``multiple``: within one length bucket that
    is the bucket's length, the same every epoch whoever the batch-mates are."""

    def collate(batch: Batch) -> Batch:
        longest = int(batch["attention_mask"].sum(dim=1).max())
        width = batch["attention_mask"].shape[1]
        length = min(width, ((longest + multiple - 1) // multiple) * multiple)
        return {k: (v[:, :length].contiguous() if v.dim() == 2 else v) for k, v in batch.items()}

    return collate


class BenchData(RottenTomatoesDataModule):
    """The example's data module with seeded loaders and a choice of padding (the same for every variant).

    Args:
        seed: seeds the training order (its own generator, untouched by dropout or model init).
        padding: ``"bucket"``, ``"trim"`` or ``"max"`` (see the module docstring).
        val_batch_size: samples per validation batch (validation batches are sorted by length).
        multiple: bucket granularity in tokens.
        val_subset: the validation checks run on this many validation snippets, a fixed subset drawn with
            ``val_subset_seed`` (the same for every variant and seed; ``None``: the whole set).
            :meth:`full_val_dataloader` is the whole set, for the final accuracy.
        **kwargs: :class:`RottenTomatoesDataModule` arguments.
    """

    def __init__(
        self, seed: int = 0, padding: Padding = "bucket", val_batch_size: int = 128, multiple: int = 8,
        val_subset: int | None = None, val_subset_seed: int = 0, **kwargs: Any,
    ) -> None:  # fmt: skip
        if padding not in ("bucket", "trim", "max"):
            raise ValueError(f"padding must be 'bucket', 'trim' or 'max', got {padding!r}.")
        if val_subset is not None and val_subset < 1:
            raise ValueError(f"val_subset must be a positive number of snippets or None (the whole set), got {val_subset!r}.")
        super().__init__(trim_padding=padding != "max", **kwargs)
        self.seed, self.padding, self.val_batch_size, self.multiple = seed, padding, val_batch_size, multiple
        self.val_subset, self.val_subset_seed = val_subset, val_subset_seed

    def _lengths(self, dataset: EncodedDataset) -> torch.Tensor:
        return dataset.attention_mask.sum(dim=1)

    def train_dataloader(self) -> DataLoader[Batch]:
        data = self._require(self.train_set)
        bs = int(self.hparams.batch_size)
        if self.padding == "bucket":
            buckets = padded_length(self._lengths(data), self.multiple, data.input_ids.shape[1])
            sampler = LengthBucketBatches(buckets, bs, self.seed)
            return DataLoader(data, batch_sampler=sampler, collate_fn=collate_to_multiple(self.multiple))
        gen = torch.Generator().manual_seed(self.seed)
        collate = collate_trimmed if self.padding == "trim" else _identity
        return DataLoader(data, batch_size=bs, shuffle=True, generator=gen, collate_fn=collate)

    def subset_indices(self) -> list[int] | None:
        """The validation snippets the checks run on (sorted positions in the validation side); ``None``: all.
        Drawn by its own seeded generator: independent of the training seed, identical for every run."""
        data = self._require(self.val_set)
        if self.val_subset is None or self.val_subset >= len(data):
            return None
        gen = torch.Generator().manual_seed(self.val_subset_seed)
        return sorted(torch.randperm(len(data), generator=gen)[: self.val_subset].tolist())

    def val_dataloader(self) -> DataLoader[Batch]:
        """What the validation checks during ``fit`` run on: the fixed subset (``val_subset``), or the whole set."""
        return self._val_loader(self.subset_indices())

    def full_val_dataloader(self) -> DataLoader[Batch]:
        """The whole validation set: the final accuracy."""
        return self._val_loader(None)

    def _val_loader(self, indices: list[int] | None) -> DataLoader[Batch]:
        data = self._require(self.val_set)
        positions = torch.arange(len(data)) if indices is None else torch.tensor(indices, dtype=torch.long)
        if self.padding == "max":
            batches = [positions[i : i + self.val_batch_size].tolist() for i in range(0, len(positions), self.val_batch_size)]
            return DataLoader(data, batch_sampler=batches, collate_fn=_identity)
        lengths = self._lengths(data)[positions]
        order = positions[torch.argsort(lengths, stable=True)].tolist()  # fixed batches, little padding
        batches = [order[i : i + self.val_batch_size] for i in range(0, len(order), self.val_batch_size)]
        return DataLoader(data, batch_sampler=batches, collate_fn=collate_to_multiple(self.multiple))

    @staticmethod
    def _require(dataset: EncodedDataset | None) -> EncodedDataset:
        if dataset is None:
            raise RuntimeError("Call setup('fit') before asking for a dataloader.")
        return dataset


def _identity(batch: Batch) -> Batch:
    return batch


def tokens_per_batch(dm: BenchData, padding: Padding) -> float:
    """Mean padded tokens per training batch under ``padding`` (one epoch, seed 0)."""
    saved = dm.padding
    dm.padding = padding
    try:
        shapes = [b["input_ids"].numel() for b in dm.train_dataloader()]
    finally:
        dm.padding = saved
    return statistics.fmean(shapes)
