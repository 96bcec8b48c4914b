"""The cache's folders: where a fit's files go by default, who may delete a store's folder, and the
empty folders removed when the fit ends.

Several stores (runs, processes) may share one folder: each holds a shared ``flock`` on it while
open (:func:`lock_directory`), and :func:`remove_directory` deletes it only under a non-blocking
exclusive lock, so one run's boundary advance never deletes a folder another run still reads or
writes. Without ``fcntl`` (not POSIX) folders are shared without locks.

The default ``cache_dir`` is ``<trainer.default_root_dir>/pipetransformer_cache``: beside the run's
logs, not wherever the script was started from (unless that is the root dir). A fit whose entries
all fit in memory writes no file; its store's folder, and the default folder itself when nothing
else is left in it, are removed at teardown so that no empty folders pile up. A ``cache_dir`` the
user names is theirs: only the empty store folders inside it go.
"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: directories are shared without locks
    fcntl = None  # type: ignore[assignment]

__all__ = ["DEFAULT_FOLDER", "LOCKING", "default_cache_dir", "lock_directory", "remove_directory", "remove_empty_folders", "unlock"]

#: Whether folders are locked while in use (POSIX ``flock``).
LOCKING = fcntl is not None

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
    if store is not None and store.close(delete="if_empty"):
        removed.append(Path(store.directory))
    if user_dir is None and default_root_dir is not None:
        root = Path(default_cache_dir(default_root_dir))
        try:
            root.rmdir()  # only when empty
            removed.append(root)
        except OSError:
            pass  # not empty (other runs' entries, another process's store), or already gone
    return removed


#: Descriptors of the directory locks this process holds: closed in forked children (DataLoader
#: workers), whose inherited copies would otherwise keep the lock after the store released it.
_LOCK_FDS: set[int] = set()


def _close_inherited_locks() -> None:
    for fd in list(_LOCK_FDS):
        try:
            os.close(fd)
        except OSError:
            pass
    _LOCK_FDS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_locks)


def _same_file(path: Path, fd: int) -> bool:
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def lock_directory(directory: Path) -> int | None:
    """Make ``directory`` (0700) if missing and hold a shared lock on it; return the lock's descriptor.

    The shared lock is what stops another store's ``ActivationStore.close(delete=True)`` from deleting the
    directory while this one uses it. A deleter renames the directory away under its exclusive
    lock, so a lock won after that is on a dead directory: the path then shows another inode (or
    none), and this tries again with a fresh one. ``None`` without ``fcntl`` (no locking).
    """
    for _ in range(100):
        try:
            directory.mkdir(mode=0o700)
            os.chmod(directory, 0o700)  # mkdir's mode is masked by the umask
        except FileExistsError:
            pass
        if fcntl is None:
            return None
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            continue  # removed between mkdir and open
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if _same_file(directory, fd):
                _LOCK_FDS.add(fd)
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise OSError(errno.EAGAIN, f"{directory} was removed each time it was made", str(directory))


def unlock(fd: int | None) -> None:
    if fd is not None and fd in _LOCK_FDS:
        _LOCK_FDS.discard(fd)
        os.close(fd)  # releases the flock (this process's last reference to it)


def remove_directory(directory: Path) -> bool:
    """Delete ``directory`` unless a store holds it open; ``True`` if it is gone.

    Takes the exclusive lock without waiting: a shared lock held by any store (this process's
    or another run's) means it is in use, and it is left for its last user to delete.
    """
    if fcntl is None:
        fd = None
    else:
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return True
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            if not _same_file(directory, fd):
                return False  # replaced meanwhile by a directory someone else made: not ours to delete
        # Renamed first: openers from now on make a fresh directory, never one being emptied.
        grave = directory.with_name(f".{directory.name}.removed-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.rename(directory, grave)
        except FileNotFoundError:
            return True
        for name in os.listdir(grave):
            try:
                os.unlink(grave / name)
            except FileNotFoundError:
                pass
        try:
            grave.rmdir()
        except OSError:  # a writer without a lock put a file in meanwhile: a hidden leftover, harmless
            pass
        return True
    finally:
        if fd is not None:
            os.close(fd)
