"""Kept folders (``cache_keep``): written through, never deleted by a store, evicted oldest first, cleared by hand."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_pipetransformer.cache import cli
from lightning_pipetransformer.cache.kept import MARKER, clear, evict, store_folders
from lightning_pipetransformer.cache.store import ActivationStore

FP = "0123456789abcdef0123456789abcde"  # + one hex digit per folder


def kept_folder(root: Path, n: int, used: float, entries: int = 4, keep: bool = True) -> ActivationStore:
    """A store of ``entries`` entries in folder ``n`` of ``root``, last used at ``used`` (closed: nobody holds it)."""
    store = ActivationStore(root, FP + f"{n:x}", 1, memory_budget=2**20 if keep else 0, keep=keep)  # on disk either way
    store.store([f"k{i}" for i in range(entries)], torch.ones(entries, 64))
    store.close()
    marker = store.directory / MARKER
    os.utime(marker if marker.exists() else store.directory, (used, used))
    return store


def test_a_kept_store_writes_every_entry_and_no_store_deletes_its_folder(tmp_path):
    kept = ActivationStore(tmp_path, FP + "1", 1, memory_budget=2**20, keep=True)
    kept.store(["a", "b"], torch.ones(2, 8))
    assert kept.stats().entries_in_memory == 2 and kept.stats().files_on_disk == 2  # in memory, and written through
    assert (kept.directory / MARKER).exists()
    assert not kept.close(delete=True) and kept.directory.is_dir()  # a boundary move: kept for later runs
    # A run that does not keep, on the same weights and cache_dir, does not delete it either.
    other = ActivationStore(tmp_path, FP + "1", 1, memory_budget=0)
    assert other.lookup(["a", "b"])[0].all()
    assert not other.close(delete=True) and kept.directory.is_dir()
    # Without the mark a folder goes as before (the control).
    plain = ActivationStore(tmp_path, FP + "2", 1, memory_budget=0)
    plain.store(["a"], torch.ones(1, 8))
    assert plain.close(delete=True) and not plain.directory.exists()


def test_eviction_goes_least_recently_used_first_and_never_takes_a_held_folder(tmp_path):
    stores = [kept_folder(tmp_path, n, used=1_000_000 + n) for n in range(4)]
    size = store_folders(tmp_path)[0].bytes
    assert [f.path for f in store_folders(tmp_path)] == [s.directory for s in stores]  # oldest first
    held = ActivationStore(tmp_path, FP + "0", 1, memory_budget=0, keep=True)  # a live run holds the oldest
    os.utime(held.directory / MARKER, (1_000_000, 1_000_000))
    done = evict(tmp_path, 2 * size)
    assert [f.path for f in done.removed] == [stores[1].directory, stores[2].directory]
    assert [f.path for f in done.held] == [stores[0].directory] and done.bytes_left == 2 * size
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([stores[0].directory.name, stores[3].directory.name])
    held.close()
    assert evict(tmp_path, 2 * size).removed == []  # under the cap: nothing goes


def test_clear_and_the_command_line(tmp_path, capsys):
    for n in range(3):
        kept_folder(tmp_path, n, used=1_000_000 + n, keep=n != 1)
    (tmp_path / "notes.txt").write_text("not the cache's")
    assert cli.main(["list", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    assert listed.count("kept") == 2 and "per run" in listed and "3 folder(s)" in listed
    size = store_folders(tmp_path)[0].bytes
    cli.main(["evict", str(tmp_path), "--max-bytes", str(2 * size)])
    assert "removed 1 folder(s)" in capsys.readouterr().out
    assert len(store_folders(tmp_path)) == 2
    cli.main(["clear", str(tmp_path)])
    assert "removed 2 folder(s)" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert clear(tmp_path).removed == []


def test_the_module_runs_as_a_command(tmp_path):
    import subprocess
    import sys

    kept_folder(tmp_path, 0, used=1_000_000)
    out = subprocess.run([sys.executable, "-m", "lightning_pipetransformer.cache", "clear", str(tmp_path)], capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": os.getcwd()}).stdout
    assert "removed 1 folder(s)" in out and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("missing", [True, False])
def test_a_folder_without_stores_lists_nothing(tmp_path, missing):
    root = tmp_path / "absent" if missing else tmp_path
    assert store_folders(root) == [] and evict(root, 0).removed == []
