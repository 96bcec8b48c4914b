"""Entries kept for later runs (``cache_keep``): which folders a cache folder holds, their size and last use, and what
goes first when it is over its cap.

A store that keeps its entries marks its folder with a ``.kept`` file and touches it when it opens and when it
closes: the file's time is the folder's last use. Two things follow from the mark:

- nothing deletes a kept folder at a boundary move, a retire or the end of a fit, not even a run that does not
  keep (it may share the folder: same weights, same ``cache_dir``); only eviction and :func:`clear` do;
- eviction (:func:`evict`) goes by last use, oldest first, and like every deletion takes the folder's exclusive lock
  without waiting (:func:`~lightning_pipetransformer.cache.folders.remove_directory`): a folder another live run holds
  (its shared lock) is never removed, whatever its age.

Sizes are read from the folders when asked (one ``stat`` per file): at a boundary's open and at the end of a fit, not
per step. A run may go over the cap while it writes its own folder (it holds it); the next check after it lets go
brings the folder back under.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from lightning_pipetransformer.cache.entry_file import SUFFIX
from lightning_pipetransformer.cache.folders import remove_directory

__all__ = ["MARKER", "Eviction", "StoreFolder", "clear", "evict", "folder_name", "is_kept", "mark_used", "store_folders"]

#: The file that marks a kept folder; its modification time is the folder's last use.
MARKER = ".kept"

#: A store's folder: ``<fingerprint>-b<boundary>-<storage>`` (cache/store.py names them with :func:`folder_name`).
_FOLDER = re.compile(r"^[0-9a-f]{32}-b\d+-(native|bfloat16|float16)$")


def folder_name(fingerprint: str, boundary: int, storage: str) -> str:
    """The folder of one store: the prefix's fingerprint, its boundary and the storage dtype."""
    return f"{fingerprint}-b{boundary}-{storage}"


def mark_used(directory: Path) -> None:
    """Mark ``directory`` kept, its last use now. A folder that cannot be written (read-only, full) stays unmarked:
    its entries are still read; it is then evicted by its folder's own time."""
    try:
        with open(directory / MARKER, "a"):
            pass
        os.utime(directory / MARKER)
    except OSError:
        pass


def is_kept(directory: Path) -> bool:
    return (directory / MARKER).exists()


@dataclass(frozen=True)
class StoreFolder:
    """One store's folder in a cache folder: its size (every file in it), entry files, last use and whether it is kept."""

    path: Path
    bytes: int
    files: int
    last_used: float
    kept: bool


def store_folders(cache_dir: str | os.PathLike[str]) -> list[StoreFolder]:
    """Every store folder in ``cache_dir``, least recently used first (a missing ``cache_dir``: none)."""
    found = []
    try:
        entries = list(os.scandir(cache_dir))
    except OSError:
        return []
    for entry in entries:
        if not (_FOLDER.match(entry.name) and entry.is_dir(follow_symlinks=False)):
            continue
        total = files = 0
        try:
            for item in os.scandir(entry.path):
                try:
                    total += item.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue
                files += item.name.endswith(SUFFIX)
            marker = Path(entry.path) / MARKER
            kept = marker.exists()
            last_used = (marker if kept else Path(entry.path)).stat().st_mtime
        except FileNotFoundError:  # removed meanwhile (another run's eviction)
            continue
        found.append(StoreFolder(Path(entry.path), total, files, last_used, kept))
    return sorted(found, key=lambda f: (f.last_used, f.path.name))


@dataclass
class Eviction:
    """What one eviction did: the folders removed, those kept because a live run holds them, and the bytes left."""

    removed: list[StoreFolder] = field(default_factory=list)
    held: list[StoreFolder] = field(default_factory=list)
    bytes_left: int = 0

    @property
    def bytes_removed(self) -> int:
        return sum(f.bytes for f in self.removed)


def evict(cache_dir: str | os.PathLike[str], max_bytes: int) -> Eviction:
    """Remove store folders of ``cache_dir``, least recently used first, until at most ``max_bytes`` are left.

    A folder a live store holds (this run's current boundary, another run's) is skipped and counts as left.
    """
    folders = store_folders(cache_dir)
    done = Eviction(bytes_left=sum(f.bytes for f in folders))
    for folder in folders:
        if done.bytes_left <= max_bytes:
            break
        if remove_directory(folder.path):
            done.removed.append(folder)
            done.bytes_left -= folder.bytes
        else:
            done.held.append(folder)
    return done


def clear(cache_dir: str | os.PathLike[str]) -> Eviction:
    """Remove every store folder of ``cache_dir`` that no live run holds (kept or not); other files stay."""
    return evict(cache_dir, -1)
