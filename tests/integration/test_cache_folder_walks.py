"""A served step never walks the cache's folder (issue 40, item 1).

The progress bar asks for the cache's hit rate on every training step and the loggers for its
counters every epoch. Both once scanned the store's folder and ``stat``-ed every file in it, on
every rank: with tens of thousands of spilled entries, milliseconds to seconds per step. The
counters now live in memory (the files this process wrote, found or deleted); the folder is read
at a boundary's open only. ``cache_memory=0`` puts every entry on disk, so a served step reads
files: one ``stat`` per row looked up is allowed, a walk of the folder (or a ``stat`` per file in
it) is not.
"""

from __future__ import annotations

import os
import pathlib
from collections import Counter
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from lightning_pipetransformer import AutoFreeze
from tests.helpers.cached_fits import cached, fit, stats_of
from tests.helpers.lightning_models import data_for

BATCH, SAMPLES = 4, 32  # 8 steps an epoch, 4 rows a step; 48 files in the folder (16 validation samples)


class FolderCalls:
    """Calls of the folder/file functions on paths under ``root``, by kind, while ``counting`` is set."""

    def __init__(self, root: Path) -> None:
        self.root = str(root)
        self.counting = False
        self.calls: Counter[str] = Counter()

    def wrap(self, kind: str, function):
        def counted(path=".", *args, **kwargs):
            if self.counting and str(path).startswith(self.root):
                self.calls[kind] += 1
            return function(path, *args, **kwargs)

        return counted

    @property
    def walks(self) -> int:
        return sum(n for kind, n in self.calls.items() if kind != "stat")


class ServedSteps(Callback):
    """Counts the folder calls of each training step of ``epoch`` (from the batch's start to its end)."""

    def __init__(self, calls: FolderCalls, epoch: int) -> None:
        self.folder, self.epoch = calls, epoch
        self.steps: list[Counter[str]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.current_epoch == self.epoch:
            self.folder.calls = Counter()
            self.folder.counting = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.folder.counting:
            self.folder.counting = False
            self.steps.append(self.folder.calls)


def scan(directory: Path) -> tuple[int, int]:
    """(files, bytes) of the entry files in ``directory``, read afresh."""
    files = [p for p in directory.iterdir() if p.name.endswith(".safetensors")]
    return len(files), sum(p.stat().st_size for p in files)


def test_a_served_step_never_walks_the_cache_folder_and_the_counters_stay_true(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    folder = FolderCalls(root)
    monkeypatch.setattr(os, "scandir", folder.wrap("scandir", os.scandir))
    monkeypatch.setattr(os, "listdir", folder.wrap("listdir", os.listdir))
    monkeypatch.setattr(os, "stat", folder.wrap("stat", os.stat))
    for name in ("iterdir", "glob", "rglob"):
        monkeypatch.setattr(pathlib.Path, name, folder.wrap(name, getattr(pathlib.Path, name)))
    # Epoch 1 stores boundary 2's entries, epoch 2 is served from them (every entry on disk).
    served = ServedSteps(folder, epoch=2)
    strategy = cached(tmp_path, cache_memory=0)
    train = data_for("bert", n=SAMPLES, batch_size=BATCH)
    _, trainer, _ = fit("bert", strategy, train=train, freeze=AutoFreeze(schedule={1: 2}), max_epochs=3, callbacks=[served])

    stats = {k.rsplit("/", 1)[1]: v for k, v in stats_of(trainer).items()}
    # Engaged: epoch 2 was served in full, from disk (and its validation: 2 batches more).
    assert stats["boundary"] == 2 and stats["batches_served"] >= SAMPLES // BATCH and stats["disk_hits"] >= SAMPLES
    assert len(served.steps) == SAMPLES // BATCH
    walks = [sum(n for kind, n in step.items() if kind != "stat") for step in served.steps]
    assert walks == [0] * len(walks), f"folder walks per served step: {served.steps}"
    # Each row reads its own file; a stat per file in the folder (32) would be a scan by another name.
    assert max(step["stat"] for step in served.steps) <= BATCH, served.steps

    store = trainer.strategy.autocache.store
    files, size = scan(store.directory)
    assert files == stats["stored"] >= SAMPLES  # the training samples' entries and the validation's
    assert (stats["files_on_disk"], stats["bytes_on_disk"]) == (files, size)
    assert (store.stats().files_on_disk, store.stats().bytes_on_disk) == (files, size)
