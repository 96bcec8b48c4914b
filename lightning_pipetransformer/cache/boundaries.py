"""The boundary lifecycle: which store is current, and how the entries follow when the boundary moves.

A store holds the activations at one boundary F (its directory is named by the fingerprint of
blocks 0..F-1). When AutoFreeze freezes more blocks, F moves to F' and the entries follow in one of
three ways:

- **eager** (:meth:`Boundaries.move`, one process): the new store opens now and every entry at F runs
  through blocks F..F'-1 into it (:func:`~lightning_pipetransformer.cache.advance.advance_store`);
- **lazy** (:meth:`Boundaries.move` with ``lazy=True``): the new store opens now, the old one stays
  open beside it, and each entry is advanced when it is next looked up (:meth:`Boundaries.older`);
- **deferred** (:meth:`Boundaries.defer` then :meth:`Boundaries.sync`, several processes): the store
  opens only once every rank holds the final weights, and the ranks advance their shards together.

A boundary that waits for the call order (the first training forward) opens at the first lookup after it; with
entries kept by an earlier run it may open in that forward already (:meth:`Boundaries.open_early`,
:mod:`~lightning_pipetransformer.cache.first_forward`). With kept entries (``cache_keep``) the earlier boundaries'
folders are closed, never deleted: a later run with the same early freeze may want them (eviction removes them).

:class:`Boundaries` answers "which store is current?" (:attr:`Boundaries.current`) and holds the stores
kept for a move in progress; what a store may hold (the determinism check) and how it is opened are
given to it by AutoCache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_pipetransformer.cache.advance import advance_store
from lightning_pipetransformer.cache.prefix import run_blocks
from lightning_pipetransformer.cache.store import ActivationStore
from lightning_pipetransformer.stack.discovery import BlockStack

__all__ = ["Boundaries", "Deferred"]


@dataclass
class Deferred:
    """A boundary whose store opens later: at the sync after the transition, or at the first lookup."""

    stack: BlockStack
    num_frozen: int
    include_pre: bool
    device: torch.device
    #: What runs before the stack was still provisional when it was deferred (the first training
    #: forward decides it): the prefix is checked when the store opens, not when it was deferred.
    unchecked: bool = False


class Boundaries:
    """The current boundary's store and the stores a move keeps beside it.

    Args:
        cacheable: ``cacheable(stack, num_frozen, include_pre)``: whether that prefix may be cached
            (it may raise, or turn the cache off, and say why).
        open_store: ``open_store(stack, num_frozen, include_pre, existing_only=False)``: a new store for that
            boundary (``existing_only``: only if its folder exists already, else ``None``).
        forward_context: the context a forward runs in (autocast): an advance must compute what a
            forward would.
    """

    def __init__(
        self,
        cacheable: Callable[[BlockStack, int, bool], bool],
        open_store: Callable[..., ActivationStore | None],
        forward_context: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> None:
        self._cacheable = cacheable
        self._open_store = open_store
        self._forward_context = forward_context
        #: The store lookups go to; ``None`` while no boundary is cached or one is deferred.
        self.current: ActivationStore | None = None
        #: Deferred: the boundary to open once the weights are final.
        self.deferred: Deferred | None = None
        #: Deferred: the store it replaces, advanced at the next :meth:`sync`.
        self._replaced: ActivationStore | None = None
        #: Lazy: the stores of earlier boundaries, newest first.
        self._older: list[ActivationStore] = []
        #: The stack and device of the last move: where an advance runs the blocks.
        self.where: tuple[BlockStack, torch.device] | None = None
        #: Entries this process advanced into the current store since it opened.
        self.advanced = 0
        #: The boundary whose store :meth:`open_early` opened before the call order was known.
        self._early: Deferred | None = None

    # ------------------------------------------------------------------ which store

    def serves(self, num_frozen: int) -> bool:
        """Whether boundary ``num_frozen`` is cached (its store open, or deferred)."""
        if self.current is not None and self.current.boundary == num_frozen:
            return True
        return self.deferred is not None and self.deferred.num_frozen == num_frozen

    def store_for(self, num_frozen: int) -> ActivationStore | None:
        """The store of boundary ``num_frozen``, opening a deferred one (cold) if it is still waiting."""
        if self.current is None and self.deferred is not None and self.deferred.num_frozen == num_frozen:
            self._open_deferred()
        store = self.current
        return store if store is not None and store.boundary == num_frozen else None

    # ------------------------------------------------------------------ eager and lazy (one process)

    def move(
        self, stack: BlockStack, num_frozen: int, include_pre: bool, device: torch.device, shard: tuple[int, int],
        *, lazy: bool = False, order_pending: bool = False,
    ) -> None:
        """Open the store for boundary ``num_frozen`` now, advancing the previous one's entries.

        ``lazy``: advance each entry when it is looked up next (:meth:`older`), not all of them now.
        The work is the same for the entries used again, and it lands where they are used: a training
        batch pays for its own samples, validation for the validation entries, and an entry never
        read again costs nothing. The earlier stores stay open (their memory counts against the
        budget) until the fit ends. ``order_pending``: what runs before the stack is known only after
        the first training forward; a first store is then checked and opened at the first lookup.
        """
        previous = self.current
        self.deferred = self._early = None
        if self._replaced is not None:
            self._replaced.close()
            self._replaced = None
        self.where = (stack, device)
        if previous is None and order_pending:
            # What runs before the stack is known after the first training forward; the frozen blocks are known
            # now: a stochastic block is refused before any step (the rest is checked when the order is known).
            if not self._cacheable(stack, num_frozen, False):
                self.current = None
                return
            self.deferred = Deferred(stack, num_frozen, include_pre, device, unchecked=True)
            return
        if not self._cacheable(stack, num_frozen, include_pre):
            self.current = None
            self._drop_older()
            if previous is not None:
                previous.close(delete=True)
            return
        self.current = self._open(stack, num_frozen, include_pre)
        if previous is None or previous.boundary >= num_frozen:
            return
        if lazy:
            self._older.insert(0, previous)  # newest first: an entry is advanced from the latest boundary that has it
            self._share_budget()
            return
        with torch.no_grad(), self._forward_context():
            self.advanced = advance_store(
                previous, self.current, run_blocks(stack.blocks[previous.boundary : num_frozen]), device=device, shard=shard,
            )
        if shard[0] == 0:
            previous.close(delete=True)  # kept if another run on the same weights still uses it
        else:
            previous.close()

    def older(self, keys: Sequence[str], *, dtype: torch.dtype, device: torch.device) -> list[tuple[int, Tensor, Tensor]]:
        """Entries for ``keys`` (missing at the current boundary) held at earlier boundaries, newest first.

        Returns ``(boundary, found, activations)`` per earlier store that had some: ``found`` a CPU
        bool mask over ``keys`` (each key found once, at its latest boundary), ``activations`` the
        stacked entries there. The caller runs them through the blocks from that boundary on and
        stores them at the current one; they leave the earlier store's memory now.
        """
        if not self._older:
            return []
        left = torch.ones(len(keys), dtype=torch.bool)
        found: list[tuple[int, Tensor, Tensor]] = []
        for older in self._older:
            if not bool(left.any()):
                break
            wanted = [k for k, want in zip(keys, left.tolist()) if want]
            in_memory = [older.in_memory(k) for k in wanted]
            hit_mask, hits = older.lookup(wanted, dtype=dtype, device=device)
            if not bool(hit_mask.any()):
                continue
            if self.current is not None:  # the current store missed them; the cache as a whole did not
                from_memory = sum(m for m, hit in zip(in_memory, hit_mask.tolist()) if hit)
                self.current.count_as_hits(from_memory, int(hit_mask.sum()) - from_memory)
            mask = torch.zeros(len(keys), dtype=torch.bool)
            mask[left.nonzero().flatten()[hit_mask]] = True
            left &= ~mask
            older.discard([k for k, hit in zip(wanted, hit_mask.tolist()) if hit])
            found.append((older.boundary, mask, hits))
        self.advanced += sum(int(m.sum()) for _, m, _ in found)
        self._share_budget()
        return found

    def open_early(self) -> ActivationStore | None:
        """The first training forward, before the call order is known: the waiting boundary's store now, if its folder
        exists already (kept by an earlier run); ``None`` otherwise (it keeps waiting for the order)."""
        deferred = self.deferred
        if deferred is None or not deferred.unchecked or self.current is not None:
            return None
        store = self._open_store(deferred.stack, deferred.num_frozen, deferred.include_pre, existing_only=True)
        if store is None:
            return None
        self.current, self.advanced, self._early, self.deferred = store, 0, deferred, None
        return store

    def settle_early(self, same: bool) -> None:
        """The call order is known. ``same``: the store :meth:`open_early` opened is on the prefix as observed, and
        stays. Otherwise let go of it (its folder stays) and wait again, to be checked and opened on the prefix as
        observed at the next lookup."""
        early, self._early = self._early, None
        if early is None or same:
            return
        if self.current is not None:
            self.current.close()
        self.current = None
        self.deferred = Deferred(early.stack, early.num_frozen, early.include_pre, early.device, unchecked=True)

    def check_deferred(self) -> None:
        """What runs before the stack is known now (the first training forward, before its backward): a boundary
        waiting for it is checked now, so that a prefix the cache cannot serve is refused before the first
        optimizer step, not at the first lookup after it."""
        deferred = self.deferred
        if deferred is None or not deferred.unchecked:
            return
        deferred.unchecked = False
        if not self._cacheable(deferred.stack, deferred.num_frozen, deferred.include_pre):
            self.deferred = None

    def retire(self) -> None:
        """The prefix changed under the stores: every one of them goes (their directories too, unless another run
        still holds one), nothing is deferred; the next move opens the boundary anew."""
        if self.current is not None:
            self.current.close(delete=True)
            self.current = None
        if self._replaced is not None:
            self._replaced.close(delete=True)
            self._replaced = None
        self._drop_older()
        self.deferred = self._early = None
        self.advanced = 0

    def holds(self, key: str) -> bool:
        """Whether a store that could serve ``key`` has an entry for it (the current one, or an older one a lazy advance reads)."""
        return any(store.holds(key) for store in (self.current, *self._older) if store is not None)

    @property
    def holds_older(self) -> bool:
        """Whether earlier boundaries' stores are still open (a lazy advance in progress)."""
        return bool(self._older)

    def _share_budget(self) -> None:
        """Entries of earlier boundaries still in memory count against the one budget."""
        if self.current is not None:
            self.current.reserve(sum(older.bytes_in_memory for older in self._older))

    def _drop_older(self) -> None:
        """The earlier boundaries' stores, with entries never read again: gone (their directories too)."""
        for older in self._older:
            older.close(delete=True)
        self._older = []

    def close(self) -> None:
        """End of the fit: let go of the earlier boundaries' entries (the current store stays for validate/test)."""
        self._drop_older()
        if self.current is not None:
            self.current.reserve(0)

    # ------------------------------------------------------------------ deferred (several processes)

    def defer(self, stack: BlockStack, num_frozen: int, include_pre: bool, device: torch.device) -> None:
        """Check boundary ``num_frozen`` now, open its store later.

        The store's directory is named by a fingerprint of the frozen weights, and a replica that
        AutoDP adds receives those weights only after the new plan is applied: the store opens at
        :meth:`sync` (every rank, right after the transition) or, failing that, at the first
        forward (:meth:`store_for`). The current store is kept until then, so that its entries can
        be advanced.
        """
        if self.deferred is not None and self.deferred.num_frozen == num_frozen and self.current is None:
            return
        if self.current is not None and self.current.boundary == num_frozen:
            self.deferred = None
            return
        old, self.current = self.current, None
        if old is not None:
            if old.boundary < num_frozen:
                if self._replaced is not None:
                    self._replaced.close()
                self._replaced = old
            else:
                old.close()
        self.where = (stack, device)
        self.deferred = Deferred(stack, num_frozen, include_pre, device) if self._cacheable(stack, num_frozen, include_pre) else None

    def sync(self, group: Any, node: int = 0) -> int:
        """Every rank, same order: open the deferred store and advance the previous boundary's entries together.

        Called on *all* ranks of ``group`` (shadow ranks too) after the transition sent new
        replicas their weights. Each rank that held the previous boundary's store advances its
        shard of the entries (``shard_of(key, n)`` over the ``n`` such ranks of its node, which see
        the same ``cache_dir``) into the new store; with ``write_through`` they land on disk.
        Then every rank closes the previous store (releasing its lock on the directory) and a
        barrier: nobody reads the new boundary before every shard is written, so replicas that
        join now hit entries written by the others instead of re-warming. Finally one of the
        advancing ranks deletes the previous boundary's directory, unless another run on the same
        frozen weights still holds it open (it is then that run's to delete).
        Returns the number of entries this rank advanced.
        """
        import torch.distributed as dist

        previous, self._replaced = self._replaced, None
        if previous is not None:
            # This rank's last misses may still be on their way to the host (cache/host_copy.py): they become
            # entries (files, for the others to list) before the all-gather below orders every rank's listing after them.
            previous.finish_copies()
        if self.deferred is not None:
            self._open_deferred()
        store = self.current
        advancing = previous is not None and store is not None and self.where is not None and previous.boundary < store.boundary
        mine = torch.tensor(
            [node, previous.boundary, store.boundary] if advancing else [-1, -1, -1],  # type: ignore[union-attr]
            dtype=torch.int64,
        )
        gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        advanced = 0
        first = False
        if advancing:
            # Shard among the ranks that advance the same boundaries into the same node's directory.
            peers = [r for r, theirs in enumerate(gathered) if bool(torch.equal(theirs, mine))]
            me = dist.get_rank(group)
            first = peers[0] == me
            stack, device = self.where  # type: ignore[misc]
            with torch.no_grad(), self._forward_context():
                advanced = advance_store(
                    previous, store, run_blocks(stack.blocks[previous.boundary : store.boundary]),  # type: ignore[union-attr]
                    device=device, shard=(peers.index(me), len(peers)),
                )
            self.advanced = advanced
        if previous is not None:
            # Every rank lets go of the old directory before the barrier; after it, one deletes it
            # (its exclusive lock would fail while any store of the node still held it).
            previous.close()
        dist.barrier(group=group)
        if previous is not None and first:
            previous.close(delete=True)
        return advanced

    def _open_deferred(self) -> None:
        deferred, self.deferred = self.deferred, None
        assert deferred is not None
        if deferred.unchecked and not self._cacheable(deferred.stack, deferred.num_frozen, deferred.include_pre):
            return
        self.current = self._open(deferred.stack, deferred.num_frozen, deferred.include_pre)

    def _open(self, stack: BlockStack, num_frozen: int, include_pre: bool) -> ActivationStore:
        store = self._open_store(stack, num_frozen, include_pre)
        assert store is not None
        self.advanced = 0
        return store
