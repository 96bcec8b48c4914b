"""``python -m lightning_pipetransformer.cache``: what a cache folder holds, and removing it (``cache_keep``'s folders)::

    python -m lightning_pipetransformer.cache list  /scratch/sweep-cache
    python -m lightning_pipetransformer.cache evict /scratch/sweep-cache --max-bytes 20e9
    python -m lightning_pipetransformer.cache clear /scratch/sweep-cache

``evict`` removes the folders of least recent use until at most ``--max-bytes`` are left (what a run with
``cache_keep_bytes`` does when a boundary opens and when it ends); ``clear`` removes every store folder. Both skip a
folder a live run holds (its lock), and say so; other files in the folder stay. The Python API is
:func:`~lightning_pipetransformer.cache.kept.evict` and :func:`~lightning_pipetransformer.cache.kept.clear`.
"""

from __future__ import annotations

import argparse
import datetime
from collections.abc import Sequence

from lightning_pipetransformer.cache.kept import Eviction, StoreFolder, clear, evict, store_folders

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lightning_pipetransformer.cache",
        description="List, evict or clear the store folders of an AutoCache cache_dir (entries kept with cache_keep=True).",
    )
    commands = p.add_subparsers(dest="command", required=True)
    for name, text in (("list", "list the store folders, least recently used first"), ("clear", "remove every store folder")):
        commands.add_parser(name, help=text).add_argument("cache_dir")
    evicting = commands.add_parser("evict", help="remove least recently used folders until at most --max-bytes are left")
    evicting.add_argument("cache_dir")
    evicting.add_argument("--max-bytes", type=float, required=True, help="bytes to keep at most (e.g. 20e9)")
    return p


def _row(folder: StoreFolder) -> str:
    used = datetime.datetime.fromtimestamp(folder.last_used).isoformat(sep=" ", timespec="seconds")
    kind = "kept" if folder.kept else "per run"
    return f"{folder.path.name}  {folder.bytes / 2**20:10.1f} MiB  {folder.files:8d} entries  {used}  {kind}"


def _said(done: Eviction) -> str:
    held = f"; {len(done.held)} held by a live run, left: " + ", ".join(f.path.name for f in done.held) if done.held else ""
    removed, left = done.bytes_removed / 2**20, done.bytes_left / 2**20
    return f"removed {len(done.removed)} folder(s), {removed:.1f} MiB; {left:.1f} MiB left{held}"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "list":
        folders = store_folders(args.cache_dir)
        for folder in folders:
            print(_row(folder))
        print(f"{len(folders)} folder(s), {sum(f.bytes for f in folders) / 2**20:.1f} MiB in {args.cache_dir}")
        return 0
    done = clear(args.cache_dir) if args.command == "clear" else evict(args.cache_dir, int(args.max_bytes))
    print(_said(done))
    return 0
