"""The strategy's cache hooks as free functions: build AutoCache for a fit, check its budget, hand it index keys.

They take what they need (the configuration, the module, the group) and return data, so the
strategy's hooks are one call each and AutoCache never sees the strategy.
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipetransformer.cache.autocache import AutoCache
from lightning_pipetransformer.cache.budget import CacheConfigError, check_batch_fits
from lightning_pipetransformer.cache.folders import default_cache_dir, remove_empty_folders
from lightning_pipetransformer.cache.indices import BatchIndices
from lightning_pipetransformer.cache.store import probe_cache_dir
from lightning_pipetransformer.config import CacheConfig
from lightning_pipetransformer.freeze.apply import tied_outside, untrainable_prefix
from lightning_pipetransformer.freeze.seam import FreezeSource
from lightning_pipetransformer.stack.discovery import BlockStack

__all__ = [
    "check_budget", "close_autocache", "index_keys_from", "input_augmentation", "make_autocache", "pre_freezes_first", "reuse_autocache",
]  # fmt: skip


def make_autocache(
    config: CacheConfig,
    *,
    stack: BlockStack,
    module: nn.Module,
    default_root_dir: str,
    processes_per_node: int,
    precision: str,
    forward_context: Callable[[], Any],
    include_pre: bool,
    can_freeze: bool = True,
    pre_freezes_first: Callable[[], bool] = lambda: False,
    announce: Callable[[str], None] = lambda message: None,
) -> AutoCache:
    """AutoCache for one fit: its directory checked now (before training), keyed on the right inputs.

    ``include_pre``: key on the embeddings' inputs (the embeddings are frozen, or there is no
    AutoFreeze); with trainable embeddings the cache keys on the hidden state itself.
    ``can_freeze``: something in the run can freeze blocks (AutoFreeze). Without it, and with no
    leading block frozen before fit, the cache can never serve: said once now, and logged as
    ``autocache_diagnostics/can_engage`` = 0, rather than a cache that silently never turns on.
    ``pre_freezes_first``: whether AutoFreeze freezes the modules before the stack with the first block before the
    first step's backward (a first step served from kept entries may then cut their gradient); ``announce``: where
    notes that are not warnings go.
    """
    directory = config.dir or default_cache_dir(default_root_dir)
    try:
        probe_cache_dir(directory)
    except CacheConfigError as err:
        if not config.keep:
            raise
        # A folder of kept entries that cannot be written (a read-only mount of an earlier sweep's): what it holds is
        # still read; this run's entries stay in its memory (a per-run cache), said once here and by each store.
        warnings.warn(f"AutoCache: {err} With cache_keep=True the entries kept there are read; this run keeps its own in "
                      "memory only (a per-run cache).", stacklevel=2)
    # Index keys name a sample of this run only (a per-run namespace): kept for later runs they could never be found.
    keep = config.keep and config.key == "content"
    cache = AutoCache(
        # The node's budget, split over its processes: 8 replicas must not hold 8 x cache_memory.
        config.mode, directory, config.memory // max(1, processes_per_node), write_through=processes_per_node > 1,
        key=config.key, skip_embeddings=config.skip_embeddings, keep=keep, keep_bytes=config.keep_bytes,
    )
    cache.announce = announce
    cache.pre_freezes_first = pre_freezes_first
    if config.keep and not keep and int(os.environ.get("RANK", "0")) == 0:
        warnings.warn(
            "cache_keep=True with cache_key='index': index keys name a sample of this run only (an index says nothing of "
            "the sample's content, so another run's index 7 may be another sample), so this run's entries stay per run: "
            "nothing is kept for later runs and nothing kept is read. To share entries across runs, use "
            "cache_key='content'.",
            stacklevel=2,
        )
    # Entries computed at another precision must never be returned; index keys are only unique
    # within this set-up (this run, these loaders; several processes take rank 0's namespace).
    cache.fingerprint_extra = f"precision={precision}"
    cache.parameter_names = {id(p): name for name, p in module.named_parameters()}
    cache.namespace = uuid.uuid4().hex[:12] + "-"
    # Entries advanced at a boundary move must equal what a forward computes (bf16-mixed: autocast).
    cache.forward_context = forward_context
    cache.order_pending = lambda: stack.provisional
    cache.frozen_eval = config.frozen_eval
    # A boundary opened before the call order was known is checked as soon as it is (before the first optimizer step);
    # a store opened early on kept entries is confirmed or let go then (cache/first_forward.py).
    stack.when_refined(cache.refined)
    tied = tied_outside(stack, module)
    if tied and not include_pre:
        listed = ", ".join(f"{a} is {b}" for a, b in tied[:3])
        cache.pre_trains_because = (
            f"the input embeddings are tied to the output head ({listed}), so AutoFreeze keeps them training (freezing "
            "them would freeze the head) and the frozen blocks' input changes every step. To use the cache, untie them: "
            "tie_word_embeddings=False in the model's config (the head gets its own copy of the weights and trains "
            "alone; the embeddings then freeze with the first block). Or freeze both: AutoFreeze(pre=[...]) naming them"
        )
    if include_pre:
        cache.attach(stack, module)
    cache.batch_bytes.watch(stack.blocks[0])  # checked at the first training step
    augmented = input_augmentation(module)
    if augmented is not None:
        cache.input_augmented = augmented
        if int(os.environ.get("RANK", "0")) == 0:
            warnings.warn(
                f"AutoCache will miss: {augmented}. Content keys name the exact tensor that enters the frozen blocks, "
                "so nothing stored is looked up again. To cache, turn the augmentation off (mask_time_prob=0 and "
                "mask_feature_prob=0, or apply_spec_augment=False), or use cache=False. Results are exact either way.",
                stacklevel=2,
            )
    if not can_freeze and untrainable_prefix(stack) == 0:
        cache.never_engages = (
            f"cache={config.mode!r} is set but nothing in this run can freeze a block: there is no AutoFreeze callback "
            "and every block of the stack trains, so the cache never serves (it stores nothing, and costs nothing). "
            "Add AutoFreeze() to the Trainer's callbacks, or freeze leading blocks before fit (requires_grad=False), "
            "or drop cache="
        )
        if int(os.environ.get("RANK", "0")) == 0:  # every process would say the same
            warnings.warn(cache.never_engages + ".", stacklevel=2)
    return cache


def reuse_autocache(cache: AutoCache, *, stack: BlockStack, module: nn.Module, include_pre: bool) -> AutoCache:
    """validate / test / predict after ``fit`` on the same stack: the fit's AutoCache, so that its current store (the
    entries stay in memory after the fit), its index namespace and its counters carry on; attached to this call's
    view of the stack (served wherever the keys and the prefix match: the watch compares the prefix first; index keys
    only within the call, in a namespace of their own)."""
    cache.order_pending = lambda: stack.provisional
    stack.when_refined(cache.refined)
    if cache.key == "index":
        # An index names a sample of this call's loaders, which need not be the fit's (validate(model, other_loader)):
        # a namespace of its own (its indices and probes too), so that the fit's index i is never served for another's.
        cache.namespace = uuid.uuid4().hex[:12] + "-"
        cache.indices = BatchIndices()
    if include_pre:
        cache.attach(stack, module)
    return cache


def pre_freezes_first(autofreeze: FreezeSource | None, stack: BlockStack) -> Callable[[], bool]:
    """Whether AutoFreeze, watching ``stack``, freezes what runs before it with the first block once the first training
    forward shows the call order, before that step's backward (the cache's first step from kept entries relies on it)."""
    if autofreeze is None or autofreeze.stack is not stack:
        return lambda: False
    return lambda: bool(autofreeze.freeze_embeddings and autofreeze.num_frozen > 0)


def close_autocache(cache: AutoCache, default_root_dir: str | None, cache_dir: str | None) -> None:
    """At teardown: the cache off the model, its stores closed, the empty folders removed, ``cache_keep``'s folder under its cap."""
    cache.detach()
    cache.close()
    remove_empty_folders(cache, default_root_dir, cache_dir)
    cache.keep_within_cap()  # cache_keep: the folder under its cap once this run lets go of its own


def check_budget(cache: AutoCache, control_group: Any) -> None:
    """Once, after the first training forward (before any update): a ``cache_memory`` too small
    for one batch fails now, not at the first store, which may come epochs later. Every rank
    takes part (an idle rank measured nothing), so all of them raise together."""
    needed = cache.batch_bytes.take()
    if needed is None:  # checked already (every rank measured since the same set-up)
        return
    if control_group is not None:
        largest = torch.tensor(needed, dtype=torch.int64)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=control_group)
        needed = int(largest)
    check_batch_fits(cache.memory_budget, needed)


def index_keys_from(cache: AutoCache, args: tuple[Any, ...], kwargs: dict[str, Any], stage: str) -> None:
    """cache_key='index': hand a step's batch and sample indices to AutoCache before the forward.

    Checked from the first batch on, not only once blocks are frozen: a wrong batch type, or an
    index repeated within a pass over the loader, must fail in the first step, not at the first freeze.
    """
    batch = args[0] if args else kwargs.get("batch")
    batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx")
    loader = args[2] if len(args) > 2 else kwargs.get("dataloader_idx", 0)
    cache.set_batch(batch, f"{stage}{loader}", batch_idx if isinstance(batch_idx, int) else None)


def input_augmentation(module: nn.Module) -> str | None:
    """In words, a random augmentation the model applies to the hidden state before its blocks in training, if any.

    SpecAugment (Wav2Vec2, HuBERT, WavLM, Data2Vec-audio: ``apply_spec_augment`` with ``mask_time_prob`` or
    ``mask_feature_prob`` above 0) masks time steps and features of the stack's input anew in every
    training forward: a sample never enters the frozen blocks twice as the same tensor.
    """
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is None or not getattr(config, "apply_spec_augment", False):
            continue
        time, feature = float(getattr(config, "mask_time_prob", 0) or 0), float(getattr(config, "mask_feature_prob", 0) or 0)
        if time > 0 or feature > 0:
            return (
                f"{type(sub).__name__} masks its hidden state at random in training (SpecAugment: mask_time_prob={time:g}, "
                f"mask_feature_prob={feature:g}), so a sample's input to the frozen blocks differs in every epoch"
            )
    return None
