"""The disk tier of an activation store: its directory, the lock held on it, and the entry files in it.

One :class:`DiskTier` per :class:`~lightning_pipetransformer.cache.store.ActivationStore`, which
decides what goes to disk; this tier writes and reads the files (one per entry, in the format of
:mod:`~lightning_pipetransformer.cache.entry_file`) and keeps what can go wrong there to itself:

- the directory is made 0700 and held under a shared ``flock`` while open
  (:mod:`~lightning_pipetransformer.cache.folders`), so that no other store deletes it meanwhile;
- the files in it are counted once, when it is opened, then kept as this process writes, reads and
  finds them gone, so that the store's statistics never walk the folder;
- a directory removed from outside is made again at the next write (``recreated``); a disk that is
  full (``ENOSPC``/``EDQUOT``) or refuses a write stops disk writes at this boundary with one
  warning (``unwritten`` counts the entries not written): they are recomputed when needed, exactly
  as without a cache;
- a file whose header does not match (another model, boundary or key) is a miss counted in
  ``rejected``, one whose bytes do not match their checksums in ``corrupt``; either is rewritten by
  the next write of that key.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from lightning_pipetransformer.cache.budget import CacheConfigError
from lightning_pipetransformer.cache.entry_file import (
    SUFFIX,
    CorruptEntryFile,
    encode,
    entry_path,
    header,
    key_of,
    read_entry,
    write_entry,
)
from lightning_pipetransformer.cache.folders import LOCKING, lock_directory, remove_directory, unlock
from lightning_pipetransformer.cache.kept import is_kept, mark_used
from lightning_pipetransformer.cache.store_stats import CacheStats

__all__ = ["DiskTier"]

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class DiskTier:
    """The entry files of one store's directory.

    Args:
        root: ``cache_dir``, made (0700) if missing.
        directory: this store's folder in it.
        fingerprint, boundary: what every file's header must name (:func:`~.entry_file.header`).
        storage_dtype: the activations' dtype on disk when the store fixes it (a file in another is refused).
        stats: the store's counters; this tier counts its refusals and failures there.
        warn: ``warn(reason, message)`` when the disk stops working fully (``"disk"``, ``"recreated"``).
        strict: whether a directory that cannot be made or written (other than a full disk) is a
            :class:`CacheConfigError`; ``False``: disk writes stop, with the warning, as for a full disk.
        keep: the folder is kept for later runs: marked used at each open and close, never deleted by :meth:`close`.
    """

    def __init__(
        self, root: Path, directory: Path, fingerprint: str, boundary: int, storage_dtype: torch.dtype | None,
        stats: CacheStats, warn: Callable[[str, str], None], *, strict: bool, keep: bool,
    ) -> None:
        self._lock: int | None = None  # first: __del__ reads it even if what follows raises
        self.root, self.directory = root, directory
        self.fingerprint, self.boundary, self.storage_dtype = fingerprint, boundary, storage_dtype
        self.strict, self.keep = strict, keep
        self._stats, self._warn = stats, warn
        self._bad: set[str] = set()  # keys whose file was rejected: the next write overwrites it
        # The entry files known to be in the directory (key -> bytes) and their total: the disk figures
        # of the store's stats, kept as this tier writes, reads and deletes, so that they never walk the folder.
        self._files: dict[str, int] = {}
        self.bytes = 0
        #: Why disk writes stopped at this boundary (a full disk), or ``None`` while they work.
        self.off: str | None = None
        self._make_directory()

    @property
    def files(self) -> int:
        """How many entry files this process knows to be in the directory."""
        return len(self._files)

    # ------------------------------------------------------------------ the directory

    def _make_directory(self) -> None:
        """Create the directory, hold its shared lock, and prove it writable.

        A full disk keeps the store to memory. Any other refusal is a configuration error when
        ``strict`` (a store made by hand); AutoCache checks ``cache_dir`` before training
        (:func:`~lightning_pipetransformer.cache.store.probe_cache_dir`) and opens each boundary's store with
        ``strict=False``: a disk that fails later (remounted read-only, permissions changed, an I/O error)
        stops disk writes and never training.
        """
        try:
            self._open_directory()
            # Probe: the only reliable writability test (root ignores mode bits, mounts may be read-only).
            probe = self.directory / f".probe-{os.getpid()}-{secrets.token_hex(4)}"
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            os.unlink(probe)
            if self.keep:
                mark_used(self.directory)
        except OSError as err:
            if err.errno in _NO_SPACE or not self.strict:
                self._stop(err)
                return
            raise CacheConfigError(
                f"cache_dir={str(self.root)!r} is not a writable directory ({type(err).__name__}: {err}). "
                "Pass a cache_dir on a local, writable disk (e.g. a folder under $TMPDIR), or cache=False."
            ) from None

    def _open_directory(self) -> None:
        """(Re)make ``cache_dir`` and this store's directory, and hold the shared lock on the latter."""
        unlock(self._lock)
        self._lock = None
        if not self.root.exists():
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.root, 0o700)  # mkdir's mode is masked by the umask
        self._lock = lock_directory(self.directory)
        self._count_directory()

    def _count_directory(self) -> None:
        """The one walk of the directory, when it is opened (a boundary's open, a reuse after :meth:`close`,
        a directory made again): the files already there (an earlier run's, another process's) start the
        disk counters, which this tier keeps from then on without walking it again."""
        found: dict[str, int] = {}
        try:
            with os.scandir(self.directory) as it:
                for item in it:
                    key = key_of(item.name)
                    if key is not None:
                        try:
                            found[key] = item.stat().st_size
                        except FileNotFoundError:  # removed by another process meanwhile
                            pass
        except OSError:  # gone or unreadable: its writes fail and say so
            pass
        self._files, self.bytes = found, sum(found.values())

    def hold(self) -> None:
        """Closed earlier and used again: hold the directory (made again if need be) while writing into it."""
        if self._lock is not None or not LOCKING or self.off is not None:
            return
        try:
            self._open_directory()
        except OSError as err:
            self._stop(err)

    def _stop(self, err: OSError) -> None:
        """Disk full (or a write refused): keep to memory at this boundary; warn once."""
        self.off = f"{type(err).__name__}: {err}"
        self._stats.disk_failures += 1
        self._warn(
            "disk",
            f"AutoCache stopped writing to {self.directory} ({self.off}). Entries that do not fit the memory "
            "budget are recomputed from now on at this boundary (exact, only slower; counted in autocache_diagnostics/unwritten). "
            "Free space in cache_dir (or make it writable again) or raise cache_memory.",
        )

    def _recreate(self, err: OSError) -> bool:
        """The directory was removed from outside (a cleaner, a user): make it again; ``False`` if that fails."""
        if self.directory.exists():
            return False  # something else is missing: not ours to fix
        self._forget_files()
        try:
            self._open_directory()
        except OSError:
            return False
        self._stats.recreated += 1
        if self.keep:
            mark_used(self.directory)
        self._warn(
            "recreated",
            f"AutoCache's directory {self.directory} was removed while in use ({err.strerror}); it was made again. "
            "The entries that were in it are recomputed when next needed (exact). Do not clean cache_dir during a run.",
        )
        return True

    def close(self, delete: bool | Literal["if_empty"]) -> bool:
        """Release the directory's lock; ``delete``: also delete it as
        :meth:`ActivationStore.close <lightning_pipetransformer.cache.store.ActivationStore.close>` says.
        Returns whether the directory is gone (``True`` when nothing was asked)."""
        if self.keep and self._lock is not None:
            mark_used(self.directory)  # its last use: eviction goes oldest first
        unlock(self._lock)
        self._lock = None
        if delete == "if_empty":
            try:
                if any(item.name.endswith(SUFFIX) for item in os.scandir(self.directory)):
                    return False
            except FileNotFoundError:
                self._forget_files()
                return True
        if not delete:
            return True
        if delete is True and (self.keep or is_kept(self.directory)):
            return False  # kept for later runs: eviction's to remove
        gone = remove_directory(self.directory)
        if gone:
            self._forget_files()
        return gone

    def __del__(self) -> None:
        # Not a way to let go (that is close()): a store dropped without it must not keep its lock.
        try:
            unlock(self._lock)
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to release
            pass

    # ------------------------------------------------------------------ the files

    def keys(self) -> list[str]:
        """The keys of every entry file in the directory now (all processes' files)."""
        found = []
        try:
            with os.scandir(self.directory) as it:
                for item in it:
                    key = key_of(item.name)
                    if key is not None:
                        found.append(key)
        except FileNotFoundError:
            pass
        return found

    def _note_file(self, key: str, size: int) -> None:
        self.bytes += size - self._files.get(key, 0)
        self._files[key] = size

    def _note_gone(self, key: str) -> None:
        self.bytes -= self._files.pop(key, 0)

    def _forget_files(self) -> None:
        """The directory is gone: so are the files the disk counters knew."""
        self._files, self.bytes = {}, 0

    def file_size(self, key: str) -> int | None:
        """The size of ``key``'s file (one ``stat``), or ``None`` if there is none; the disk counters follow what it finds."""
        try:
            size = os.stat(entry_path(self.directory, key)).st_size
        except FileNotFoundError:
            self._note_gone(key)
            return None
        self._note_file(key, size)
        return size

    def write(self, key: str, hidden: Tensor, original: torch.dtype, extras: Mapping[str, Tensor]) -> bool:
        """Write one entry's file; ``True`` if it is on disk (now or already), ``False`` if it could not be.

        A directory removed from outside is made again once (``recreated``); any other failure
        (a full disk above all) stops disk writes at this boundary, with one warning: the entry is
        then simply not cached (``unwritten``), never a crash.
        """
        if self.off is not None:
            self._stats.unwritten += 1
            return False
        if key not in self._bad and self.file_size(key) is not None:
            return True  # written by another process (same fingerprint: same bytes)
        data = encode(header(self.fingerprint, self.boundary, key), hidden, original, extras)
        for attempt in range(2):
            try:
                write_entry(self.directory, key, data)
                self._note_file(key, len(data))
                break
            except FileNotFoundError as err:
                if attempt or not self._recreate(err):
                    self._stop(err)
                    self._stats.unwritten += 1
                    return False
            except OSError as err:
                self._stop(err)
                self._stats.unwritten += 1
                return False
        self._bad.discard(key)
        return True

    def read(self, key: str, with_extras: bool) -> tuple[Tensor, torch.dtype, dict[str, Tensor]] | None:
        """The entry from disk: its activation in the storage dtype, the original dtype and (only
        ``with_extras``) the extras; ``None`` when missing, rejected or corrupt."""
        if self.file_size(key) is None:
            return None
        try:
            hidden, original, extras = read_entry(entry_path(self.directory, key), header(self.fingerprint, self.boundary, key), with_extras)
        except CorruptEntryFile:
            self._stats.corrupt += 1
            self._bad.add(key)
            return None
        except Exception:  # noqa: BLE001 - any unreadable file is a miss, never an error or a wrong hit
            if self.file_size(key) is not None:
                self._stats.rejected += 1
                self._bad.add(key)
            return None
        if self.storage_dtype is not None and hidden.dtype != self.storage_dtype:
            self._stats.rejected += 1
            self._bad.add(key)
            return None
        return hidden, original, extras
