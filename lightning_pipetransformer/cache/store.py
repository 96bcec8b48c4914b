"""The activation store: per sample key, the activation at the frozen boundary, in host memory then on disk.

One :class:`ActivationStore` serves one frozen prefix, named by its fingerprint
(:func:`~lightning_pipetransformer.cache.validity.prefix_fingerprint`) and boundary. Layout::

    cache_dir/                                  (0700 when created here)
      <fingerprint>-b<boundary>-<storage>/      one directory per prefix (0700)
        <key>.safetensors                       one file per sample (0600)

Memory first, then disk: an entry goes to host memory while the entries held there fit in
``memory_budget`` bytes, otherwise to disk. Nothing is evicted, because training reads every
sample once per epoch in a new order: for that scan, keeping a fixed set in memory hits as
often as any eviction policy and never rewrites a file. Memory therefore never exceeds the
budget. With ``write_through=True`` every entry also goes to disk, so the other processes of
the node (data-parallel replicas, replicas added later by AutoDP) see all of it.

Files are safetensors: a JSON header and raw little-endian tensors, read through a memory map.
No pickle anywhere, so opening a cache directory cannot run code. The header's metadata repeats
the format, version, fingerprint, boundary, key and original dtype; an entry whose metadata does
not match what this store expects (another model, another boundary, a renamed or foreign file)
is a miss and is counted in ``stats().rejected``, never returned. Writers write a unique
temporary name and ``os.replace`` it into place, so concurrent writers of one key are safe (both
write the same bytes) and a reader sees a whole file or none.

Every file carries a CRC-32 of each tensor's bytes in its header (``crc32.<name>``), checked
on every read from disk: a file whose bytes changed under an intact header (a torn write, a bad
sector, a tool that rewrote it) is a miss, counted in ``stats().corrupt``, and the next store
rewrites it. Entries in this process's memory are not checked on each hit: they never left the
process, and hashing 3 MiB per batch would cost about as much as the lookup itself (measured in
``docs/cache.md``). Non-finite activations (NaN, inf) are never stored (``stats().nonfinite``):
one bad step would otherwise be replayed every epoch under index keys.

Several stores (runs, processes) may share one directory: each holds a shared ``flock`` on it
while open, and :meth:`ActivationStore.close` with ``delete=True`` deletes it only under a
non-blocking exclusive lock (:mod:`~lightning_pipetransformer.cache.folders`), so one run's boundary
advance never deletes a directory another run still reads or writes.
A directory removed from outside is recreated at the next write (``stats().recreated``). A disk
that is full (``ENOSPC``/``EDQUOT``) or refuses a write stops disk writes at this boundary with
one warning (``stats().unwritten`` counts the entries not written): they are recomputed when
needed, exactly as without a cache.

With ``keep=True`` (``cache_keep``) the entries are for later runs too: every entry is written to disk (write-through),
the folder is marked kept (:mod:`~lightning_pipetransformer.cache.kept`) and :meth:`ActivationStore.close` never deletes
it (nor does a store that does not keep, sharing it); eviction by size and last use does.

Storage dtype is the activation's own by default (exact). ``storage_dtype=torch.bfloat16`` or
``torch.float16`` halves memory and disk but is *lossy*: the active blocks then see rounded
inputs and cache-on does not equal cache-off bit for bit: an option of the store alone (the strategy
stores exact activations). Extra per-sample tensors
stored with an entry (the block inputs needed to advance it, see :mod:`~lightning_pipetransformer.cache.arguments`) are kept
in their own dtype.
"""

from __future__ import annotations

import cmath
import errno
import os
import secrets
import tempfile
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_save
from torch import Tensor

from lightning_pipetransformer.cache.budget import CacheConfigError, check_batch_fits
from lightning_pipetransformer.cache.folders import LOCKING, lock_directory, remove_directory, unlock
from lightning_pipetransformer.cache.kept import folder_name, is_kept, mark_used
from lightning_pipetransformer.cache.keys import KEY_PATTERN
from lightning_pipetransformer.cache.validity import FORMAT_VERSION
from lightning_pipetransformer.warn_once import WarnOnce

__all__ = [
    "ActivationStore",
    "CacheConfigError",
    "CacheStats",
    "StoredEntry",
    "check_batch_fits",
    "checksum",
    "probe_cache_dir",
]

_FORMAT = "pipetransformer-activation"
_SUFFIX = ".safetensors"
_HIDDEN = "hidden"
_EXTRA = "x."  # prefix of extra tensors' names inside a file
_LOWER_PRECISION = (torch.bfloat16, torch.float16)
_CHECKSUM = "crc32."  # header metadata: crc32.<tensor name> = the CRC-32 of that tensor's bytes
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def probe_cache_dir(cache_dir: str) -> None:
    """Fail before training if ``cache_dir`` cannot hold cache files (checked by writing, as root ignores modes)."""
    try:
        os.makedirs(cache_dir, mode=0o700, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache_dir, prefix=".probe-"):
            pass
    except OSError as err:
        raise CacheConfigError(
            f"cache_dir={cache_dir!r} is not a writable directory ({err}). Pass a writable, node-local "
            "cache_dir, or cache=False."
        ) from None


@dataclass
class CacheStats:
    """Counters since construction, all kept in memory: reading them walks no folder (the progress bar reads
    them every step).

    ``files_on_disk``/``bytes_on_disk``: the entry files of this prefix's directory that this process
    knows of: those in it when the store opened it, then each file it wrote, read, found written by
    another process, or found gone. Alone in the directory, that is all of them; with several
    processes of a node sharing it, another's files count once this process meets them.
    """

    hits: int = 0
    misses: int = 0
    memory_hits: int = 0
    disk_hits: int = 0
    rejected: int = 0
    #: Files whose bytes did not match their checksum: a miss, recomputed and rewritten.
    corrupt: int = 0
    stored: int = 0
    #: Samples whose activation held NaN or inf: never stored, recomputed every time.
    nonfinite: int = 0
    #: Entries that should have gone to disk but did not (disk full, write refused): recomputed when needed.
    unwritten: int = 0
    #: Times this store's directory had been removed from outside and was made again.
    recreated: int = 0
    #: Times the disk failed this store (full, read-only, permission, I/O error): disk writes stopped.
    disk_failures: int = 0
    entries_in_memory: int = 0
    bytes_in_memory: int = 0
    files_on_disk: int = 0
    bytes_on_disk: int = 0

    @property
    def hit_rate(self) -> float:
        looked = self.hits + self.misses
        return self.hits / looked if looked else 0.0

    def as_metrics(self, prefix: str = "autocache/") -> dict[str, float]:
        """Flat float metrics for ``logger.log_metrics``."""
        out = {f"{prefix}{k}": float(v) for k, v in asdict(self).items()}
        out[f"{prefix}hit_rate"] = self.hit_rate
        return out


@dataclass
class StoredEntry:
    """One sample: its boundary activation (in the original dtype) and the extra tensors stored with it."""

    hidden: Tensor
    extras: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class _Entry:
    hidden: Tensor  # in the storage dtype
    dtype: torch.dtype  # the original one, restored on lookup
    extras: dict[str, Tensor]
    nbytes: int


def checksum(tensor: Tensor) -> str:
    """The CRC-32 of ``tensor``'s bytes as a file stores them (8 hex digits).

    CRC-32 because it is the cheapest stdlib hash that catches what happens to files (any burst
    of up to 32 flipped bits, any overwritten run with probability 1 - 2**-32): ~2 GB/s, ~45 us
    for a 96 KiB activation, against ~5x that for BLAKE2b (``benchmarks/cache_store``). It is
    not a defence against someone who can write the directory (0700): they could write any file.
    """
    flat = tensor.detach().contiguous().reshape(-1)
    return f"{zlib.crc32(flat.view(torch.uint8).numpy()):08x}"


def _finite(row: Tensor) -> bool:
    """Whether every element of one sample's activation is finite.

    A sum is non-finite when any element is (NaN and inf propagate) and otherwise only on
    overflow, so one summing pass clears almost every row (``torch.isfinite`` over the elements
    was ~15x slower on CPU); a flagged row is then checked element by element. Per row, not one
    reduction over the batch: that one runs on torch's thread pool, and its spinning workers
    made the row copies that follow it 2-4x slower on a busy 2-core machine.
    """
    if not (row.is_floating_point() or row.is_complex()):
        return True
    wide = torch.float32 if row.is_floating_point() and row.element_size() < 4 else None
    total = row.sum(dtype=wide).item()  # tested in Python: a 0-d torch.isfinite alone took ~50 us
    return cmath.isfinite(total) or bool(torch.isfinite(row).all())


def _key_of(name: str) -> str | None:
    """The key an entry file's name holds, or ``None`` for any other file (a temporary, a probe)."""
    if not name.endswith(_SUFFIX):
        return None
    key = name[: -len(_SUFFIX)]
    return key if KEY_PATTERN.match(key) else None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_keys(keys: Sequence[str]) -> None:
    for key in keys:
        if not isinstance(key, str) or not KEY_PATTERN.match(key):
            raise ValueError(
                f"Invalid cache key {key!r}: keys become file names; use content_keys() or index_keys()."
            )


class ActivationStore:
    """Activations at one frozen boundary, keyed by sample, bounded in host memory, spilled to disk.

    Args:
        cache_dir: directory shared by the node's processes; created (0700) if missing.
        fingerprint: the frozen prefix's :func:`~lightning_pipetransformer.cache.validity.prefix_fingerprint`.
        boundary: the number of frozen blocks F the activations come out of.
        memory_budget: host bytes for entries (activations + extras) held in memory; ``0``
            keeps everything on disk. A positive budget below one batch raises at the first
            :meth:`store` (see :func:`check_batch_fits` to fail earlier).
        storage_dtype: ``None`` stores the activation's dtype (exact); ``torch.bfloat16`` or
            ``torch.float16`` is a lossy, opt-in halving of the bytes.
        write_through: also write entries kept in memory to disk, so other processes see them.
        warn: ``warn(reason, message)``, called each time something stops the store from working
            fully (``reason``: ``"disk"`` full, directory ``"recreated"``, ``"nonfinite"``
            activations): the caller decides what to say once (AutoCache: once per run, over the
            stores of all its boundaries). Default: each reason said once by this store.
        strict: whether a directory that cannot be made or written (other than a full disk) is a
            :class:`CacheConfigError`; ``False``: disk writes stop, with the warning, as for a full disk.
        keep: the entries outlive the run (``cache_keep``): all written to disk (``write_through``), the folder
            marked kept, never deleted by :meth:`close` (only evicted, :mod:`~lightning_pipetransformer.cache.kept`).

    The store holds a shared lock on its directory from construction until :meth:`close`
    (or garbage collection): while it does, no other store deletes that directory.

    Raises:
        CacheConfigError: ``cache_dir`` cannot be created or written (with ``strict``), or a bad
            argument. A full disk is not an error: the store then keeps to memory (see the module docstring).
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        fingerprint: str,
        boundary: int,
        memory_budget: int,
        *,
        storage_dtype: torch.dtype | None = None,
        write_through: bool = False,
        warn: Callable[[str, str], None] | None = None,
        strict: bool = True,
        keep: bool = False,
    ) -> None:
        self._lock: int | None = None  # first: __del__ reads it even if a check below raises
        if not isinstance(fingerprint, str) or not KEY_PATTERN.match(fingerprint):
            raise CacheConfigError(f"fingerprint must be a hex string from prefix_fingerprint(), got {fingerprint!r}.")
        if isinstance(boundary, bool) or not isinstance(boundary, int) or boundary < 0:
            raise CacheConfigError(f"boundary must be a non-negative int (frozen blocks), got {boundary!r}.")
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget < 0:
            raise CacheConfigError(f"memory_budget must be a non-negative int of bytes, got {memory_budget!r}.")
        if storage_dtype is not None and storage_dtype not in _LOWER_PRECISION:
            raise CacheConfigError(
                f"storage_dtype must be None (the activation's dtype) or one of "
                f"{[_dtype_name(d) for d in _LOWER_PRECISION]}, got {storage_dtype!r}."
            )
        self.fingerprint = fingerprint
        self.boundary = boundary
        self.memory_budget = memory_budget
        self.storage_dtype = storage_dtype
        self.keep = keep
        # Kept entries are for other runs: they must be on disk, whatever fits in this run's memory.
        self.write_through = write_through or keep
        storage = _dtype_name(storage_dtype) if storage_dtype is not None else "native"
        self.root = Path(cache_dir)
        self.directory = self.root / folder_name(fingerprint, boundary, storage)
        self._mem: dict[str, _Entry] = {}
        self._mem_bytes = 0
        self._reserved = 0  # see reserve()
        self._bad: set[str] = set()  # keys whose file was rejected: the next store overwrites it
        self._stats = CacheStats()
        # The entry files known to be in the directory (key -> bytes) and their total: the disk figures
        # of stats(), kept as this store writes, reads and deletes, so that stats() never walks the folder.
        self._disk: dict[str, int] = {}
        self._disk_bytes = 0
        # Once per reason and store, whoever listens: a batch of 10,000 NaN rows is one warning.
        said = WarnOnce() if warn is None else WarnOnce(lambda message, stacklevel: None)

        def warn_once(reason: str, message: str) -> None:
            if said(reason, message, stacklevel=4) and warn is not None:
                warn(reason, message)

        self._warn = warn_once
        #: Why disk writes stopped at this boundary (a full disk), or ``None`` while they work.
        self._disk_off: str | None = None
        self.strict = strict
        self._make_directory()

    # ------------------------------------------------------------------ set-up

    def _make_directory(self) -> None:
        """Create the directory, hold its shared lock, and prove it writable.

        A full disk keeps the store to memory. Any other refusal is a configuration error when
        ``strict`` (a store made by hand); AutoCache checks ``cache_dir`` before training
        (:func:`probe_cache_dir`) and opens each boundary's store with ``strict=False``: a disk that
        fails later (remounted read-only, permissions changed, an I/O error) stops disk writes and
        never training.
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
                self._stop_disk(err)
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
        disk counters, which the store keeps from then on without walking it again."""
        found: dict[str, int] = {}
        try:
            with os.scandir(self.directory) as it:
                for item in it:
                    key = _key_of(item.name)
                    if key is not None:
                        try:
                            found[key] = item.stat().st_size
                        except FileNotFoundError:  # removed by another process meanwhile
                            pass
        except OSError:  # gone or unreadable: its writes fail and say so
            pass
        self._disk, self._disk_bytes = found, sum(found.values())

    def _note_file(self, key: str, size: int) -> None:
        self._disk_bytes += size - self._disk.get(key, 0)
        self._disk[key] = size

    def _note_gone(self, key: str) -> None:
        self._disk_bytes -= self._disk.pop(key, 0)

    def _file_size(self, key: str) -> int | None:
        """The size of ``key``'s file (one ``stat``), or ``None`` if there is none; the disk counters follow what it finds."""
        try:
            size = os.stat(self._path(key)).st_size
        except FileNotFoundError:
            self._note_gone(key)
            return None
        self._note_file(key, size)
        return size

    def _relock(self) -> None:
        try:
            self._open_directory()
        except OSError as err:
            self._stop_disk(err)

    def _stop_disk(self, err: OSError) -> None:
        """Disk full (or a write refused): keep to memory at this boundary; warn once."""
        self._disk_off = f"{type(err).__name__}: {err}"
        self._stats.disk_failures += 1
        self._warn(
            "disk",
            f"AutoCache stopped writing to {self.directory} ({self._disk_off}). Entries that do not fit the memory "
            "budget are recomputed from now on at this boundary (exact, only slower; counted in autocache_diagnostics/unwritten). "
            "Free space in cache_dir (or make it writable again) or raise cache_memory.",
        )

    def reserve(self, nbytes: int) -> None:
        """Keep ``nbytes`` of the budget for entries other stores still hold in memory (an earlier
        boundary's, not advanced yet): new entries go to memory only within what is left."""
        self._reserved = nbytes

    # ------------------------------------------------------------------ the batch API

    def lookup(
        self,
        keys: Sequence[str],
        *,
        sample_shape: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Find ``keys``; return ``(hit_mask, hits)``.

        ``hit_mask`` is a CPU bool tensor ``[len(keys)]``; ``hits`` stacks the hits' activations
        in key order, ``[hit_mask.sum(), *sample_shape]``, in ``dtype`` (default: the stored
        entries' original dtype) on ``device`` (default CPU). An entry whose shape differs from
        ``sample_shape`` (or from the first hit's) is a miss: index keys with dynamic padding.
        """
        _check_keys(keys)
        want = tuple(sample_shape) if sample_shape is not None else None
        hit_mask = torch.zeros(len(keys), dtype=torch.bool)
        rows: list[Tensor] = []
        out_dtype = dtype
        for i, key in enumerate(keys):
            mem = self._mem.get(key)
            if mem is not None:
                row, original, where = mem.hidden, mem.dtype, "memory"
            else:
                found = self._read(key, with_extras=False)
                if found is None:
                    self._stats.misses += 1
                    continue
                row, original, where = found.hidden, found.dtype, "disk"
            if want is None:
                want = tuple(row.shape)
            if tuple(row.shape) != want:
                self._stats.misses += 1
                self._stats.rejected += 1
                continue
            out_dtype = out_dtype or original
            hit_mask[i] = True
            rows.append(row)
            self._stats.hits += 1
            if where == "memory":
                self._stats.memory_hits += 1
            else:
                self._stats.disk_hits += 1
        out_dtype = out_dtype or torch.float32
        target = torch.device(device) if device is not None else torch.device("cpu")
        if not rows:
            return hit_mask, torch.empty((0, *(want or ())), dtype=out_dtype, device=target)
        if target.type == "cuda" and all(r.dtype == out_dtype for r in rows):
            # Stack into pinned memory so the copy to the device is asynchronous.
            staged = torch.empty((len(rows), *want), dtype=out_dtype, pin_memory=True)  # type: ignore[misc]
            torch.stack(rows, out=staged)
            return hit_mask, staged.to(target, non_blocking=True)
        return hit_mask, torch.stack(rows).to(device=target, dtype=out_dtype)

    def store(
        self, keys: Sequence[str], activations: Tensor, extras: Mapping[str, Tensor] | None = None, check_fits: bool = True,
    ) -> None:
        """Store one activation per key (row ``i`` of ``activations`` and of each ``extras`` tensor).

        Keys already held (in memory, or on disk by any process) are skipped. ``extras`` are
        per-sample tensors kept with the entry in their own dtype (e.g. the attention mask the
        next blocks need, to advance the entry later). ``check_fits``: refuse a batch larger than
        a positive budget (:func:`check_batch_fits`); off for groups that are not a training batch.
        """
        _check_keys(keys)
        extras = dict(extras or {})
        if activations.shape[0] != len(keys) or any(t.shape[0] != len(keys) for t in extras.values()):
            raise ValueError(
                f"store() got {len(keys)} keys but activations/extras with first dimensions "
                f"{[activations.shape[0], *(t.shape[0] for t in extras.values())]}: give one row per key."
            )
        for name in extras:
            if not KEY_PATTERN.match(name):
                raise ValueError(f"Extra tensor name {name!r}: use letters, digits, '_', '-' or '.'.")
        if not keys:
            return
        original = activations.dtype
        host = activations.detach().to("cpu", dtype=self.storage_dtype or original)
        host_extras = {n: t.detach().to("cpu") for n, t in extras.items()}
        if check_fits:
            check_batch_fits(self.memory_budget, host.nbytes + sum(t.nbytes for t in host_extras.values()))
        if self._lock is None and LOCKING and self._disk_off is None:
            self._relock()  # closed earlier and used again: hold the directory while writing into it
        for i, key in enumerate(keys):
            if key in self._mem:
                continue
            if not _finite(host[i]):  # in the storage dtype: a finite fp32 value may overflow fp16
                self._skip_nonfinite(key)
                continue
            # Clone: a row view would keep the whole batch's storage alive.
            hidden = host[i].clone()
            row_extras = {n: t[i].clone() for n, t in host_extras.items()}
            nbytes = hidden.nbytes + sum(t.nbytes for t in row_extras.values())
            in_memory = self.memory_budget > 0 and self._mem_bytes + nbytes <= self.memory_budget - self._reserved
            if in_memory:
                self._mem[key] = _Entry(hidden, original, row_extras, nbytes)
                self._mem_bytes += nbytes
            written = (not in_memory or self.write_through) and self._write(key, hidden, original, row_extras)
            if in_memory or written:
                self._stats.stored += 1

    def _skip_nonfinite(self, key: str) -> None:
        """Never keep a NaN/inf activation: replayed from the cache, one bad step would recur every epoch."""
        self._stats.nonfinite += 1
        self._warn(
            "nonfinite",
            f"AutoCache did not store a non-finite (NaN/inf) activation at boundary {self.boundary} (key {key}): such "
            "samples are recomputed each time they come (counted in autocache_diagnostics/nonfinite). Check the inputs and the "
            "frozen blocks if this was not expected.",
        )

    # ------------------------------------------------------------------ entries one by one

    def read(self, key: str) -> StoredEntry | None:
        """The whole entry for ``key`` (activation in its original dtype, extras), or ``None``."""
        _check_keys([key])
        mem = self._mem.get(key)
        if mem is not None:
            # Copies: the caller may modify what it gets without touching the memory entry.
            return StoredEntry(mem.hidden.to(mem.dtype, copy=True), {n: t.clone() for n, t in mem.extras.items()})
        found = self._read(key, with_extras=True)
        if found is None:
            return None
        return StoredEntry(found.hidden.to(found.dtype), found.extras)

    def keys(self) -> list[str]:
        """Every key this process can read: its memory and the directory (all processes' files)."""
        found = dict.fromkeys(self._mem)
        try:
            with os.scandir(self.directory) as it:
                for item in it:
                    key = _key_of(item.name)
                    if key is not None:
                        found.setdefault(key)
        except FileNotFoundError:
            pass
        return list(found)

    def discard(self, keys: Sequence[str]) -> None:
        """Drop ``keys`` from memory (their disk files stay): frees the budget while advancing."""
        for key in keys:
            entry = self._mem.pop(key, None)
            if entry is not None:
                self._mem_bytes -= entry.nbytes

    def in_memory(self, key: str) -> bool:
        return key in self._mem

    def holds(self, key: str) -> bool:
        """Whether ``key`` has an entry (memory, or one ``stat`` of its file)."""
        return key in self._mem or self.on_disk(key)

    def count_as_hits(self, memory: int, disk: int) -> None:
        """Lookups this store missed that an earlier boundary's store answered (a lazy advance): hits of the cache."""
        self._stats.misses -= memory + disk
        self._stats.hits += memory + disk
        self._stats.memory_hits += memory
        self._stats.disk_hits += disk

    @property
    def bytes_in_memory(self) -> int:
        """Bytes of the entries held in memory (no directory scan, unlike :meth:`stats`)."""
        return self._mem_bytes

    def on_disk(self, key: str) -> bool:
        return self._file_size(key) is not None

    def stats(self) -> CacheStats:
        """A snapshot of the counters (:class:`CacheStats`), from memory: no folder walk, no ``stat``."""
        snap = CacheStats(**asdict(self._stats))
        snap.entries_in_memory, snap.bytes_in_memory = len(self._mem), self._mem_bytes
        snap.files_on_disk, snap.bytes_on_disk = len(self._disk), self._disk_bytes
        return snap

    def close(self, delete: bool | Literal["if_empty"] = False) -> bool:
        """Let go of this store: drop its memory entries and release the directory's lock (its files stay
        for other stores); returns whether the directory is gone (``True`` when nothing was asked).

        ``delete=True``: also delete this prefix's directory, unless another store (another run on
        the same frozen weights, a process of this node that has not closed its store yet) holds its
        lock: it is then left for the last one to delete; and never a kept folder (``keep``, or marked
        kept by another run's store): that one goes only by eviction. With several processes, close every store
        before one of them deletes (the strategy's barrier). ``delete="if_empty"`` (the end of a
        fit): the memory entries stay readable (validate/test after fit) and the directory goes only
        if it holds no entry file. The store stays usable: a later write takes the lock again (and
        makes the directory again).
        """
        if delete != "if_empty":
            self._mem.clear()
            self._mem_bytes = 0
        if self.keep and self._lock is not None:
            mark_used(self.directory)  # its last use: eviction goes oldest first
        unlock(self._lock)
        self._lock = None
        if delete == "if_empty":
            try:
                if any(item.name.endswith(_SUFFIX) for item in os.scandir(self.directory)):
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

    def _forget_files(self) -> None:
        """The directory is gone: so are the files the disk counters knew."""
        self._disk, self._disk_bytes = {}, 0

    def __del__(self) -> None:
        # Not a way to let go (that is close()): a store dropped without it must not keep its lock.
        try:
            unlock(self._lock)
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to release
            pass

    # ------------------------------------------------------------------ files

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}{_SUFFIX}"

    def _write(self, key: str, hidden: Tensor, original: torch.dtype, extras: Mapping[str, Tensor]) -> bool:
        """Write one entry's file; ``True`` if it is on disk (now or already), ``False`` if it could not be.

        A directory removed from outside is made again once (``recreated``); any other failure
        (a full disk above all) stops disk writes at this boundary, with one warning: the entry is
        then simply not cached (``unwritten``), never a crash.
        """
        if self._disk_off is not None:
            self._stats.unwritten += 1
            return False
        if key not in self._bad and self._file_size(key) is not None:
            return True  # written by another process (same fingerprint: same bytes)
        tensors = {_HIDDEN: hidden.contiguous(), **{_EXTRA + n: t.contiguous() for n, t in extras.items()}}
        metadata = {
            **self._header(key),
            "dtype": _dtype_name(original),
            **{_CHECKSUM + name: checksum(t) for name, t in tensors.items()},
        }
        data = safetensors_save(tensors, metadata=metadata)
        for attempt in range(2):
            try:
                self._write_file(key, data)
                self._note_file(key, len(data))
                break
            except FileNotFoundError as err:
                if attempt or not self._recreate(err):
                    self._stop_disk(err)
                    self._stats.unwritten += 1
                    return False
            except OSError as err:
                self._stop_disk(err)
                self._stats.unwritten += 1
                return False
        self._bad.discard(key)
        return True

    def _write_file(self, key: str, data: bytes) -> None:
        tmp = self.directory / f".{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(key))  # atomic: readers see the old file, the new one, or none
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

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

    def _header(self, key: str) -> dict[str, str]:
        """What a file's metadata says about where it belongs: written with every entry, matched on every read."""
        return {
            "format": _FORMAT,
            "version": str(FORMAT_VERSION),
            "fingerprint": self.fingerprint,
            "boundary": str(self.boundary),
            "key": key,
        }

    def _read(self, key: str, with_extras: bool) -> _Entry | None:
        """The entry from disk (activation in the storage dtype; extras only ``with_extras``), or ``None``
        (missing, rejected or corrupt)."""
        path = self._path(key)
        if self._file_size(key) is None:
            return None
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                expected = self._header(key)
                if any(meta.get(k) != v for k, v in expected.items()):
                    raise ValueError(f"metadata {meta} does not match {expected}")
                original = getattr(torch, meta.get("dtype", ""), None)
                if not isinstance(original, torch.dtype):
                    raise ValueError(f"unknown dtype {meta.get('dtype')!r}")
                names = [_HIDDEN, *(n for n in f.keys() if n.startswith(_EXTRA))] if with_extras else [_HIDDEN]
                tensors = {n: f.get_tensor(n) for n in names}
        except Exception:  # noqa: BLE001 - any unreadable file is a miss, never an error or a wrong hit
            if self._file_size(key) is not None:
                self._stats.rejected += 1
                self._bad.add(key)
            return None
        # The bytes this read returns are exactly the ones checked (the memory map is copied by get_tensor).
        if any(meta.get(_CHECKSUM + n) != checksum(t) for n, t in tensors.items()):
            self._stats.corrupt += 1
            self._bad.add(key)
            return None
        hidden = tensors[_HIDDEN]
        if self.storage_dtype is not None and hidden.dtype != self.storage_dtype:
            self._stats.rejected += 1
            self._bad.add(key)
            return None
        extras = {n[len(_EXTRA) :]: t for n, t in tensors.items() if n != _HIDDEN}
        return _Entry(hidden, original, extras, hidden.nbytes + sum(t.nbytes for t in extras.values()))
