"""Where a fit's cache files go by default, and the empty folders removed when the fit ends.

The default ``cache_dir`` is ``<trainer.default_root_dir>/pipetransformer_cache``: beside the run's
logs, not wherever the script was started from (unless that is the root dir). A fit whose entries
all fit in memory writes no file; its store's folder, and the default folder itself when nothing
else is left in it, are removed at teardown so that no empty folders pile up. A ``cache_dir`` the
user names is theirs: only the empty store folders inside it go.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_FOLDER", "default_cache_dir", "remove_empty_folders"]

#: The default cache folder's name, under ``trainer.default_root_dir``.
DEFAULT_FOLDER = "pipetransformer_cache"


def default_cache_dir(default_root_dir: str) -> str:
    """The cache directory when ``cache_dir`` is not given."""
    return os.path.join(default_root_dir, DEFAULT_FOLDER)


def remove_empty_folders(cache: Any, default_root_dir: str | None, user_dir: str | None) -> list[Path]:
    """At teardown, after ``cache.close()``: the current store's folder if it holds no entry, and the
    default cache folder if that leaves it empty. Returns the folders removed.

    With several processes on a node, each tries once: a folder another process still uses stays.
    """
    removed = []
    store = getattr(cache, "store", None)
    if store is not None and store.remove_directory_if_empty():
        removed.append(Path(store.directory))
    if user_dir is None and default_root_dir is not None:
        root = Path(default_cache_dir(default_root_dir))
        try:
            root.rmdir()  # only when empty
            removed.append(root)
        except OSError:
            pass  # not empty (other runs' entries, another process's store), or already gone
    return removed
