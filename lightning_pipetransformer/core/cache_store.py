"""The activation store: per sample key, the activation at the frozen boundary, in host memory then on disk.

One :class:`ActivationStore` serves one frozen prefix, named by its fingerprint
(:func:`~.cache_validity.prefix_fingerprint`) and boundary. Layout::

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

Storage dtype is the activation's own by default (exact). ``storage_dtype=torch.bfloat16`` or
``torch.float16`` halves memory and disk but is *lossy*: the active blocks then see rounded
inputs and cache-on no longer equals cache-off bit for bit. Opt-in only. Extra per-sample tensors
stored with an entry (the block inputs needed to advance it, see :mod:`.cache_advance`) are kept
in their own dtype.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_save
from torch import Tensor

from .cache_keys import KEY_PATTERN
from .cache_validity import FORMAT_VERSION

__all__ = ["ActivationStore", "CacheConfigError", "CacheStats", "StoredEntry", "check_batch_fits", "merge_rows"]

_FORMAT = "pipetransformer-activation"
_SUFFIX = ".safetensors"
_HIDDEN = "hidden"
_EXTRA = "x."  # prefix of extra tensors' names inside a file
_LOWER_PRECISION = (torch.bfloat16, torch.float16)


class CacheConfigError(ValueError):
    """The cache cannot work as configured (directory not writable, budget below one batch)."""


def check_batch_fits(memory_budget: int, nbytes: int) -> None:
    """Raise :class:`CacheConfigError` if one batch of ``nbytes`` cannot fit in a positive ``memory_budget``."""
    if 0 < memory_budget < nbytes:
        raise CacheConfigError(
            f"The cache's memory budget ({memory_budget:,} bytes: cache_memory= on the strategy, memory_budget= "
            f"on the store) is smaller than one batch of activations ({nbytes:,} bytes). Raise it to at least "
            f"{nbytes:,} bytes (a whole epoch needs batches x that), or set it to 0 to keep the cache on disk only."
        )


@dataclass
class CacheStats:
    """Counters since construction (``bytes_on_disk``/``files_on_disk``: this prefix's directory, all processes)."""

    hits: int = 0
    misses: int = 0
    memory_hits: int = 0
    disk_hits: int = 0
    rejected: int = 0
    stored: int = 0
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
class _MemEntry:
    hidden: Tensor  # in the storage dtype
    dtype: torch.dtype  # the original one, restored on lookup
    extras: dict[str, Tensor]
    nbytes: int


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
        fingerprint: the frozen prefix's :func:`~.cache_validity.prefix_fingerprint`.
        boundary: the number of frozen blocks F the activations come out of.
        memory_budget: host bytes for entries (activations + extras) held in memory; ``0``
            keeps everything on disk. A positive budget below one batch raises at the first
            :meth:`store` (see :meth:`check_batch_fits` to fail earlier).
        storage_dtype: ``None`` stores the activation's dtype (exact); ``torch.bfloat16`` or
            ``torch.float16`` is a lossy, opt-in halving of the bytes.
        write_through: also write entries kept in memory to disk, so other processes see them.

    Raises:
        CacheConfigError: ``cache_dir`` cannot be created or written, or a bad argument.
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
    ) -> None:
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
        self.write_through = write_through
        storage = _dtype_name(storage_dtype) if storage_dtype is not None else "native"
        self.root = Path(cache_dir)
        self.directory = self.root / f"{fingerprint}-b{boundary}-{storage}"
        self._make_directory()
        self._mem: dict[str, _MemEntry] = {}
        self._mem_bytes = 0
        self._bad: set[str] = set()  # keys whose file was rejected: the next store overwrites it
        self._stats = CacheStats()

    # ------------------------------------------------------------------ set-up

    def _make_directory(self) -> None:
        try:
            if not self.root.exists():
                self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.chmod(self.root, 0o700)  # mkdir's mode is masked by the umask
            if not self.directory.exists():
                self.directory.mkdir(mode=0o700, exist_ok=True)
                os.chmod(self.directory, 0o700)
            # Probe: the only reliable writability test (root ignores mode bits, mounts may be read-only).
            probe = self.directory / f".probe-{os.getpid()}-{secrets.token_hex(4)}"
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            os.unlink(probe)
        except OSError as err:
            raise CacheConfigError(
                f"cache_dir={str(self.root)!r} is not a writable directory ({type(err).__name__}: {err}). "
                "Pass a cache_dir on a local, writable disk (e.g. a folder under $TMPDIR), or cache=False."
            ) from None

    def check_batch_fits(self, nbytes: int) -> None:
        """Raise :class:`CacheConfigError` if one batch of ``nbytes`` cannot fit in a positive budget."""
        check_batch_fits(self.memory_budget, nbytes)

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
                row, original, where = found[0], found[1], "disk"
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
        a positive budget (:meth:`check_batch_fits`); off for groups that are not a training batch.
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
            self.check_batch_fits(host.nbytes + sum(t.nbytes for t in host_extras.values()))
        for i, key in enumerate(keys):
            if key in self._mem:
                continue
            # Clone: a row view would keep the whole batch's storage alive.
            hidden = host[i].clone()
            row_extras = {n: t[i].clone() for n, t in host_extras.items()}
            nbytes = hidden.nbytes + sum(t.nbytes for t in row_extras.values())
            in_memory = self.memory_budget > 0 and self._mem_bytes + nbytes <= self.memory_budget
            if in_memory:
                self._mem[key] = _MemEntry(hidden, original, row_extras, nbytes)
                self._mem_bytes += nbytes
            if not in_memory or self.write_through:
                self._write(key, hidden, original, row_extras)
            self._stats.stored += 1

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
        hidden, original, extras = found
        return StoredEntry(hidden.to(original), extras)

    def keys(self) -> list[str]:
        """Every key this process can read: its memory and the directory (all processes' files)."""
        found = dict.fromkeys(self._mem)
        try:
            with os.scandir(self.directory) as it:
                for item in it:
                    if item.name.endswith(_SUFFIX):
                        key = item.name[: -len(_SUFFIX)]
                        if KEY_PATTERN.match(key):
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

    def on_disk(self, key: str) -> bool:
        return self._path(key).exists()

    def stats(self) -> CacheStats:
        """A snapshot of the counters; scans this prefix's directory for the disk figures."""
        files = size = 0
        try:
            with os.scandir(self.directory) as it:
                for item in it:
                    if item.name.endswith(_SUFFIX):
                        try:
                            size += item.stat().st_size
                            files += 1
                        except FileNotFoundError:  # removed by another process meanwhile
                            pass
        except FileNotFoundError:
            pass
        snap = CacheStats(**asdict(self._stats))
        snap.entries_in_memory, snap.bytes_in_memory = len(self._mem), self._mem_bytes
        snap.files_on_disk, snap.bytes_on_disk = files, size
        return snap

    def clear(self, disk: bool = False) -> None:
        """Drop the memory entries; with ``disk=True`` also delete this prefix's directory.

        Delete the disk part from one process only, after the others stopped reading it (the
        strategy's barrier): they would see misses, never wrong data.
        """
        self._mem.clear()
        self._mem_bytes = 0
        if not disk:
            return
        try:
            with os.scandir(self.directory) as it:
                names = [item.name for item in it]
        except FileNotFoundError:
            return
        for name in names:
            try:
                os.unlink(self.directory / name)
            except FileNotFoundError:
                pass
        try:
            self.directory.rmdir()
        except OSError:  # another process is still writing into it
            pass

    # ------------------------------------------------------------------ files

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}{_SUFFIX}"

    def _write(self, key: str, hidden: Tensor, original: torch.dtype, extras: Mapping[str, Tensor]) -> None:
        path = self._path(key)
        if key not in self._bad and path.exists():
            return  # written by another process (same fingerprint: same bytes)
        tensors = {_HIDDEN: hidden.contiguous(), **{_EXTRA + n: t.contiguous() for n, t in extras.items()}}
        metadata = {
            "format": _FORMAT,
            "version": str(FORMAT_VERSION),
            "fingerprint": self.fingerprint,
            "boundary": str(self.boundary),
            "key": key,
            "dtype": _dtype_name(original),
        }
        data = safetensors_save(tensors, metadata=metadata)
        tmp = self.directory / f".{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # atomic: readers see the old file, the new one, or none
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        self._bad.discard(key)

    def _read(self, key: str, with_extras: bool) -> tuple | None:
        """``(hidden in storage dtype, original dtype[, extras])`` from disk, or ``None`` (missing or rejected)."""
        path = self._path(key)
        if not path.exists():
            return None
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                expected = {
                    "format": _FORMAT,
                    "version": str(FORMAT_VERSION),
                    "fingerprint": self.fingerprint,
                    "boundary": str(self.boundary),
                    "key": key,
                }
                if any(meta.get(k) != v for k, v in expected.items()):
                    raise ValueError(f"metadata {meta} does not match {expected}")
                original = getattr(torch, meta.get("dtype", ""), None)
                if not isinstance(original, torch.dtype):
                    raise ValueError(f"unknown dtype {meta.get('dtype')!r}")
                hidden = f.get_tensor(_HIDDEN)
                if self.storage_dtype is not None and hidden.dtype != self.storage_dtype:
                    raise ValueError("stored in another dtype")
                if not with_extras:
                    return hidden, original
                extras = {n[len(_EXTRA) :]: f.get_tensor(n) for n in f.keys() if n.startswith(_EXTRA)}
                return hidden, original, extras
        except Exception:  # noqa: BLE001 - any unreadable file is a miss, never an error or a wrong hit
            if path.exists():
                self._stats.rejected += 1
                self._bad.add(key)
            return None


def merge_rows(hit_mask: Tensor, hits: Tensor, computed: Tensor) -> Tensor:
    """The full batch: rows of ``hits`` where ``hit_mask`` is true, rows of ``computed`` elsewhere, in order.

    ``hits`` (``[hit_mask.sum(), ...]``) and ``computed`` (``[(~hit_mask).sum(), ...]``) may be
    empty; the result is on ``computed``'s device and dtype (or ``hits``' when all hit).
    """
    n_hit = int(hit_mask.sum())
    n_miss = hit_mask.numel() - n_hit
    if hits.shape[0] != n_hit or computed.shape[0] != n_miss:
        raise ValueError(f"merge_rows: {n_hit} hits and {n_miss} misses, got {hits.shape[0]} and {computed.shape[0]} rows.")
    if n_miss == 0:
        return hits
    if n_hit == 0:
        return computed
    mask = hit_mask.to(computed.device)
    out = computed.new_empty((hit_mask.numel(), *computed.shape[1:]))
    out[mask] = hits.to(device=computed.device, dtype=computed.dtype)
    out[~mask] = computed
    return out
