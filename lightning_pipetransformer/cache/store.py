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

The store keeps the memory tier and decides what goes where; its disk tier
(:mod:`~lightning_pipetransformer.cache.disk_tier`) owns the directory, its lock and the files, one per
entry in the format of :mod:`~lightning_pipetransformer.cache.entry_file` (safetensors, no pickle, a
header naming where the entry belongs, a CRC-32 per tensor, written atomically). A file of another
model or boundary is a miss counted in ``stats().rejected``, never returned; one whose bytes changed is
a miss counted in ``stats().corrupt``, and the next store rewrites it. Entries in this process's memory
are not checked on each hit: they never left the process, and hashing 3 MiB per batch would cost about
as much as the lookup itself (measured in ``docs/cache.md``). Non-finite activations (NaN, inf) are
never stored (``stats().nonfinite``): one bad step would otherwise be replayed every epoch under index keys.

What a batch missed leaves the device without the step waiting (:mod:`~lightning_pipetransformer.cache.host_copy`):
cast on the device, copied ``non_blocking`` into pinned buffers on the device's copy stream, an event after
it; the rows become entries only once the event completed (checked: reading earlier raises).

Several stores (runs, processes) may share one directory: each holds a shared ``flock`` on it
while open, and :meth:`ActivationStore.close` with ``delete=True`` deletes it only when no other
store holds it, so one run's boundary advance never deletes a directory another run still reads or
writes. A directory removed from outside is made again at the next write (``stats().recreated``); a
full disk stops disk writes at this boundary with one warning (``stats().unwritten``): those entries
are recomputed when needed, exactly as without a cache.

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
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from lightning_pipetransformer.cache.budget import CacheConfigError, check_batch_fits
from lightning_pipetransformer.cache.disk_tier import DiskTier
from lightning_pipetransformer.cache.entry_file import check_keys, dtype_name
from lightning_pipetransformer.cache.host_copy import HostCopy, start_host_copy
from lightning_pipetransformer.cache.kept import folder_name
from lightning_pipetransformer.cache.keys import KEY_PATTERN
from lightning_pipetransformer.cache.store_stats import CacheStats
from lightning_pipetransformer.warn_once import WarnOnce

__all__ = [
    "ActivationStore",
    "CacheConfigError",
    "StoredEntry",
    "check_batch_fits",
    "probe_cache_dir",
]

_LOWER_PRECISION = (torch.bfloat16, torch.float16)


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


@dataclass
class _Pending:
    """One :meth:`ActivationStore.store` whose device-to-host copy may still run: no entry yet."""

    keys: list[str]
    key_set: frozenset[str]
    original: torch.dtype
    copy: HostCopy


#: Stores whose copies may be in flight at once; a further one waits for the oldest. The next
#: step's store finds the previous one's copy long done, so this only bounds the pinned memory
#: of a device running far behind the host.
MAX_COPIES_IN_FLIGHT = 4


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
        if not isinstance(fingerprint, str) or not KEY_PATTERN.match(fingerprint):
            raise CacheConfigError(f"fingerprint must be a hex string from prefix_fingerprint(), got {fingerprint!r}.")
        if isinstance(boundary, bool) or not isinstance(boundary, int) or boundary < 0:
            raise CacheConfigError(f"boundary must be a non-negative int (frozen blocks), got {boundary!r}.")
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget < 0:
            raise CacheConfigError(f"memory_budget must be a non-negative int of bytes, got {memory_budget!r}.")
        if storage_dtype is not None and storage_dtype not in _LOWER_PRECISION:
            raise CacheConfigError(
                f"storage_dtype must be None (the activation's dtype) or one of "
                f"{[dtype_name(d) for d in _LOWER_PRECISION]}, got {storage_dtype!r}."
            )
        self.fingerprint = fingerprint
        self.boundary = boundary
        self.memory_budget = memory_budget
        self.storage_dtype = storage_dtype
        self.keep = keep
        # Kept entries are for other runs: they must be on disk, whatever fits in this run's memory.
        self.write_through = write_through or keep
        storage = dtype_name(storage_dtype) if storage_dtype is not None else "native"
        self.root = Path(cache_dir)
        self.directory = self.root / folder_name(fingerprint, boundary, storage)
        self._mem: dict[str, _Entry] = {}
        self._mem_bytes = 0
        self._reserved = 0  # see reserve()
        #: Stores whose device-to-host copies may still run, oldest first (see _settle).
        self._pending: list[_Pending] = []
        self._stats = CacheStats()
        # Once per reason and store, whoever listens: a batch of 10,000 NaN rows is one warning.
        said = WarnOnce() if warn is None else WarnOnce(lambda message, stacklevel: None)

        def warn_once(reason: str, message: str) -> None:
            if said(reason, message, stacklevel=4) and warn is not None:
                warn(reason, message)

        self._warn = warn_once
        self.strict = strict
        #: The entry files in :attr:`directory` (cache/disk_tier.py): made and locked now.
        self._disk = DiskTier(
            self.root, self.directory, fingerprint, boundary, storage_dtype, self._stats, warn_once, strict=strict, keep=keep,
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
        check_keys(keys)
        self._settle(keys)  # a key whose copy is in flight waits for it (the previous step's: done long ago)
        want = tuple(sample_shape) if sample_shape is not None else None
        hit_mask = torch.zeros(len(keys), dtype=torch.bool)
        rows: list[Tensor] = []
        out_dtype = dtype
        for i, key in enumerate(keys):
            mem = self._mem.get(key)
            if mem is not None:
                row, original, where = mem.hidden, mem.dtype, "memory"
            else:
                found = self._disk.read(key, with_extras=False)
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
        stored = rows[0].dtype
        if target.type == "cuda" and all(r.dtype == stored for r in rows):
            # Stack into pinned memory in the stored dtype (half the bytes under storage_dtype=bf16), copy
            # without waiting (from pageable memory the copy would make the host wait), cast on the device.
            staged = torch.empty((len(rows), *want), dtype=stored, pin_memory=True)  # type: ignore[misc]
            torch.stack(rows, out=staged)
            return hit_mask, staged.to(target, non_blocking=True).to(out_dtype)
        return hit_mask, torch.stack(rows).to(device=target, dtype=out_dtype)

    def store(
        self, keys: Sequence[str], activations: Tensor, extras: Mapping[str, Tensor] | None = None, check_fits: bool = True,
    ) -> None:
        """Store one activation per key (row ``i`` of ``activations`` and of each ``extras`` tensor).

        Keys already held (in memory, or on disk by any process) are skipped. ``extras`` are
        per-sample tensors kept with the entry in their own dtype (e.g. the attention mask the
        next blocks need, to advance the entry later). ``check_fits``: refuse a batch larger than
        a positive budget (:func:`check_batch_fits`); off for groups that are not a training batch.

        The rows leave the device asynchronously (:mod:`~lightning_pipetransformer.cache.host_copy`: cast on the
        device, pinned buffers, a copy stream, an event): the entries exist once the copy is done, which the
        next call that needs them waits for (a lookup of one of these keys, :meth:`read`, :meth:`close` ...).
        On the CPU the copy is done at once and the entries exist when this returns.
        """
        check_keys(keys)
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
        storage = self.storage_dtype or original
        if check_fits:
            nbytes = activations.numel() * storage.itemsize + sum(t.numel() * t.element_size() for t in extras.values())
            check_batch_fits(self.memory_budget, nbytes)
        self._settle()
        copy = start_host_copy(activations, storage, extras)
        self._pending.append(_Pending(list(keys), frozenset(keys), original, copy))
        while len(self._pending) > MAX_COPIES_IN_FLIGHT:  # bounded pinned memory, whatever the device's lag
            self._finish(self._pending.pop(0))
        self._settle()  # on the CPU the copy is done already: stored before store() returns

    def finish_copies(self) -> None:
        """Wait for the copies in flight and make their entries now (memory, disk): before a barrier
        after which other processes expect this one's entries on disk (an advance's shards)."""
        self._settle(wait=True)

    def _settle(self, keys: Sequence[str] | None = None, *, wait: bool = False) -> None:
        """Turn finished copies into entries, oldest first (the first of two stores of a key wins, as before).

        ``wait``: block until every copy in flight is done; ``keys``: until those of the copies that
        hold one of ``keys`` (and the older ones) are. Otherwise never blocks: copies still running stay.
        """
        if keys is not None and self._pending:
            last = max((i for i, p in enumerate(self._pending) if not p.key_set.isdisjoint(keys)), default=-1)
            for pending in self._pending[: last + 1]:
                pending.copy.wait()
        while self._pending and (wait or self._pending[0].copy.ready()):
            self._finish(self._pending.pop(0))

    def _finish(self, pending: _Pending) -> None:
        """Entries from one copy, once done: the checks, memory or disk. Reads the host buffers only after their events."""
        pending.copy.wait()  # returns at once when ready() said so
        host, host_extras = pending.copy.host()  # raises if a copy could still be running
        original = pending.original
        self._disk.hold()  # closed earlier and used again: hold the directory while writing into it
        for i, key in enumerate(pending.keys):
            if key in self._mem:
                continue
            if not _finite(host[i]):  # in the storage dtype: a finite fp32 value may overflow fp16
                self._skip_nonfinite(key)
                continue
            # Clone: a row view would keep the whole batch's (pinned) buffer alive.
            hidden = host[i].clone()
            row_extras = {n: t[i].clone() for n, t in host_extras.items()}
            nbytes = hidden.nbytes + sum(t.nbytes for t in row_extras.values())
            in_memory = self.memory_budget > 0 and self._mem_bytes + nbytes <= self.memory_budget - self._reserved
            if in_memory:
                self._mem[key] = _Entry(hidden, original, row_extras, nbytes)
                self._mem_bytes += nbytes
            written = (not in_memory or self.write_through) and self._disk.write(key, hidden, original, row_extras)
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
        check_keys([key])
        self._settle(wait=True)
        mem = self._mem.get(key)
        if mem is not None:
            # Copies: the caller may modify what it gets without touching the memory entry.
            return StoredEntry(mem.hidden.to(mem.dtype, copy=True), {n: t.clone() for n, t in mem.extras.items()})
        found = self._disk.read(key, with_extras=True)
        if found is None:
            return None
        hidden, original, extras = found
        return StoredEntry(hidden.to(original), extras)

    def keys(self) -> list[str]:
        """Every key this process can read: its memory and the directory (all processes' files)."""
        self._settle(wait=True)
        found = dict.fromkeys(self._mem)
        for key in self._disk.keys():
            found.setdefault(key)
        return list(found)

    def discard(self, keys: Sequence[str]) -> None:
        """Drop ``keys`` from memory (their disk files stay): frees the budget while advancing."""
        self._settle(keys)
        for key in keys:
            entry = self._mem.pop(key, None)
            if entry is not None:
                self._mem_bytes -= entry.nbytes

    def in_memory(self, key: str) -> bool:
        self._settle([key])
        return key in self._mem

    def holds(self, key: str) -> bool:
        """Whether ``key`` has an entry (memory, or one ``stat`` of its file)."""
        self._settle([key])
        return key in self._mem or self.on_disk(key)

    def count_as_hits(self, memory: int, disk: int) -> None:
        """Lookups this store missed that an earlier boundary's store answered (a lazy advance): hits of the cache."""
        self._stats.misses -= memory + disk
        self._stats.hits += memory + disk
        self._stats.memory_hits += memory
        self._stats.disk_hits += disk

    @property
    def bytes_in_memory(self) -> int:
        """Bytes of the entries held in memory (no directory scan, unlike :meth:`stats`); entries whose copy
        is still in flight count once it is done (never waits)."""
        self._settle()
        return self._mem_bytes

    def on_disk(self, key: str) -> bool:
        self._settle([key])
        return self._disk.file_size(key) is not None

    def stats(self) -> CacheStats:
        """A snapshot of the counters (:class:`CacheStats`), from memory: no folder walk, no ``stat``.

        Never waits for the device (the progress bar asks every step): an entry whose copy to the host is
        still in flight is counted once it is done."""
        self._settle()
        snap = CacheStats(**asdict(self._stats))
        snap.entries_in_memory, snap.bytes_in_memory = len(self._mem), self._mem_bytes
        snap.files_on_disk, snap.bytes_on_disk = self._disk.files, self._disk.bytes
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
        makes the directory again). Copies still in flight are waited for and stored first, as they were
        before ``store()`` returned when stores were synchronous.
        """
        self._settle(wait=True)
        if delete != "if_empty":
            self._mem.clear()
            self._mem_bytes = 0
        return self._disk.close(delete)
