"""Cost model of a PipeTransformer training run: predicts per-epoch throughput and speed-up.

:mod:`.simulator` replays a run epoch by epoch. Each epoch has a plan (frozen blocks ``F``, pipeline
length ``K``, micro-batches ``M``, data-parallel replicas ``R``, cache on/off) chosen the way the
enabled components would choose it, and a step time built from a few closed-form pieces:

* a GPipe fill-drain pipeline, modelled as a flow shop of identical micro-batches. For stage
  times ``t_1..t_K`` (activation copies between stages count as extra stages, since they run
  on their own streams) one phase takes ``sum(t) + (M - 1) * max(t)``; balanced stages give
  ``(M + K - 1) * t``, i.e. the bubble fraction ``(K - 1) / (M + K - 1)``;
* a fixed cost per micro-batch per stage (kernel launches, scheduling), which is what makes too
  many micro-batches slow and gives the throughput-vs-M curve its peak;
* a ring all-reduce of the *active* parameters, ``2 (n - 1) / n * bytes / bandwidth``, limited by
  the slower of the in-node links and the node's network link (which all stages share);
* frozen blocks: forward only (no backward: they are a prefix, nothing before them needs
  gradients); with AutoCache their forward is replaced by reading the cached activation;
* a fixed cost whenever the plan changes (re-partition, weights moved, DDP rebuilt).

The plan itself is the trainer's: the cost lists are weighted and folded as
:class:`~lightning_pipetransformer.pipe.planner.AutoPipe` does, and partitioned by
:mod:`lightning_pipetransformer.pipe.partition`; the freeze schedule is
:mod:`lightning_pipetransformer.freeze.rules`. The one mirrored piece, folding the embedding and
head into the end blocks as ``AutoPipe._items`` does, is checked against AutoPipe by the tests.

Everything here is plain arithmetic on dataclasses: no torch, no Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_pipetransformer.freeze.rules import validate_alpha
from lightning_pipetransformer.pipe.costs import weighted_costs
from lightning_pipetransformer.pipe.partition import optimal_partition, paper_greedy_partition
from lightning_pipetransformer.plan import boundaries

__all__ = [
    "BlockCost",
    "ModelCost",
    "Cluster",
    "Training",
    "Variant",
    "VARIANTS",
    "ring_allreduce_time",
    "flow_shop_time",
    "bubble_fraction",
    "pipeline_step_time",
]

PartitionRule = Literal["optimal", "paper-greedy"]
FrozenPlacement = Literal["pipelined", "serial"]
CachePolicy = Literal["min-frozen", "auto"]
Partitioner = Callable[[Sequence[float], int], tuple[int, ...]]

# partition_by="params" balances millions of fp32 parameters (param_bytes / 4e6), the unit of the
# official load_balance.py. The optimal partition does not care; the paper's greedy does: its
# threshold adds a variance to a mean, so in bytes the variance swamps the mean.
_PARAM_UNIT = 4e6


@dataclass(frozen=True)
class BlockCost:
    """Cost of one layer per *sample*: profiled, or derived from FLOPs and a device spec."""

    forward_s: float
    backward_s: float
    activation_bytes: float  # size of the block's output for one sample
    param_bytes: float

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "activation_bytes", "param_bytes"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"BlockCost.{name} must be a finite number >= 0, got {value!r}.")


@dataclass(frozen=True)
class ModelCost:
    """A block stack: ``embedding -> blocks[0..L-1] -> head``.

    The embedding is frozen (and cached) together with the first frozen block, as in the paper;
    the head is always trained.
    """

    blocks: tuple[BlockCost, ...]
    embedding: BlockCost = BlockCost(0.0, 0.0, 0.0, 0.0)
    head: BlockCost = BlockCost(0.0, 0.0, 0.0, 0.0)

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError("ModelCost needs at least one block cost; profile the model or use a preset.")

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


@dataclass(frozen=True)
class Cluster:
    """Hardware. Bandwidths in bytes/s."""

    nodes: int
    gpus_per_node: int
    intra_node_bw: float  # GPU <-> GPU inside a node (one link per GPU)
    inter_node_bw: float  # one network link per node, shared by everything leaving the node
    cache_bw: float = float("inf")  # cache reads + writes per node, shared by its pipelines
    cache_read_bw: float = float("inf")  # cache reads + writes by one pipeline's process
    cell_overhead_s: float = 0.0  # fixed cost per micro-batch per stage, forward + backward

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"Need at least 1 node and 1 GPU per node, got {self.nodes} x {self.gpus_per_node}.")
        for name in ("intra_node_bw", "inter_node_bw", "cache_bw", "cache_read_bw"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Cluster.{name} must be > 0 bytes/s, got {getattr(self, name)!r}.")
        if self.cell_overhead_s < 0:
            raise ValueError(f"Cluster.cell_overhead_s must be >= 0, got {self.cell_overhead_s!r}.")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Training:
    """The run: data, batch, pipeline, freeze schedule and how each component behaves.

    ``micro_batches`` is a count used for every K, a mapping ``{K: M}``, or ``"auto"`` (the M
    that this model predicts fastest, which is what a profiler would find). The freeze schedule
    is either explicit per-epoch frozen counts (``frozen``) or ``alpha`` for the geometric
    schedule ``F(e) = ceil(L (1 - (1 - alpha)^e))`` (AutoFreeze's ``rule="schedule"``). Either
    way at most ``L - min_active`` blocks freeze, as AutoFreeze's ``min_active`` (default 1).
    """

    dataset_size: int
    epochs: int
    batch_size: int  # per pipeline (per replica)
    pipe_len: int  # K at the start
    micro_batches: int | Mapping[int, int] | Literal["auto"] = "auto"
    alpha: float | None = None
    frozen: tuple[int, ...] | None = None
    min_active: int = 1  # AutoFreeze(min_active=...): blocks that never freeze
    frozen_cost: float = 1.0 / 6.0  # planner weight of a frozen block relative to an active one
    partition: PartitionRule = "optimal"
    partition_by: Literal["time", "params"] = "time"
    frozen_placement: FrozenPlacement = "pipelined"
    cache_policy: CachePolicy = "min-frozen"
    cache_min_frozen: int = 3  # paper: ViT caches from 3 frozen layers on
    cache_hit_rate: float = 1.0  # sample-index keys: 1; content keys under random augmentation: ~0
    transition_s: float = 0.0  # paid once whenever (K, R, F) changes
    allreduce_overlap: float = 0.0  # fraction of the all-reduce hidden behind the backward pass

    def __post_init__(self) -> None:
        if self.dataset_size < 1 or self.epochs < 1 or self.batch_size < 1 or self.pipe_len < 1:
            raise ValueError("dataset_size, epochs, batch_size and pipe_len must all be >= 1.")
        if self.alpha is not None and self.frozen is not None:
            raise ValueError("Give either alpha or an explicit frozen schedule, not both.")
        if self.alpha is not None:
            validate_alpha(self.alpha)  # AutoFreeze's check: 0 < alpha < 1
        if isinstance(self.min_active, bool) or not isinstance(self.min_active, int) or self.min_active < 0:
            raise ValueError(f"min_active must be an int >= 0, got {self.min_active!r}.")
        if self.frozen is not None and len(self.frozen) > self.epochs:
            raise ValueError(
                f"The freeze schedule has {len(self.frozen)} entries but the run has only {self.epochs} "
                f"epochs: shorten the schedule or raise epochs."
            )
        if not 0 <= self.cache_hit_rate <= 1 or not 0 <= self.allreduce_overlap <= 1:
            raise ValueError("cache_hit_rate and allreduce_overlap must be in [0, 1].")
        if self.frozen_cost < 0 or self.transition_s < 0:
            raise ValueError("frozen_cost and transition_s must be >= 0.")


@dataclass(frozen=True)
class Variant:
    """Which PipeTransformer components are switched on."""

    freeze: bool
    autopipe: bool
    autodp: bool
    autocache: bool


VARIANTS: dict[str, Variant] = {
    "baseline": Variant(False, False, False, False),
    "freeze_only": Variant(True, False, False, False),
    "autopipe_autocache": Variant(True, True, False, True),
    "autopipe_autodp": Variant(True, True, True, False),
    "all": Variant(True, True, True, True),
}


# --------------------------------------------------------------------------- closed-form pieces


def ring_allreduce_time(nbytes: float, n: int, bandwidth: float) -> float:
    """Bandwidth term of a ring all-reduce of ``nbytes`` over ``n`` ranks: ``2(n-1)/n * bytes/bw``."""
    if n < 1 or bandwidth <= 0:
        raise ValueError(f"Need n >= 1 and bandwidth > 0, got n={n}, bandwidth={bandwidth}.")
    return 2.0 * (n - 1) / n * nbytes / bandwidth


def flow_shop_time(stage_times: Sequence[float], micro_batches: int) -> float:
    """Makespan of ``micro_batches`` identical jobs through stages in series.

    Exact for identical jobs: ``sum(t) + (M - 1) * max(t)``. One GPipe phase (all forwards, or
    all backwards) is such a flow shop.
    """
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}.")
    if not stage_times:
        return 0.0
    return float(sum(stage_times)) + (micro_batches - 1) * float(max(stage_times))


def bubble_fraction(pipe_len: int, micro_batches: int) -> float:
    """Idle share of a balanced GPipe pipeline: ``(K - 1) / (M + K - 1)``."""
    return (pipe_len - 1) / (micro_batches + pipe_len - 1)


# --------------------------------------------------------------------------- one training step


@dataclass(frozen=True)
class _StepResult:
    step_s: float
    balance: tuple[int, ...]
    breakdown: dict[str, float]


def _cost(b: BlockCost, train: Training) -> float:
    return b.forward_s + b.backward_s if train.partition_by == "time" else b.param_bytes / _PARAM_UNIT


def _planner_costs(model: ModelCost, first: int, frozen: int, train: Training) -> list[float]:
    """What the planner balances for blocks ``first..L-1``, exactly as AutoPipe builds it
    (``AutoPipe._items``): time or parameter size, frozen blocks weighted by ``frozen_cost``
    (:func:`~lightning_pipetransformer.pipe.costs.weighted_costs`), the embedding folded into
    block 0 (weighted once anything is frozen) and the head into the last block (never weighted)."""
    raw = [_cost(model.blocks[i], train) for i in range(first, model.num_blocks)]
    if not raw:
        return []
    out = list(weighted_costs(raw, max(0, frozen - first), train.frozen_cost))
    if first == 0:
        out[0] += _cost(model.embedding, train) * (train.frozen_cost if frozen > 0 else 1.0)
    out[-1] += _cost(model.head, train)
    return out


def _partitioner(model: ModelCost, first: int, frozen: int, train: Training) -> tuple[list[float], Partitioner]:
    """The weighted cost list of blocks ``first..L-1`` and the partition rule to split it with.

    ``"optimal"`` is :func:`~lightning_pipetransformer.pipe.partition.optimal_partition`, what
    AutoPipe runs. ``"paper-greedy"`` is
    :func:`~lightning_pipetransformer.pipe.partition.paper_greedy_partition` on the raw
    (unweighted) costs with the frozen blocks pinned to stage 0, as the paper's code did; it may
    leave a stage empty (a device that only passes activations on).
    """
    costs = _planner_costs(model, first, frozen, train)
    if train.partition == "optimal":
        return costs, optimal_partition
    # The greedy takes raw costs and weights the pinned frozen prefix itself.
    raw = [_cost(model.blocks[i], train) for i in range(first, model.num_blocks)]
    if raw:
        if first == 0:
            raw[0] += _cost(model.embedding, train)
        raw[-1] += _cost(model.head, train)
    nf = max(0, frozen - first)

    def greedy(_weighted: Sequence[float], k: int) -> tuple[int, ...]:
        return paper_greedy_partition(raw, k, num_frozen=nf, frozen_cost=train.frozen_cost)

    return costs, greedy


def _largest_stage(costs: Sequence[float], balance: Sequence[int]) -> float:
    """The costliest stage of ``balance`` over ``costs``; an empty stage costs 0."""
    edges = boundaries(balance)
    return max(float(sum(costs[a:b])) for a, b in zip(edges[:-1], edges[1:]))


def pipeline_step_time(
    model: ModelCost,
    cluster: Cluster,
    train: Training,
    *,
    frozen: int,
    pipe_len: int,
    micro_batches: int,
    replicas: int,
    cached_from: int | None = None,
    cache_advance_from: int | None = None,
    fixed_balance: tuple[int, ...] | None = None,
) -> _StepResult:
    """Seconds for one optimizer step of every replica (they run in lock-step).

    ``cached_from``: the cached boundary is ``frozen`` (blocks ``< frozen`` and the embedding are
    not run). ``cache_advance_from``: the cache holds activations at this earlier boundary and
    blocks ``cache_advance_from..frozen-1`` are run once more to advance them (``None`` with a
    cache means the cache is cold this epoch: everything is computed and written).
    ``fixed_balance``: keep this partition of all blocks (freezing without AutoPipe).
    """
    L = model.num_blocks
    B = train.batch_size
    K, M = pipe_len, micro_batches
    if not 0 <= frozen <= L:
        raise ValueError(f"frozen must be in 0..{L}, got {frozen}.")
    mb = B / M
    serial = 0.0  # work done on the first device before the pipeline starts
    parts: dict[str, float] = {}
    pipelined_frozen = train.frozen_placement == "pipelined" and cached_from is None

    # Blocks that go through the pipeline: all of them, or only the active ones.
    first = 0 if pipelined_frozen else frozen
    if cached_from is not None:
        act = model.blocks[frozen - 1].activation_bytes if frozen > 0 else model.embedding.activation_bytes
        per_pipeline_bw = cluster.cache_bw / max(1, replicas // cluster.nodes)
        load_bw = min(per_pipeline_bw, cluster.cache_read_bw, cluster.intra_node_bw)
        hit = train.cache_hit_rate if cache_advance_from is not None else 0.0
        frozen_fwd = model.embedding.forward_s + sum(b.forward_s for b in model.blocks[:frozen])
        advance_fwd = sum(b.forward_s for b in model.blocks[(cache_advance_from or 0) : frozen])
        written = (1 - hit) + (hit if cache_advance_from is not None and cache_advance_from < frozen else 0.0)
        parts["cache_read"] = B * hit * act / load_bw
        parts["frozen_forward"] = B * ((1 - hit) * frozen_fwd + hit * advance_fwd)
        parts["cache_write"] = B * written * act / load_bw
        serial = parts["cache_read"] + parts["frozen_forward"] + parts["cache_write"]
    elif not pipelined_frozen and frozen > 0:
        parts["frozen_forward"] = B * (model.embedding.forward_s + sum(b.forward_s for b in model.blocks[:frozen]))
        serial = parts["frozen_forward"]

    n_units = L - first
    if n_units == 0:  # every block frozen and outside the pipeline: only the head trains
        units_k = 1
        balance: tuple[int, ...] = ()
        fwd = [mb * model.head.forward_s + cluster.cell_overhead_s / 2]
        bwd = [mb * model.head.backward_s + cluster.cell_overhead_s / 2]
        copies: list[float] = []
        grad_copies: list[float] = []
        stage_params = [model.head.param_bytes]
    else:
        units_k = min(K, n_units)
        if fixed_balance is not None and first == 0:
            balance, units_k = fixed_balance, len(fixed_balance)
        else:
            costs, partition = _partitioner(model, first, frozen, train)
            balance = partition(costs, units_k)
        edges = [first + e for e in boundaries(balance)]
        fwd, bwd, copies, grad_copies, stage_params = [], [], [], [], []
        for s in range(units_k):
            blocks = range(edges[s], edges[s + 1])
            f = sum(model.blocks[i].forward_s for i in blocks)
            bw = sum(model.blocks[i].backward_s for i in blocks if i >= frozen)
            p = sum(model.blocks[i].param_bytes for i in blocks if i >= frozen)
            if s == 0 and first == 0:
                f += model.embedding.forward_s
                if frozen == 0:
                    bw += model.embedding.backward_s
                    p += model.embedding.param_bytes
            if s == units_k - 1:
                f += model.head.forward_s
                bw += model.head.backward_s
                p += model.head.param_bytes
            fwd.append(mb * f + cluster.cell_overhead_s / 2)
            # A stage of frozen blocks only has no backward cell at all.
            bwd.append(mb * bw + cluster.cell_overhead_s / 2 if bw > 0 or s == units_k - 1 else 0.0)
            stage_params.append(p)
            if s < units_k - 1:
                # What crosses the boundary: the output of the last block before it (an empty
                # stage, which the paper's greedy can leave, passes its input on).
                last = edges[s + 1] - 1
                act = model.blocks[last].activation_bytes if last >= 0 else model.embedding.activation_bytes
                c = mb * act / cluster.intra_node_bw
                copies.append(c)
                # The gradient goes back only if the stage it returns to trains something.
                grad_copies.append(c if edges[s + 1] - 1 >= frozen else 0.0)

    forward = flow_shop_time([t for pair in _interleave(fwd, copies) for t in pair], M)
    backward = flow_shop_time([t for pair in _interleave(bwd, grad_copies) for t in pair if t > 0], M)
    parts["pipeline_forward"] = forward
    parts["pipeline_backward"] = backward
    parts["bubble_share"] = bubble_fraction(units_k, M)

    # All-reduce of the active parameters: each stage has its own ring over the replicas. In a
    # node the stage rings use different GPU links; the node's network link carries all of them.
    allreduce = 0.0
    if replicas > 1:
        per_node = replicas / cluster.nodes
        times = []
        if per_node > 1:
            times.append(ring_allreduce_time(max(stage_params), replicas, cluster.intra_node_bw))
        if cluster.nodes > 1:
            times.append(ring_allreduce_time(sum(stage_params), replicas, cluster.inter_node_bw))
        allreduce = max(times) if times else 0.0
    parts["allreduce"] = allreduce
    step = serial + forward + backward + (1 - train.allreduce_overlap) * allreduce
    return _StepResult(step, balance, parts)


def _interleave(stages: Sequence[float], copies: Sequence[float]) -> list[tuple[float, ...]]:
    out: list[tuple[float, ...]] = []
    for s, t in enumerate(stages):
        out.append((t, copies[s]) if s < len(copies) else (t,))
    return out
