"""One batch the cache serves, top to bottom: look up, run what missed, store, hand the boundary on.

::

    keys --lookup--> hit_mask, hits ------------------------------------------------.
      misses --an earlier boundary's entries (lazy advance), through blocks b..F-1 --.  |
             --the rest from the input, through the frozen prefix (no grad) --------+--> computed --store--> merge --> boundary

Only the misses run; the merged batch enters the first active block with the batch's own block
arguments (attention mask ...), which the model computes as usual. New entries are stored with
every block's inputs from the boundary on (:func:`~lightning_pipetransformer.cache.arguments.pack_block_inputs`),
so that a later boundary move can advance them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipetransformer.cache.arguments import select_rows
from lightning_pipetransformer.cache.prefix import run_blocks
from lightning_pipetransformer.cache.rows import put_rows, take_rows
from lightning_pipetransformer.cache.store import ActivationStore
from lightning_pipetransformer.devices.timing import DeviceSpan
from lightning_pipetransformer.stack.input_grad import needs_no_gradient
from lightning_pipetransformer.stack.stack_call import BlockArgs

__all__ = ["CachedBatch", "OlderEntries", "StackInput", "merge_rows"]

#: ``older(keys) -> [(boundary, found, activations), ...]``: entries for ``keys`` (all missing at the current
#: boundary) that earlier boundaries' stores still hold, newest first; ``found`` a CPU bool mask over ``keys``.
OlderEntries = Callable[[Sequence[str]], list[tuple[int, Tensor, Tensor]]]

#: The frozen prefix: ``prefix(hidden, calls)`` runs blocks 0..F-1, block ``i`` with ``calls[i]``.
Prefix = Callable[[Tensor, Sequence[BlockArgs]], Tensor]


@dataclass
class StackInput:
    """What enters the frozen blocks in one forward: the hidden state, or the record of skipped embeddings.

    ``hidden`` is a placeholder when the embeddings were skipped (``skipped`` is then their record):
    :meth:`rows` runs them for the rows that need real values (misses, verified hits), :meth:`full`
    for all rows. ``grad_free``: the input requires grad only because a hook marked it
    (enable_input_require_grads under gradient checkpointing or PEFT), with no parameter behind it:
    the frozen prefix needs no graph and can be served; the boundary is marked again for the active
    blocks (stack/input_grad.py).
    """

    hidden: Tensor
    skipped: Any
    grad_free: bool

    @classmethod
    def of(cls, hidden: Tensor, skipped: Any) -> StackInput:
        grad_free = torch.is_grad_enabled() and hidden.requires_grad and (skipped is not None or needs_no_gradient(hidden))
        return cls(hidden, skipped, grad_free)

    def rows(self, mask: Tensor) -> Tensor:
        if self.skipped is not None:
            return self.skipped.rows(mask)
        source = self.hidden.detach() if self.grad_free else self.hidden
        return take_rows(source, mask)

    def full(self) -> Tensor:
        """Never the placeholder: where the cache stands aside, the real embeddings run."""
        if self.skipped is not None:
            return self.skipped.rows()
        return self.hidden.detach() if self.grad_free else self.hidden


class CachedBatch:
    """The boundary activations of one batch, computing only what the store misses.

    Args:
        store: the store of the current boundary F.
        keys: one key per sample.
        rows: ``rows(mask)`` the input of the frozen blocks for the rows in ``mask`` (the real
            embeddings where they were skipped).
        calls: the frozen blocks' ``(args, kwargs)`` after the hidden state.
        extras: per-sample tensors ``[B, ...]`` kept with new entries (the blocks' inputs from F on).
        blocks: the frozen blocks 0..F-1 (an earlier boundary b's entries run blocks b..F-1).
        prefix: runs all frozen blocks (installed by the cached stack, so that it can be observed).
        older: where entries of earlier boundaries come from (a lazy advance); ``None``: nowhere (then
            the misses' rows are not even listed for it).
        sample_shape, dtype, device: of one activation, as the first active block expects it.
        store_misses: ``False``: read-only, the misses are computed but not stored (the first forward served from
            kept entries before the call order is known: cache/first_forward.py).
        time_prefix: time the frozen prefix in device time (``cache="auto"`` still deciding: cache/auto_mode.py);
            ``False``: nothing is timed.

    After :meth:`boundary`: ``hit_mask`` and ``hits`` (the rows the store held), ``served`` (those plus the
    rows an earlier boundary held: the cache answered them), ``prefix_time`` (with ``time_prefix``, when the
    frozen prefix ran: its :class:`~lightning_pipetransformer.devices.timing.DeviceSpan` and the rows it ran, not
    read here: reading waits for the device) and ``computed_shape`` (one computed activation's shape).
    """

    def __init__(
        self,
        store: ActivationStore,
        keys: Sequence[str],
        *,
        rows: Callable[[Tensor], Tensor],
        calls: Sequence[BlockArgs],
        extras: Mapping[str, Tensor],
        blocks: Sequence[nn.Module],
        prefix: Prefix,
        older: OlderEntries | None = None,
        sample_shape: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        store_misses: bool = True,
        time_prefix: bool = False,
    ) -> None:
        self.store = store
        self.store_misses = store_misses
        self.time_prefix = time_prefix
        self.keys = list(keys)
        self.rows = rows
        self.calls = calls
        self.extras = extras
        self.blocks = tuple(blocks)
        self.prefix = prefix
        self.older = older
        self.sample_shape = sample_shape
        self.dtype = dtype
        self.device = device
        self.hit_mask: Tensor | None = None
        self.hits = 0
        self.served = 0
        self.prefix_time: tuple[DeviceSpan, int] | None = None
        self.computed_shape: tuple[int, ...] | None = None

    def boundary(self) -> Tensor:
        """The whole batch's boundary activations ``[B, ...]``."""
        hit_mask, hits = self.store.lookup(self.keys, sample_shape=self.sample_shape, dtype=self.dtype, device=self.device)
        self.hit_mask = hit_mask
        hit = hit_mask.tolist()  # the mask is host data: read once, no wait for the device
        self.hits = self.served = sum(hit)
        if self.hits == len(hit):
            return hits
        miss = ~hit_mask
        computed = self._run_misses(miss)
        if self.store_misses:
            self._store(miss, [k for k, found in zip(self.keys, hit) if not found], computed)
        return merge_rows(hit_mask, hits, computed)

    def _run_misses(self, miss: Tensor) -> Tensor:
        """The misses' activations, in batch order: from earlier boundaries where held, else from the input."""
        parts = self._advance_older(miss)
        left = miss.clone()
        for taken, _ in parts:
            left &= ~taken
        if bool(left.any()):
            parts.append((left, self._run_prefix(left)))
        computed = parts[0][1] if len(parts) == 1 else _in_batch_order(miss, parts)
        self.computed_shape = tuple(computed.shape[1:])
        return computed

    def _advance_older(self, miss: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Misses an earlier boundary ``b`` holds run only blocks b..F-1, with this pass's own arguments
        (the keys cover them, so they are the entry's): ``[(batch rows, activations), ...]``."""
        if self.older is None:
            return []
        miss_rows = miss.nonzero().flatten()
        parts: list[tuple[Tensor, Tensor]] = []
        for boundary, found, held in self.older([self.keys[i] for i in miss_rows.tolist()]):
            taken = torch.zeros_like(miss)
            taken[miss_rows[found]] = True
            with torch.no_grad():
                parts.append((taken, run_blocks(self.blocks[boundary:])(held, select_rows(self.calls[boundary:], taken, miss.numel()))))
            self.served += int(found.sum())
        return parts

    def _run_prefix(self, rows: Tensor) -> Tensor:
        """The frozen prefix, without a graph, for the rows in ``rows``; with ``time_prefix`` in device time."""
        if not self.time_prefix:
            return self._prefix_rows(rows)
        span = DeviceSpan(self.device if self.device is not None else rows.device)
        with span:
            out = self._prefix_rows(rows)
        self.prefix_time = (span, out.shape[0])
        return out

    def _prefix_rows(self, rows: Tensor) -> Tensor:
        hidden = self.rows(rows)
        with torch.no_grad():
            return self.prefix(hidden, select_rows(self.calls, rows, rows.numel()))

    def _store(self, miss: Tensor, miss_keys: list[str], computed: Tensor) -> None:
        self.store.store(miss_keys, computed, {n: take_rows(t, miss) for n, t in self.extras.items()})


def _in_batch_order(miss: Tensor, parts: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
    """The misses' rows ``[misses, ...]`` from ``parts`` (each: which batch rows, their activations)."""
    at = torch.cumsum(miss, 0) - 1  # a batch row's position among the misses
    first = parts[0][1]
    out = torch.empty((int(miss.sum()), *first.shape[1:]), dtype=first.dtype, device=first.device)
    for rows, values in parts:  # positions known on the host: scattered by index, without a count on the device
        out.index_copy_(0, at[rows].to(out.device, non_blocking=True), values)
    return out


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
    out = computed.new_empty((hit_mask.numel(), *computed.shape[1:]))
    put_rows(out, hit_mask, hits)
    put_rows(out, ~hit_mask, computed)
    return out
