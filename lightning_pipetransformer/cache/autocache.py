"""AutoCache in the loop: serve the frozen prefix's output from the activation store.

The strategy installs a :class:`~lightning_pipetransformer.cache.cached_stack.CachedStack` in place
of the block stack (the same way it installs the pipeline: the model's own loop calls it once).
For every batch it

1. computes one content key per sample from what enters the frozen prefix: the inputs of the
   first module before the stack (the embeddings' ``input_ids``/``pixel_values``, recorded by a
   forward pre-hook, so hashing costs next to nothing) plus the per-sample arguments the blocks
   receive (attention masks). Without a module before the stack the hidden state itself is
   hashed. A key therefore names the exact input of the frozen computation: a random
   augmentation or masking done in ``training_step`` just misses, it never hits a stale entry;
2. looks the keys up in the store of the current boundary (whose directory name carries a
   fingerprint of the frozen weights, so another model or boundary can never be returned);
3. runs the frozen blocks, under ``no_grad``, only for the misses and stores their outputs
   (:class:`~lightning_pipetransformer.cache.batch.CachedBatch`);
4. runs the active blocks (the pipeline over ``blocks[F:]``) on the merged boundary activations.

Once the embeddings' output is seen to reach the stack unchanged, they are skipped too
(:class:`~lightning_pipetransformer.cache.embedding_skip.EmbeddingSkipper`): the model's forward gets a NaN placeholder
of the right shape from them, and only the rows the stack must compute run the real embeddings.

Safety nets, all cheap: every file read from disk is checked against its CRC-32 (a corrupt
file is a miss); non-finite activations are never stored; index keys repeated within a pass
over a loader are refused; the first batch with hits at each boundary is also recomputed
and compared with what the store returned (a mismatch raises: something outside the frozen
prefix feeds it and caching cannot be exact; NaN equals NaN there); and ``cache="auto"`` keeps
the cache at a boundary only if a lookup per sample is measured faster than the frozen prefix per
sample, in device time (:mod:`~lightning_pipetransformer.cache.auto_mode`).

AutoCache holds one object per part, each in its own module: the boundaries and their stores
(:mod:`~lightning_pipetransformer.cache.boundaries`), the embeddings' watch
(:mod:`~lightning_pipetransformer.cache.embeddings`), index keys
(:mod:`~lightning_pipetransformer.cache.indices`), the first-hit check
(:mod:`~lightning_pipetransformer.cache.first_hit`), refusals (:class:`~lightning_pipetransformer.cache.prefix.Verdicts`),
counters (:mod:`~lightning_pipetransformer.cache.metrics`) and the batch-size measure
(:mod:`~lightning_pipetransformer.cache.budget`). It keeps the settings and the decisions that
span them: whether the frozen prefix may be cached, ``cache="auto"``, the keys. Whether one batch may
be served (a trainable input among them) is the cached stack's call (:mod:`~lightning_pipetransformer.cache.cached_stack`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_pipetransformer.cache.arguments import ENTRY_FORMAT, shared_once
from lightning_pipetransformer.cache.auto_mode import AutoDecision
from lightning_pipetransformer.cache.boundaries import Boundaries
from lightning_pipetransformer.cache.budget import BatchBytes
from lightning_pipetransformer.cache.embeddings import EmbeddingsWatch, Pending
from lightning_pipetransformer.cache.first_forward import FirstForward, input_leaves, why_not
from lightning_pipetransformer.cache.first_hit import FirstHitCheck
from lightning_pipetransformer.cache.indices import BatchIndices
from lightning_pipetransformer.cache.kept import evict, folder_name
from lightning_pipetransformer.cache.keys import content_keys
from lightning_pipetransformer.cache.metrics import BatchCounters, PeriodHits, cache_metrics
from lightning_pipetransformer.cache.prefix import Verdicts, with_block_arguments
from lightning_pipetransformer.cache.store import ActivationStore
from lightning_pipetransformer.cache.validity import check_deterministic, prefix_fingerprint, prefix_modules
from lightning_pipetransformer.cache.watch import PrefixChange, PrefixWatch
from lightning_pipetransformer.devices.timing import DeviceSpan
from lightning_pipetransformer.stack.discovery import BlockStack
from lightning_pipetransformer.stack.stack_call import BlockArgs
from lightning_pipetransformer.warn_once import WarnOnce

__all__ = ["AutoCache"]

CacheMode = bool | Literal["auto"]

#: Below this share of hits in an epoch after the boundary's entries were stored, content keys are
#: naming other tensors than the stored ones (fixed inputs hit every time): worth a warning.
_LOW_HIT_RATE = 0.8


class AutoCache:
    """The cache of one process: settings, the store of the current boundary, and its decisions.

    Args:
        mode: ``True`` caches whenever blocks are frozen; ``"auto"`` only while a lookup is
            measured faster than the frozen prefix; ``False`` never.
        cache_dir: node-local directory shared by the node's processes.
        memory_budget: host bytes for entries in memory; the rest spills to ``cache_dir``.
        write_through: also write in-memory entries to disk (several processes per node).
        key: ``"content"`` (exact) or ``"index"`` (the batch's ``"index"`` entry, set per batch
            with :meth:`set_batch`; reuses the first view of an augmented sample, so the
            first-hit verification is skipped).
        skip_embeddings: skip the first module before the stack on batches the cache serves
            (see :class:`~lightning_pipetransformer.cache.embedding_skip.EmbeddingSkipper`).
        keep: the entries outlive the run (``cache_keep``): written through, their folders kept
            (:mod:`~lightning_pipetransformer.cache.kept`), found by later runs from their first step
            (:mod:`~lightning_pipetransformer.cache.first_forward`).
        keep_bytes: with ``keep``, the most bytes ``cache_dir`` keeps (least recently used folders go first).
    """

    def __init__(
        self,
        mode: CacheMode,
        cache_dir: str,
        memory_budget: int,
        write_through: bool = False,
        key: Literal["content", "index"] = "content",
        skip_embeddings: bool = True,
        keep: bool = False,
        keep_bytes: int | None = None,
    ) -> None:
        self.mode = mode
        #: Batches served, looked up and run without the cache; forwards that skipped the embeddings.
        self.counters = BatchCounters()
        #: What the embeddings did in each forward: recorded, skipped where exact (cache/embeddings.py).
        self.embeddings = EmbeddingsWatch(self, skip_embeddings, self.may_serve, self.counters)
        self.key = key
        #: ``key="index"``: the keys of the next forward, and the indices each loader gave in its pass.
        self.indices = BatchIndices()
        self.cache_dir = cache_dir
        self.memory_budget = memory_budget
        self.write_through = write_through
        self.keep = keep
        self.keep_bytes = keep_bytes
        #: The first training forward served from kept entries (cache/first_forward.py).
        self.first_forward = FirstForward()
        #: Whether AutoFreeze freezes the modules before the stack with the first block before this step's backward
        #: (set by the strategy): the first forward may then cut their gradient, which the plain run drops too.
        self.pre_freezes_first: Callable[[], bool] = lambda: False
        #: Where notes that are not warnings go (the strategy's rank-zero info).
        self.announce: Callable[[str], None] = lambda message: None
        self._told = WarnOnce(lambda message, stacklevel: self.announce(message))
        #: The watch is armed again at the next check (the early store's prefix froze since it opened).
        self._rearm_due = False
        self.enabled = bool(mode)
        #: ``cache="auto"``: the device time of a lookup against the frozen prefix's, measured until decided.
        self.auto = AutoDecision(mode == "auto")
        self.first_hit = FirstHitCheck()
        #: Reasons said once per run: by global rank 0 (every replica would say the same), and by each rank.
        self._said = WarnOnce(_warn_from_rank_zero)
        self._said_here = WarnOnce()
        self._period = PeriodHits()
        #: Refusals: raised now, or (several processes) at the step's end on every rank together.
        self.verdicts = Verdicts()
        #: ``id(parameter) -> name``, to name what the frozen blocks' input trains (set by the strategy).
        self.parameter_names: dict[int, str] = {}
        #: Why the modules before the stack keep training, when that is known in advance (input embeddings
        #: tied to the output head): said when the cache stands aside for it.
        self.pre_trains_because: str | None = None
        #: Why no block can ever be served in this fit (nothing will freeze one), decided before training; logged
        #: as ``autocache_diagnostics/can_engage`` = 0.
        self.never_engages: str | None = None
        #: A random augmentation of the stack's input the model applies in training (SpecAugment), in words:
        #: the cause named when lookups miss.
        self.input_augmented: str | None = None
        #: Whether what runs before the stack is still provisional (registration order, before the first
        #: training forward was observed): the frozen prefix is then computed, not looked up or stored.
        self.order_pending: Callable[[], bool] = lambda: False
        #: Which store is current, and the stores a boundary move keeps beside it.
        self.boundaries = Boundaries(self._cacheable, self._open, lambda: self.forward_context())
        #: Mixed into the prefix fingerprint (e.g. the precision), so runs that differ there never share entries.
        self.fingerprint_extra = ""
        #: Index keys are only unique within one set-up (one loader, one run): prefix them with this.
        self.namespace = ""
        #: Context the model's forward runs in (the precision plugin's autocast): the boundary advance
        #: runs blocks F..F'-1 outside any step, and must compute what a forward would.
        self.forward_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
        #: What a batch's entries will take, measured from the first forward (checked at the first step).
        self.batch_bytes = BatchBytes()
        #: What the current store's entries were computed from, compared before every forward it would serve.
        self.watch = PrefixWatch()
        #: What changed in the prefix since the current store's entries were computed (``None``: nothing).
        self.changed: PrefixChange | None = None
        #: Keep the frozen prefix in eval mode (``cache_frozen_eval``): no dropout there, so that a prefix frozen
        #: by something that leaves it in train mode (Lightning's BaseFinetuning) can be served.
        self.frozen_eval = False
        self._full_check_due = False
        #: The current store's prefix ``(stack, num_frozen, include_pre)``, for the fingerprint and frozen_eval.
        self._prefix: tuple[BlockStack, int, bool] | None = None

    def _store_warning(self, reason: str, message: str) -> None:
        """A store could not work fully (full disk, removed directory, NaN activations): warn once per run."""
        if reason == "disk" and torch.distributed.is_available() and torch.distributed.is_initialized():
            # A disk fails for one process or one node, not for every replica alike: said where it happens.
            self._said_here(("store", reason), f"[rank {torch.distributed.get_rank()}] {message}")
        else:
            self._said(("store", reason), message)

    def skip_once(self, reason: str) -> None:
        """Run without the cache for this batch; warn the first time for each reason."""
        self.counters.skipped += 1
        self._said(("skip", reason), f"AutoCache is not used for these batches: {reason}. Results are exact; only the speed-up is lost.")

    def attach(self, stack: BlockStack, root: nn.Module | None = None) -> None:
        """Record the inputs of the first module before the stack (cheap keys); skip it when possible
        (:meth:`EmbeddingsWatch.attach`). Followed again when the stack's ``pre`` is refined."""
        self.detach()
        # pre is provisional (registration order) until AutoFreeze observes the first forward: follow it then.
        stack.when_refined(_Reattach(self, stack, root))
        self.embeddings.attach(stack, root)

    def detach(self) -> None:
        self.embeddings.detach()
        self.batch_bytes.stop()

    def set_batch(self, batch: Any, namespace: str, batch_idx: int | None = None) -> None:
        """``key="index"``: take the sample indices of the next forward from ``batch["index"]``
        (:meth:`BatchIndices.read`: checked from the first batch, cache on or not yet)."""
        keys = self.indices.read(batch, f"{self.namespace}{namespace}", namespace, batch_idx, self.verdicts.refuse)
        serving = (self.store is not None or self.boundaries.deferred is not None) and self.enabled and self.verdicts.pending is None
        self.indices.next = keys if serving else None

    def keys_for(self, hidden: Tensor, calls: Sequence[BlockArgs], pending: Pending | None) -> list[str] | None:
        """Keys of what enters the stack (its input and every block's arguments), or ``None`` when
        they cannot be exact.

        ``pending``: the embeddings' recorded call when its inputs name ``hidden`` (:meth:`EmbeddingsWatch.arrived`), else ``None``.
        """
        batch = hidden.shape[0]
        if self.verdicts.pending is not None:
            return None  # a refusal waits for the other ranks (Verdicts.defer): compute, never guess
        if self.key == "index":
            keys, self.indices.next = self.indices.next, None
            if keys is None or len(keys) != batch:
                raise ValueError(
                    f"cache_key='index': the forward got {batch} samples but the batch's 'index' entry had "
                    f"{None if keys is None else len(keys)}. Each forward must see its batch's samples once, in order."
                )
            full = with_block_arguments(keys, calls, hidden.device)
            source = (pending.args, pending.kwargs) if pending is not None else hidden
            store = self.store
            recording = store is not None and store.stats().hits == 0  # the store fills in this pass
            changed = self.indices.check_forward(full, source, batch, recording, self.boundaries.holds) if full is not None else None
            if changed is not None:
                self.verdicts.refuse(changed)
                return None  # several processes: the refusal waits for the step's end; compute meanwhile
            return full
        source: Any = (pending.args, pending.kwargs) if pending is not None else hidden
        try:
            return content_keys(source, shared_once(calls, batch), batch_size=batch)
        except TypeError:
            return None  # an argument we cannot hash reliably: compute, never guess

    # ------------------------------------------------------------------ boundaries (cache/boundaries.py)

    @property
    def store(self) -> ActivationStore | None:
        """The current boundary's store (``None`` while no boundary is cached, or one is deferred)."""
        return self.boundaries.current

    @property
    def advanced(self) -> int:
        """Entries this process advanced into the current store since it opened."""
        return self.boundaries.advanced

    def move_boundary(
        self, stack: BlockStack, num_frozen: int, include_pre: bool, device: torch.device, shard: tuple[int, int], lazy: bool = False,
    ) -> None:
        """One process: open the store for boundary ``num_frozen`` now (:meth:`Boundaries.move`)."""
        order_pending = bool(num_frozen and self.mode and self.order_pending())
        self.boundaries.move(stack, num_frozen, include_pre, device, shard, lazy=lazy, order_pending=order_pending)

    def defer_boundary(self, stack: BlockStack, num_frozen: int, include_pre: bool, device: torch.device) -> None:
        """Several processes: check boundary ``num_frozen`` now, open its store at :meth:`sync_boundary`."""
        self.boundaries.defer(stack, num_frozen, include_pre, device)

    def sync_boundary(self, group: Any, node: int = 0) -> int:
        """Every rank, same order: open the deferred store and advance the previous boundary's entries together."""
        return self.boundaries.sync(group, node)

    def serves(self, num_frozen: int) -> bool:
        """Whether boundary ``num_frozen`` is cached (its store open, or deferred)."""
        return self.boundaries.serves(num_frozen)

    def close(self) -> None:
        """End of the fit: let go of the earlier boundaries' entries (the current store stays for validate/test)."""
        self.boundaries.close()

    # ------------------------------------------------------------------ kept entries (cache/kept.py, cache/first_forward.py)

    def keep_within_cap(self) -> None:
        """``keep``: bring ``cache_dir`` under ``keep_bytes``, least recently used folders first (never one a live run
        holds, this one's current store included); said each time something goes."""
        if not self.keep or self.keep_bytes is None:
            return
        done = evict(self.cache_dir, self.keep_bytes)
        if done.removed:
            held = f"; {len(done.held)} folder(s) held by live runs stay" if done.held else ""
            self.announce(
                f"AutoCache: {self.cache_dir} held more than cache_keep_bytes={self.keep_bytes} bytes of kept entries: removed "
                f"{len(done.removed)} folder(s) of least recent use ({done.bytes_removed} bytes); "
                f"{done.bytes_left} bytes left{held}."
            )

    def first_forward_store(self, num_frozen: int, hidden: Tensor, grad_free: bool) -> ActivationStore | None:
        """A forward before the call order is known (the first training forward): the store of entries kept by an
        earlier run to serve it from, read-only, or ``None`` (the prefix is computed, as without the cache).

        ``hidden``/``grad_free``: the stack's input and whether it requires grad only because a hook marked it."""
        early = self.first_forward
        store = self.boundaries.current if early.read_only else None
        deferred = self.boundaries.deferred
        if not (self.keep and self.key == "content" and self.enabled) or self.verdicts.pending is not None:
            return None
        if store is not None:
            if store.boundary != num_frozen or self._prefix is None:
                return None
            stack, include_pre = self._prefix[0], self._prefix[2]
        elif early.tried or deferred is None or not deferred.unchecked or deferred.num_frozen != num_frozen:
            return None
        else:
            stack, include_pre = deferred.stack, deferred.include_pre
        modules = prefix_modules(stack, num_frozen, include_pre)
        loose = list(stack.pre_params) if include_pre else []
        leaves = input_leaves(hidden) if torch.is_grad_enabled() and hidden.requires_grad and not grad_free else []
        reason = why_not(modules, loose, leaves, self.pre_freezes_first())
        if reason is not None:
            self._told(
                ("first forward", reason),
                f"AutoCache: a forward before the call order is known (the first training step) computes the frozen prefix "
                f"instead of reading kept entries: {reason}.",
            )
            return None
        if store is None:
            early.tried = True
            store = self.boundaries.open_early()
            if store is None:
                return None  # no folder kept for this prefix: it waits for the call order, as without cache_keep
            early.opened(modules)
            self._told(
                "first forward served",
                f"AutoCache: entries kept in {store.directory} serve from the first step (read-only until the call order "
                "is known; the first batch with hits is recomputed and compared).",
            )
        early.note_cut(self.parameter_names, leaves or [])
        return store

    def refined(self) -> None:
        """The call order is known (the stack's ``pre`` was refined): a store opened early on the provisional prefix
        stays if that is the prefix as observed, else the boundary opens again on it; a waiting boundary is checked."""
        stack_prefix = self._prefix
        same = None
        if stack_prefix is not None:
            same = self.first_forward.confirm(prefix_modules(*stack_prefix))
        if same is not None:
            self.boundaries.settle_early(same)
            if same:
                # The embeddings froze after the store opened (AutoFreeze freezes them now): the watch is armed again
                # on the prefix as it is at the next check, which compares the fingerprint with the store's first.
                self.watch.disarm()
                self._rearm_due = True
            else:
                self.watch.disarm()
                self.changed, self._prefix = None, None
                self.announce(
                    "AutoCache: the call order shows another prefix than registration order; the store opened for the "
                    "first step is let go (what it served was recomputed and compared) and the boundary opens on the "
                    "prefix as observed."
                )
        self.boundaries.check_deferred()

    def after_backward(self) -> None:
        """After a training step's backward: a first step served from kept entries cut only gradients the plain run
        drops too (:meth:`FirstForward.check_cut`)."""
        if self.first_forward.cut:
            self.first_forward.check_cut()

    def _rearm(self) -> PrefixChange | None:
        """Arm the watch on the early store's prefix as it is now, if its fingerprint is still the store's."""
        self._rearm_due = False
        store, prefix = self.boundaries.current, self._prefix
        if store is None or prefix is None:
            return None
        if self._fingerprint_of(*prefix) != store.fingerprint:
            return PrefixChange(("the frozen weights changed between the first step and the second",))
        self.watch.arm(prefix_modules(*prefix), list(prefix[0].pre_params) if prefix[2] else [])
        return None

    def _cacheable(self, stack: BlockStack, num_frozen: int, include_pre: bool) -> bool:
        """Whether the prefix up to ``num_frozen`` may be cached; raises (``True``) or turns off (``"auto"``)."""
        if num_frozen == 0 or not self.mode:
            return False
        if self.frozen_eval:  # the modules before the stack too, even while they are known from registration order only
            self._frozen_to_eval(stack, num_frozen, True)
        # A module that still trains is not refused, nor is its randomness: the cache stands aside while it trains (said
        # once), and the watch checks its mode once it is frozen. (When the call order arrives, AutoFreeze freezes and puts
        # in eval mode what runs before the stack only after this check: its dropout is not the cached prefix's.)
        modules = prefix_modules(stack, num_frozen, include_pre)
        frozen = [(name, m) for name, m in modules if not any(p.requires_grad for p in m.parameters())]
        try:
            check_deterministic(frozen, trainable_too=False)
        except Exception as err:
            if self.mode is True:
                raise
            self.enabled = False
            _warn(f"AutoCache turned off: {err}")
            return False
        return True

    def _open(
        self, stack: BlockStack, num_frozen: int, include_pre: bool, *, existing_only: bool = False,
    ) -> ActivationStore | None:
        """The store of boundary ``num_frozen`` (``existing_only``: only if its folder exists already, else ``None``)."""
        fingerprint = self._fingerprint_of(stack, num_frozen, include_pre)
        if existing_only and not (Path(self.cache_dir) / folder_name(fingerprint, num_frozen, "native")).is_dir():
            return None
        store = ActivationStore(
            self.cache_dir, fingerprint, num_frozen, self.memory_budget,
            write_through=self.write_through, warn=self._store_warning,
            strict=False,  # cache_dir was checked before training: a disk failing later stops disk writes only
            keep=self.keep,
        )
        self._rearm_due = False
        if self.keep:
            self.keep_within_cap()
        self.first_hit.reset()
        self.counters.new_boundary()  # per boundary, like the new store's hits
        # What the entries are computed from: served only while the model still computes the prefix so.
        self.watch.arm(prefix_modules(stack, num_frozen, include_pre), list(stack.pre_params) if include_pre else [])
        self.changed, self._prefix = None, (stack, num_frozen, include_pre)
        if self.mode == "auto":
            self.enabled = True  # measured again at this boundary
            self.auto.reopen()
        return store

    # ------------------------------------------------------------------ validity by observation (cache/watch.py)

    def new_pass(self) -> None:
        """A pass over a loader begins (a training epoch, training resumed after validation, a validation, test or
        predict run): the next check compares the frozen weights' bits too, which sees writes no version counter
        does (Lightning's EMA/SWA swap weights with ``param.data.copy_``)."""
        self._full_check_due = True

    def prefix_change(self) -> PrefixChange | None:
        """What changed in the current store's prefix since its entries were computed; ``None`` when nothing did
        (or no store is open). A host-side walk before every forward the cache would serve; said once per kind,
        counted in ``prefix_changes``."""
        if self._rearm_due:
            stale = self._rearm()
            if stale is not None:
                self.changed = stale
                self.counters.prefix_changes += 1
                self._said(("prefix changed", stale.reasons), f"AutoCache: {stale.describe()}: the boundary opens again.")
                return stale
        if self.boundaries.current is None or not self.watch.armed:
            return self.changed if self.changed is not None and self.boundaries.current is not None else None
        if self.frozen_eval and self._prefix is not None:
            self._frozen_to_eval(*self._prefix)
        full, self._full_check_due = self._full_check_due, False
        change = self.watch.changed(full=full)
        if change is not None and change != self.changed:
            self.counters.prefix_changes += 1
            then = (
                "the frozen blocks run while it differs and the entries are served again once the modes and hooks are as "
                "they were" if change.transient else "in training the cache starts again at the blocks frozen now, in "
                "validation, test and predict the frozen blocks run for that pass"
            )
            self._said(
                ("prefix changed", change.reasons),
                f"AutoCache: the frozen prefix changed since its entries were computed ({change.describe()}). They are not "
                f"served while it differs: {then}. Results are exact (autocache_diagnostics/prefix_changes).",
            )
        self.changed = change
        return change

    def may_serve(self, num_frozen: int) -> bool:
        """Whether the cache may serve boundary ``num_frozen`` in this forward: on, its store open or deferred, the
        prefix frozen and unchanged since its entries were computed."""
        return self.enabled and self.boundaries.serves(num_frozen) and self.prefix_change() is None and not self.prefix_trains()

    def prefix_trains(self) -> str | None:
        """Why the current store's prefix is not frozen (a module before the stack trains), in words; ``None`` when it
        is. Its output then changes at every optimizer step: the cache stands aside (exact) until it is frozen."""
        trainable = sorted(self.watch.trainable) if self.watch.armed else []
        if not trainable:
            return None
        names = ", ".join(trainable[:3]) + (f" and {len(trainable) - 3} more" if len(trainable) > 3 else "")
        return (
            f"{names} still require(s) grad: what runs before the frozen blocks trains, so their input changes at every "
            "step and there is nothing to cache. Freeze it with the blocks (AutoFreeze does, or requires_grad_(False)) "
            "to use the cache"
        )

    def retire(self) -> None:
        """Training goes on with a changed prefix: let go of the stores computed from the old one (never served
        again), so that the plan's boundary opens anew on the model as it is now."""
        self.boundaries.retire()
        self.watch.disarm()
        self.changed, self._prefix = None, None
        self._rearm_due = False
        self.first_forward = FirstForward()

    def _frozen_to_eval(self, stack: BlockStack, num_frozen: int, include_pre: bool) -> None:
        """``cache_frozen_eval``: the prefix's modules with no trainable parameter in eval mode (no dropout there)."""
        for _, module in prefix_modules(stack, num_frozen, include_pre):
            if not any(p.requires_grad for p in module.parameters()) and any(m.training for m in module.modules()):
                module.eval()

    def _fingerprint_of(self, stack: BlockStack, num_frozen: int, include_pre: bool) -> str:
        return prefix_fingerprint(stack, num_frozen, include_pre, extra=f"{self.fingerprint_extra}|format={ENTRY_FORMAT}")

    # ------------------------------------------------------------------ checks and decisions

    def after_hits(
        self, rows: Callable[[Tensor], Tensor], calls: Sequence[BlockArgs], hit_mask: Tensor,
        boundary: Tensor, prefix: Callable[[Tensor, Sequence[BlockArgs]], Tensor], lookup: DeviceSpan | None, batch: int,
    ) -> None:
        """Verify the first hits at a boundary; under ``"auto"`` keep the cache only if it pays.

        ``rows(mask)``: the input of the frozen blocks for the rows in ``mask``; ``lookup``: the device time of this
        batch's lookup while ``"auto"`` is still measuring (``None`` otherwise).
        """
        if self.key == "content" and not self.first_hit.done:
            where, store = self.boundaries.where, self.boundaries.current
            blocks = where[0].blocks[: store.boundary] if where is not None and store is not None else None
            stale = self.first_hit.check(rows, calls, hit_mask, boundary, prefix, blocks)
            if stale is not None:
                self.verdicts.refuse(stale)
                return
        verdict = self.auto.decide(lookup, batch) if lookup is not None and bool(hit_mask.all()) else None
        if verdict is None:
            return
        at = self.store.boundary if self.store else "?"
        if verdict.keep:
            self.announce(f"AutoCache (cache='auto') keeps the cache at boundary {at}: {verdict.describe()}.")
        else:
            self.enabled = False
            _warn(f"AutoCache turned off at boundary {at}: {verdict.describe()}.")

    def period_hit_rate(self) -> float | None:
        """The share of lookups that hit since the last call (once per epoch), when it says something.

        ``None`` unless the same store served the whole period and one period before it (when its
        entries were stored). Content keys that still miss then name other tensors than the stored
        ones: warned once, with the usual cause (batches padded to their own longest sequence).
        """
        measured = self._period.rate(self.store)
        if measured is None:
            return None
        rate, lookups = measured
        store = self.store
        assert store is not None
        if self.key == "content" and rate < _LOW_HIT_RATE:
            if self.input_augmented is not None:
                cause = (
                    f"{self.input_augmented}. Turn the augmentation off to cache, or use cache=False. Results are exact; "
                    "only the speed-up is lost (autocache/period_hit_rate)."
                )
            else:
                cause = (
                    "Content keys name the exact tensor that enters the frozen blocks, so "
                    "a sample that arrives as another tensor misses: most often the batches are padded to their own "
                    "longest sequence (a sample's length then depends on its batch-mates). Pad to fixed lengths or to "
                    "length buckets (the example's data.bucket_tokens). A random augmentation or masking of the input "
                    "misses by design: cache_key='index' would not help there (it refuses inputs that change between "
                    "epochs); it suits only samples that enter the model unchanged every epoch. Results are exact; only "
                    "the speed-up is lost (autocache/period_hit_rate)."
                )
            separator = ": " if self.input_augmented is not None else ". "
            self._said(
                "low hits",
                f"AutoCache: only {rate:.0%} of {lookups} lookups hit in an epoch after the entries of boundary "
                f"{store.boundary} were stored{separator}{cause}",
            )
        return rate

    def stats(self) -> dict[str, float]:
        """Hits, misses and bytes of the current store and the batch counters, for the logger."""
        return cache_metrics(self.store, self.counters, enabled=self.enabled, advanced=self.advanced, can_engage=self.never_engages is None)


def _warn_from_rank_zero(message: str, stacklevel: int) -> None:
    if not torch.distributed.is_available() or not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        warnings.warn(message, stacklevel=stacklevel + 1)


def _warn(message: str) -> None:
    """A warning from global rank 0 only (every replica would say the same)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        warnings.warn(message, stacklevel=3)


class _Reattach:
    """Re-attach ``cache`` to ``stack`` when its ``pre`` is refined and the first module before it changed.

    Equal for the same cache and stack, so that a stack keeps one listener per cache however often it attaches.
    """

    def __init__(self, cache: AutoCache, stack: BlockStack, root: nn.Module | None) -> None:
        self.cache, self.stack, self.root = cache, stack, root
        self.first = stack.pre[0][1] if stack.pre else None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Reattach) and other.cache is self.cache and other.stack is self.stack

    def __hash__(self) -> int:
        return hash((id(self.cache), id(self.stack)))

    def __call__(self) -> None:
        first = self.stack.pre[0][1] if self.stack.pre else None
        if first is not self.first:
            self.first = first
            self.cache.attach(self.stack, self.root)
