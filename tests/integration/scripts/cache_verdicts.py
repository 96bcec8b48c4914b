"""One rank's cache verdict on 2 CPU processes (gloo); run by tests/integration/distributed/test_cache_verdicts.py.

Two replicas (pipe length 1, DDP) of a tiny BERT with AutoCache, the freeze {1: 3}. ``--fault``
makes rank 1 alone reach a verdict: ``stale`` fails its first-hit check (its store returns values off
by one), ``index`` gives it dict batches whose dataset indices repeat. Every rank
writes its pid at the start and its error, if any, to ``--out``. The collective timeout is long
(``--timeout``): a rank left waiting would hang that long.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for tests.helpers

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from lightning_pipetransformer.cache.store import ActivationStore
from tests.helpers.launch import fit_recording_errors
from tests.helpers.models import IndexedDataset, TextClassifier, text_dataset


class RepeatedIndices(Dataset):
    """Rank 1's bug: ``index`` is ``i % 4``, so samples share keys."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        return {**self.dataset[index], "index": index % 4}


class Classifier(TextClassifier):
    def training_step(self, batch, batch_idx):
        ids, labels = (batch["ids"], batch["labels"]) if isinstance(batch, dict) else batch
        return torch.nn.functional.cross_entropy(self(ids), labels)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--fault", choices=("stale", "index"), required=True)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    out = Path(args.out)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    (out / f"pid{rank}").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    data: Dataset = IndexedDataset(text_dataset(32))
    if rank == 1 and args.fault == "stale":  # this rank's store returns what another prefix would have
        lookup = ActivationStore.lookup

        def stale_lookup(self, *a, **k):
            hit_mask, hits = lookup(self, *a, **k)
            return hit_mask, hits + 1.0

        ActivationStore.lookup = stale_lookup
    if rank == 1 and args.fault == "index":
        data = RepeatedIndices(data)
    strategy = PipeTransformerStrategy(
        process_group_backend="gloo", timeout=args.timeout, cache=True, cache_dir=str(out / "cache"),
        cache_key="index" if args.fault == "index" else "content",
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=3, callbacks=[AutoFreeze(schedule={1: 3})],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    fit_recording_errors(trainer, Classifier(num_layers=4), DataLoader(data, batch_size=8), None, out / f"error{rank}")


if __name__ == "__main__":
    main()
