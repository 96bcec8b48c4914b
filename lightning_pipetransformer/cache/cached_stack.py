"""The cached stack: what runs in place of the block stack when AutoCache serves the frozen prefix.

Per batch: keys, lookups, the frozen blocks only for the misses, then the active blocks on the
merged boundary activations. :class:`~lightning_pipetransformer.cache.autocache.AutoCache` owns the store.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_pipetransformer.cache.advance import (
    cached_prefix,
    pack_block_inputs,
    select_rows,
)
from lightning_pipetransformer.cache.prefix import run_blocks
from lightning_pipetransformer.pipe.microbatch import tensors_in
from lightning_pipetransformer.stack.execution import graph_leaves
from lightning_pipetransformer.stack.input_grad import as_marked_input, gradient_leaf, needs_no_gradient
from lightning_pipetransformer.stack.interception import BlockArgs, StackCall

if TYPE_CHECKING:
    from lightning_pipetransformer.cache.autocache import AutoCache


def first_trainable(calls: Sequence[BlockArgs], parameter_names: Mapping[int, str] | None = None) -> str | None:
    """Names the first tensor among the blocks' arguments that requires grad, and the parameters its gradient
    reaches when ``parameter_names`` knows them (``None``: no argument requires grad)."""
    for index, (args, kwargs) in enumerate(calls):
        for name, value in [*((f"argument {i + 1}", a) for i, a in enumerate(args)), *((f"argument {k}", v) for k, v in kwargs.items())]:
            trainable = [t for t in tensors_in(value) if t.requires_grad]
            if trainable:
                found = [parameter_names[id(p)] for p in graph_leaves(trainable) if parameter_names and id(p) in parameter_names]
                source = f", computed from {', '.join(sorted(set(found))[:3])}" if found else ""
                return f"block {index}'s {name}{source}"
    return None


class CachedStack:
    """Installed in place of the stack: frozen prefix from the store, active blocks by ``active``."""

    def __init__(self, cache: AutoCache, blocks: Sequence[nn.Module], num_frozen: int, active: Callable[[StackCall], Any]) -> None:
        self.cache = cache
        self.blocks = tuple(blocks)  # install_pipeline checks these against the container
        self.num_frozen = num_frozen
        self.active = active
        self._prefix = run_blocks(self.blocks[:num_frozen])
        #: The boundary's per-sample shape for an input's per-sample shape (a stage may change it, e.g. Swin).
        self._boundary_shapes: dict[tuple[int, ...], tuple[int, ...]] = {}

    def run(self, call: StackCall) -> Any:
        cache, frozen = self.cache, self.num_frozen
        hidden, prefix_calls = call.hidden, call.calls[:frozen]
        # ``hidden`` is a placeholder when the embeddings were skipped: ``rows`` runs them for
        # the rows that need real values (misses, verified hits), ``full`` for all rows.
        skipped, pending = cache.arrived(hidden)
        # The input requires grad only because a hook marked it (enable_input_require_grads under gradient
        # checkpointing or PEFT), with no parameter behind it: the frozen prefix needs no graph and can be
        # served; the boundary is marked again for the active blocks (stack/input_grad.py).
        grad_free = torch.is_grad_enabled() and hidden.requires_grad and (skipped is not None or needs_no_gradient(hidden))
        source = hidden.detach() if grad_free and skipped is None else hidden
        rows: Callable[[Tensor], Tensor] = skipped.rows if skipped is not None else (lambda m: source[m.to(source.device)])

        def full() -> Tensor:
            # Never the placeholder: where the cache stands aside, the real embeddings run.
            return skipped.rows() if skipped is not None else source

        def active(boundary: Tensor) -> Any:
            return self.active(call.part(frozen, hidden=as_marked_input(boundary) if grad_free else boundary))

        if frozen and cache.order_pending():
            # The first training forward, whose call order decides what the prefix is (stack/execution.py):
            # computed as without the cache (with its graph, should something before the stack still train).
            cache.batches_skipped += 1
            return active(self._prefix(full(), prefix_calls))
        store = cache.current_store(frozen)
        if torch.is_grad_enabled() and frozen:
            trainable = (
                cache.describe_input_gradient(gradient_leaf(hidden)) if hidden.requires_grad and not grad_free
                else first_trainable(prefix_calls, cache.parameter_names)
            )
            if trainable is not None:
                # Something the frozen blocks read still trains: the gradient must flow through them,
                # and their output changes with it, so there is nothing to cache.
                cache.cannot_serve(trainable)
                return active(self._prefix(full(), prefix_calls))
        if call.observed:
            # Hooks observe the blocks (stack/observers.py): served rows would not run the frozen blocks,
            # so they would miss those blocks' calls. Every block runs on the whole batch instead.
            cache.skip_once(
                f"{call.observed[0].describe()} observes the blocks, and the frozen blocks do not run for cached rows "
                "(transformers records output_hidden_states, output_attentions and output_router_logits with such hooks)"
            )
            return active(self._prefix_plain(full(), prefix_calls))
        if store is None or not cache.enabled:
            return active(self._prefix_plain(full(), prefix_calls))
        batch = hidden.shape[0]
        # Keys cover every block's arguments, not only the frozen ones': they must stay the same when
        # the boundary moves, so that advanced entries are found (a change in an active block's
        # arguments then misses where it could hit: exact, only slower).
        keys = cache.keys_for(hidden, call.calls, pending)
        try:
            # Every block's inputs from the boundary on: an advance F -> F' runs blocks F..F'-1 with them.
            extras = pack_block_inputs(call.calls[frozen:], frozen, batch)
        except TypeError as err:
            cache.skip_once(f"a block argument cannot be stored per sample ({err})")
            keys = None
        if keys is None:
            return active(self._prefix_plain(full(), prefix_calls))
        timing: dict[str, float] = {}
        from_older = [0]  # rows an earlier boundary's entries answered (a lazy advance): served by the cache too
        shape_in = tuple(hidden.shape[1:])

        def compute(miss: Tensor) -> Tensor:
            # Misses held at an earlier boundary (lazy advance) run only the blocks from there on, with
            # this pass's own arguments (the keys cover them, so they are the entry's); the rest from the input.
            at = torch.cumsum(miss, 0) - 1  # a batch row's position among the misses
            parts: list[tuple[Tensor, Tensor]] = []
            left = miss.clone()
            miss_rows = miss.nonzero().flatten()
            for boundary, found, hits in cache.from_older([keys[i] for i in miss_rows.tolist()], dtype=hidden.dtype, device=hidden.device):
                batch_rows = torch.zeros_like(miss)
                batch_rows[miss_rows[found]] = True
                with torch.no_grad():
                    parts.append((batch_rows, run_blocks(self.blocks[boundary:frozen])(hits, select_rows(prefix_calls[boundary:], batch_rows, batch))))
                left &= ~batch_rows
                from_older[0] += int(found.sum())
            if bool(left.any()):
                start = time.perf_counter()
                h = rows(left)
                with torch.no_grad():
                    parts.append((left, self._prefix(h, select_rows(prefix_calls, left, batch))))
                timing["compute"] = (time.perf_counter() - start) / max(1, h.shape[0])
            if len(parts) == 1:
                out = parts[0][1]
            else:
                out = torch.empty((int(miss.sum()), *parts[0][1].shape[1:]), dtype=parts[0][1].dtype, device=parts[0][1].device)
                for batch_rows, values in parts:
                    out[at[batch_rows].to(out.device)] = values
            self._boundary_shapes[shape_in] = tuple(out.shape[1:])
            return out

        start = time.perf_counter()
        boundary, hit_mask = cached_prefix(
            store, keys, compute, extras=extras,
            sample_shape=self._boundary_shapes.get(shape_in, shape_in), dtype=hidden.dtype, device=hidden.device,
        )
        total = time.perf_counter() - start
        if "compute" in timing:
            cache.compute_time = timing["compute"]
        cache.served(int(hit_mask.sum()) + from_older[0], batch)
        if bool(hit_mask.any()):
            cache.after_hits(rows, prefix_calls, hit_mask, boundary, self._prefix, total, batch)
        return active(boundary)

    def _prefix_plain(self, hidden: Tensor, calls: Sequence[BlockArgs]) -> Tensor:
        if self.num_frozen == 0:
            return hidden
        with torch.no_grad():
            return self._prefix(hidden, calls)
