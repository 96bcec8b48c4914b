"""The cached stack: what runs in place of the block stack when AutoCache serves the frozen prefix.

Per batch it decides whether the cache may serve (the first training forward, a trainable input,
observing hooks and unkeyable arguments all run the frozen blocks as without a cache), hands a
batch it serves to :class:`~lightning_pipetransformer.cache.batch.CachedBatch` (look up, run what
missed, store), and runs the active blocks on the boundary it returns.
:class:`~lightning_pipetransformer.cache.autocache.AutoCache` owns the stores and the decisions.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_pipetransformer import tree
from lightning_pipetransformer.cache.arguments import pack_block_inputs
from lightning_pipetransformer.cache.batch import CachedBatch, StackInput
from lightning_pipetransformer.cache.budget import CacheConfigError
from lightning_pipetransformer.cache.prefix import run_blocks
from lightning_pipetransformer.stack.execution import graph_leaves
from lightning_pipetransformer.stack.input_grad import as_marked_input, gradient_leaf
from lightning_pipetransformer.stack.stack_call import BlockArgs, StackCall

if TYPE_CHECKING:
    from lightning_pipetransformer.cache.autocache import AutoCache

#: How :func:`input_gradient` begins: the stack's input itself trains something (trainable embeddings, usually).
_INPUT_TRAINS = "the input of the frozen blocks requires grad and its gradient trains something"


def first_trainable(calls: Sequence[BlockArgs], parameter_names: Mapping[int, str] | None = None) -> str | None:
    """Names the first tensor among the blocks' arguments that requires grad, and the parameters its gradient
    reaches when ``parameter_names`` knows them (``None``: no argument requires grad)."""
    for index, (args, kwargs) in enumerate(calls):
        for name, value in [*((f"argument {i + 1}", a) for i, a in enumerate(args)), *((f"argument {k}", v) for k, v in kwargs.items())]:
            trainable = [t for t in tree.tensors(value) if t.requires_grad]
            if trainable:
                found = [parameter_names[id(p)] for p in graph_leaves(trainable) if parameter_names and id(p) in parameter_names]
                source = f", computed from {', '.join(sorted(set(found))[:3])}" if found else ""
                return f"block {index}'s {name}{source}"
    return None


def input_gradient(leaf: Any, parameter_names: Mapping[int, str]) -> str:
    """What the frozen blocks' input trains, in words (``leaf``: :func:`~lightning_pipetransformer.stack.input_grad.gradient_leaf`)."""
    name = parameter_names.get(id(leaf)) if isinstance(leaf, Tensor) else None
    return _INPUT_TRAINS + (f" (it reaches {name})" if name else "")


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
        skipped, pending = cache.embeddings.arrived(call.hidden)
        given = StackInput.of(call.hidden, skipped)
        boundary = self._boundary(call, given, pending)
        return self.active(call.part(frozen, hidden=as_marked_input(boundary) if given.grad_free else boundary))

    def _boundary(self, call: StackCall, given: StackInput, pending: Any) -> Tensor:
        """The boundary activations: served by the cache where it may, computed as without it elsewhere."""
        cache, frozen = self.cache, self.num_frozen
        hidden, prefix_calls = given.hidden, call.calls[:frozen]
        if frozen and cache.order_pending():
            # The first training forward, whose call order decides what the prefix is (stack/execution.py): computed as
            # without the cache (with its graph, should something before the stack still train), unless an earlier
            # run kept entries for this prefix: then served read-only (cache/first_forward.py).
            early = None
            if not call.observed and not (torch.is_grad_enabled() and first_trainable(prefix_calls)):
                early = cache.first_forward_store(frozen, hidden, given.grad_free)
            keys = cache.keys_for(hidden, call.calls, pending) if early is not None else None
            if early is None or keys is None:
                cache.counters.skipped += 1
                return self._prefix(given.full(), prefix_calls)
            return self._serve(early, keys, {}, given, prefix_calls, store_misses=False)
        store = cache.boundaries.store_for(frozen)
        if store is not None and cache.prefix_change() is not None:
            # The prefix is no longer what computed the entries (unfrozen, edited, swapped: cache/watch.py). It runs as
            # the model runs it, with its graph (an unfrozen block trains), until the plan follows the model.
            cache.counters.skipped += 1
            return self._prefix(given.full(), prefix_calls)
        trains = cache.prefix_trains() if store is not None else None
        if trains is not None:
            cache.skip_once(trains)
            return self._prefix(given.full(), prefix_calls)
        if torch.is_grad_enabled() and frozen:
            trainable = (
                input_gradient(gradient_leaf(hidden), cache.parameter_names) if hidden.requires_grad and not given.grad_free
                else first_trainable(prefix_calls, cache.parameter_names)
            )
            if trainable is not None:
                # Something the frozen blocks read still trains: the gradient must flow through them,
                # and their output changes with it, so there is nothing to cache.
                self._cannot_serve(trainable)
                return self._prefix(given.full(), prefix_calls)
        if call.observed:
            # Hooks observe the blocks (stack/observers.py): served rows would not run the frozen blocks,
            # so they would miss those blocks' calls. Every block runs on the whole batch instead.
            cache.skip_once(
                f"{call.observed[0].describe()} observes the blocks, and the frozen blocks do not run for cached rows "
                "(transformers records output_hidden_states, output_attentions and output_router_logits with such hooks)"
            )
            return self._prefix_plain(given.full(), prefix_calls)
        if store is None or not cache.enabled:
            return self._prefix_plain(given.full(), prefix_calls)
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
            return self._prefix_plain(given.full(), prefix_calls)
        return self._serve(store, keys, extras, given, prefix_calls)

    def _cannot_serve(self, trainable: str) -> None:
        """The frozen blocks read ``trainable``, which requires grad: refuse (``cache=True``) or stay off."""
        cache = self.cache
        if trainable.startswith(_INPUT_TRAINS):
            # Trainable embeddings (tied to the head, or freeze_embeddings=False): expected, and exact without the cache.
            why = cache.pre_trains_because or (
                "a trainable parameter before the stack (trainable embeddings, e.g. AutoFreeze(freeze_embeddings=False), "
                "or a parameter nothing froze: name its module in AutoFreeze(pre=[...]))"
            )
            cache.skip_once(f"{trainable}: {why}")
            return
        reason = (
            f"the frozen blocks read {trainable}, which requires grad: their output changes as training goes and the "
            "gradient must flow through them, so it cannot be cached"
        )
        if cache.mode is True:
            modules = sorted({n.rsplit(".", 1)[0] for n in re.findall(r"[\w.]+\.(?:weight|bias)\b", trainable)})
            fix = (
                f"freeze {', '.join(modules)} with the prefix: AutoFreeze(pre=[<the modules before the stack>, "
                f"{', '.join(repr(m) for m in modules)}])" if modules else "freeze what produces that argument with the prefix (AutoFreeze(pre=[...]))"
            )
            raise CacheConfigError(
                f"AutoCache cannot serve this model: {reason}. To cache, {fix}; or use cache=False (or cache='auto', "
                "which then stays off)."
            )
        cache.skip_once(reason)

    def _serve(
        self, store: Any, keys: list[str], extras: dict[str, Tensor], given: StackInput, calls: Sequence[BlockArgs],
        store_misses: bool = True,
    ) -> Tensor:
        """Look up, run what missed, store (:class:`CachedBatch`; ``store_misses=False``: read-only); then count and
        check what the store returned."""
        cache, hidden = self.cache, given.hidden
        shape_in = tuple(hidden.shape[1:])
        served = CachedBatch(
            store, keys, rows=given.rows, calls=calls, extras=extras, blocks=self.blocks[: self.num_frozen], prefix=self._prefix,
            older=functools.partial(cache.boundaries.older, dtype=hidden.dtype, device=hidden.device) if cache.boundaries.holds_older else None,
            sample_shape=self._boundary_shapes.get(shape_in, shape_in), dtype=hidden.dtype, device=hidden.device,
            store_misses=store_misses, time_prefix=cache.auto.measuring,
        )
        # cache="auto" still deciding: the lookup in device time (devices/timing.py), read only when it decides.
        lookup = cache.auto.span(hidden.device)
        with lookup if lookup is not None else nullcontext():
            boundary = served.boundary()
        if served.computed_shape is not None:
            self._boundary_shapes[shape_in] = served.computed_shape
        cache.auto.prefix_ran(served.prefix_time)
        batch = hidden.shape[0]
        hit_mask = served.hit_mask
        assert hit_mask is not None
        cache.counters.count_lookup(served.served, batch)
        if served.hits:
            cache.after_hits(given.rows, calls, hit_mask, boundary, self._prefix, lookup, batch)
        return boundary

    def _prefix_plain(self, hidden: Tensor, calls: Sequence[BlockArgs]) -> Tensor:
        if self.num_frozen == 0:
            return hidden
        with torch.no_grad():
            return self._prefix(hidden, calls)
