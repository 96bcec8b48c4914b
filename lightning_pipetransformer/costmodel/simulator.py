"""Replays a training run epoch by epoch: the plan each variant would pick, and its time.

Per epoch: the freeze schedule gives ``F`` (AutoFreeze's own rule,
:func:`~lightning_pipetransformer.freeze.rules.geometric_num_frozen`, or an
:class:`~lightning_pipetransformer.freeze.rules.ExplicitSchedule`, capped at ``L - min_active``);
AutoPipe halves ``K`` while the largest stage stays within the budget (the largest stage at the
start: :func:`~lightning_pipetransformer.pipe.partition.compress_pipe_len`); AutoDP fills the
freed GPUs with replicas (``R = GPUs / K``, else ``R`` stays at its start); AutoCache replaces the
frozen prefix with a cache read once it is on. The step time comes from
:func:`.model.pipeline_step_time`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from lightning_pipetransformer.costmodel.model import (
    VARIANTS,
    Cluster,
    ModelCost,
    Training,
    Variant,
    _largest_stage,
    _partitioner,
    pipeline_step_time,
)
from lightning_pipetransformer.freeze.rules import ExplicitSchedule, geometric_num_frozen
from lightning_pipetransformer.pipe.partition import compress_pipe_len

__all__ = ["EpochPlan", "VariantReport", "Report", "simulate", "simulate_variant", "microbatch_profile"]


@dataclass(frozen=True)
class EpochPlan:
    """One simulated epoch: the plan and where its time went (seconds per step unless noted)."""

    epoch: int
    frozen: int
    pipe_len: int
    micro_batches: int
    replicas: int
    cached: bool
    balance: tuple[int, ...]
    steps: int
    step_s: float
    epoch_s: float
    throughput: float  # samples / s over the whole cluster
    breakdown: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class VariantReport:
    name: str
    total_s: float
    speedup: float
    epochs: tuple[EpochPlan, ...]


@dataclass(frozen=True)
class Report:
    variants: dict[str, VariantReport]

    def to_dict(self) -> dict:
        return {
            "variants": {
                name: {
                    "speedup": v.speedup,
                    "total_s": v.total_s,
                    "total_h": v.total_s / 3600,
                    "epochs": [
                        {
                            "epoch": e.epoch,
                            "frozen": e.frozen,
                            "pipe_len": e.pipe_len,
                            "micro_batches": e.micro_batches,
                            "replicas": e.replicas,
                            "cached": e.cached,
                            "balance": list(e.balance),
                            "steps": e.steps,
                            "step_s": e.step_s,
                            "epoch_s": e.epoch_s,
                            "throughput": e.throughput,
                            "breakdown": e.breakdown,
                        }
                        for e in v.epochs
                    ],
                }
                for name, v in self.variants.items()
            }
        }


# --------------------------------------------------------------------------- planning an epoch


def _micro_batch_candidates(batch: int, pipe_len: int) -> range:
    # The paper profiles M in K..6K; we search a wider range, capped by the batch size.
    return range(1, min(batch, 8 * pipe_len) + 1)


def _choose_m(model: ModelCost, cluster: Cluster, train: Training, **kw: object) -> int:
    k = int(kw["pipe_len"])  # type: ignore[call-overload]
    spec = train.micro_batches
    if isinstance(spec, int):
        return min(spec, train.batch_size)
    if isinstance(spec, Mapping):
        if k not in spec:
            raise ValueError(f"micro_batches has no entry for pipeline length {k}: add one, or use 'auto'.")
        return min(spec[k], train.batch_size)
    return min(
        _micro_batch_candidates(train.batch_size, k),
        key=lambda m: pipeline_step_time(model, cluster, train, micro_batches=m, **kw).step_s,  # type: ignore[arg-type]
    )


def _max_stage(model: ModelCost, train: Training, first: int, frozen: int, k: int) -> float:
    costs, partition = _partitioner(model, first, frozen, train)
    if not costs:
        return 0.0
    return _largest_stage(costs, partition(costs, min(k, len(costs))))


def _compress(
    model: ModelCost, cluster: Cluster, train: Training, frozen: int, k: int, budget: float, cached: bool = False
) -> int:
    """AutoPipe's K -> K/2 rule on what the pipeline will hold (cached blocks are not in it)."""
    first = 0 if train.frozen_placement == "pipelined" and not cached else frozen
    costs, partition = _partitioner(model, first, frozen, train)
    if not costs:
        return 1
    g = cluster.gpus_per_node
    if k > len(costs):  # a pipeline cannot be longer than what it holds: AutoPipe.plan's rule
        k = max(d for d in range(1, len(costs) + 1) if g % d == 0 and d <= k)
    return compress_pipe_len(costs, k, g, budget, partition=partition)


def _schedule(model: ModelCost, train: Training) -> tuple[int, ...]:
    """Frozen blocks per epoch, by AutoFreeze's rules (``freeze_every_n_epochs=1``)."""
    L, epochs = model.num_blocks, train.epochs
    limit = L - train.min_active
    if limit < 0:
        raise ValueError(f"min_active={train.min_active} exceeds the {L} blocks.")
    if train.frozen is not None:
        # A list per epoch is a step function from epoch 0: later epochs keep the last count.
        plan = ExplicitSchedule(dict(enumerate(train.frozen)))
        plan.validate(limit, epochs)
        return tuple(plan(e) for e in range(epochs))
    if train.alpha is not None:
        # AutoFreeze(rule="schedule") at the start of epoch e: min(F(e), L - min_active).
        return tuple(min(geometric_num_frozen(L, train.alpha, e), limit) for e in range(epochs))
    raise ValueError("No freeze schedule: give Training(alpha=...) or Training(frozen=(0, ...)).")


def _check(model: ModelCost, cluster: Cluster, train: Training) -> None:
    g = cluster.gpus_per_node
    if train.pipe_len > g or g % train.pipe_len:
        raise ValueError(
            f"pipe_len={train.pipe_len} must divide gpus_per_node={g}: a pipeline lives inside one node."
        )
    if train.pipe_len > model.num_blocks:
        raise ValueError(f"pipe_len={train.pipe_len} is more than the {model.num_blocks} blocks to split.")


def simulate_variant(model: ModelCost, cluster: Cluster, train: Training, variant: Variant) -> tuple[EpochPlan, ...]:
    """Plans and times every epoch of one variant."""
    _check(model, cluster, train)
    sched = _schedule(model, train) if variant.freeze else (0,) * train.epochs
    k0 = train.pipe_len
    budget = _max_stage(model, train, 0, 0, k0)
    costs0, partition0 = _partitioner(model, 0, 0, train)
    balance0 = partition0(costs0, k0)
    k = k0
    prev: tuple[int, int, int] | None = None
    cached_prev: int | None = None
    plans = []
    for epoch, f in enumerate(sched):
        may_cache = variant.autocache and variant.autopipe and f > 0
        if train.cache_policy == "min-frozen":
            may_cache = may_cache and f >= train.cache_min_frozen
        else:  # "auto": a cache that never hits is never worth switching on
            may_cache = may_cache and train.cache_hit_rate > 0
        if variant.autopipe and f > 0:
            k = _compress(model, cluster, train, f, k, budget, cached=may_cache)
        replicas = cluster.gpus // k if variant.autodp else cluster.gpus // k0
        # Without AutoPipe the frozen blocks stay where they were, inside the K0 pipeline.
        t = train if variant.autopipe else replace(train, frozen_placement="pipelined")
        base: dict = dict(frozen=f, pipe_len=k, replicas=replicas)
        if not variant.autopipe:
            base["fixed_balance"] = balance0
        use_cache = may_cache
        cache_kw: dict = {}
        if may_cache:
            cache_kw = dict(cached_from=f, cache_advance_from=cached_prev)
            if train.cache_policy == "auto":
                # Decide on the warm cache (what the following epochs pay), not on this epoch's
                # cold fill, which is always dearer than not caching.
                warm = dict(base, cached_from=f, cache_advance_from=f)
                m_c = _choose_m(model, cluster, t, **warm)
                m_n = _choose_m(model, cluster, t, **base)
                with_c = pipeline_step_time(model, cluster, t, micro_batches=m_c, **warm).step_s
                without = pipeline_step_time(model, cluster, t, micro_batches=m_n, **base).step_s
                use_cache = with_c < without
        if not use_cache:
            cache_kw = {}
        m = _choose_m(model, cluster, t, **base, **cache_kw)
        res = pipeline_step_time(model, cluster, t, micro_batches=m, **base, **cache_kw)
        steps = math.ceil(train.dataset_size / (train.batch_size * replicas))
        plan = (f, k, replicas)
        transition = train.transition_s if prev is not None and plan != prev else 0.0
        epoch_s = steps * res.step_s + transition
        bd = dict(res.breakdown, transition=transition)
        plans.append(
            EpochPlan(epoch, f, k, m, replicas, use_cache, res.balance, steps, res.step_s, epoch_s,
                      train.dataset_size / epoch_s, bd)
        )
        prev = plan
        cached_prev = f if use_cache else None
    return tuple(plans)


def simulate(
    model: ModelCost, cluster: Cluster, train: Training, variants: Mapping[str, Variant] | None = None
) -> Report:
    """Simulates every variant; speed-ups are against ``baseline`` (total time ratio)."""
    variants = dict(VARIANTS if variants is None else variants)
    if "baseline" not in variants:
        variants = {"baseline": VARIANTS["baseline"], **variants}
    timed = {name: simulate_variant(model, cluster, train, v) for name, v in variants.items()}
    base = sum(e.epoch_s for e in timed["baseline"])
    return Report(
        {
            name: VariantReport(name, sum(e.epoch_s for e in eps), base / sum(e.epoch_s for e in eps), eps)
            for name, eps in timed.items()
        }
    )


def microbatch_profile(
    model: ModelCost, cluster: Cluster, train: Training, pipe_len: int, candidates: Sequence[int], frozen: int = 0
) -> dict[int, float]:
    """Predicted cluster throughput (samples/s) of a no-freeze step at ``pipe_len`` for each M,
    with ``gpus / pipe_len`` replicas: what the paper's micro-batch profiler measures."""
    replicas = cluster.gpus // pipe_len
    out = {}
    for m in candidates:
        r = pipeline_step_time(model, cluster, train, frozen=frozen, pipe_len=pipe_len, micro_batches=m, replicas=replicas)
        out[m] = train.batch_size * replicas / r.step_s
    return out
