"""AutoPipe: the pipeline plan (length, partition, micro-batches, active replicas) per freeze step.

Given per-block costs, :class:`AutoPipe` answers "F leading blocks are frozen: how do we run?"
with a :class:`Plan` that the strategy broadcasts, applies and checkpoints. The rules
(PipeTransformer paper, section 3.2):

* Frozen blocks weigh ``frozen_cost`` times an active one (paper: 1/6).
* The budget is the largest stage cost at the start: F = 0 on the initial pipe length K0.
* After a freeze, K -> K/2 while K/2 divides the devices per node and the optimal partition at
  K/2 has no stage costlier than the budget; a shorter pipeline has smaller bubbles, fewer
  copies, and frees devices for more replicas (AutoDP).
* With G devices per node and pipe length K, the local ranks that are multiples of K drive a
  replica: local rank ``j*K`` drives devices ``[j*K, (j+1)*K)``, the others idle; global rank is
  ``node * G + local_rank``::

      G = 8, K = 4:   local rank 0 -> cuda:0..3   local rank 4 -> cuda:4..7   (2 replicas/node)
      G = 8, K = 2:   0 -> cuda:0,1   2 -> cuda:2,3   4 -> cuda:4,5   6 -> cuda:6,7

  So a replica's first stage is always its process's own device (Lightning's root device for
  that local rank): embeddings, head, optimizer state and DDP never move when K shrinks, and an
  idle rank that joins already sits on the device it will drive.

K never grows: costs only fall as F grows (``frozen_cost <= 1``), so each level's largest
stage falls too and a halving that passed once passes again (with ``pin_frozen_prefix`` this
monotonicity can fail, but the planner only ever halves from the current K, and asserts it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_pipetransformer.pipe.costs import weighted_costs
from lightning_pipetransformer.pipe.partition import (
    compress_pipe_len,
    optimal_partition,
    stage_costs,
)
from lightning_pipetransformer.plan import Plan

__all__ = ["Plan", "AutoPipe"]

#: M for every K (an int) or per K (a mapping). ``chunks="auto"`` is measured on real batches by
#: the strategy (:class:`~lightning_pipetransformer.pipe.chunks.ChunkTuner`), which plans with 1.
Chunks = int | Mapping[int, int]


class AutoPipe:
    """The AutoPipe planner: one :class:`Plan` per number of frozen blocks.

    Args:
        costs: the cost of each block (parameter counts, or profiled times: :mod:`.costs`).
        devices_per_node: G, the devices (and processes) per node.
        num_nodes: the number of nodes.
        pipe_len: K0, the initial pipe length; defaults to G (one replica per node). Must
            divide G and not exceed the number of blocks.
        frozen_cost: what a frozen block weighs relative to an active one, in [0, 1].
        chunks: M for every K (an int) or per K (a mapping). ``chunks="auto"`` is not the
            planner's: it is measured on the first real batch of each K
            (:mod:`lightning_pipetransformer.pipe.chunks`), in one place.
        node_devices: the G device names of a node, in order; defaults to ``cuda:0 .. cuda:G-1``.
            Pass ``["cpu"] * G`` for virtual CPU devices.
        pre_cost: cost of what runs before the blocks (embeddings) on the first stage; frozen
            (weighted) as soon as F > 0, as the paper froze embeddings with the first block.
        post_cost: cost of what runs after the blocks (final norm, pooler, head) on the last
            stage; it trains throughout, so it is never weighted.
        pin_frozen_prefix: keep all frozen blocks on stage 0, as the paper's code did. Off by
            default: the executor runs frozen blocks on any stage, and the unconstrained
            optimum is never worse.
    """

    def __init__(
        self,
        costs: Sequence[float],
        *,
        devices_per_node: int,
        num_nodes: int = 1,
        pipe_len: int | None = None,
        frozen_cost: float = 1 / 6,
        chunks: Chunks = 1,
        node_devices: Sequence[str] | None = None,
        pre_cost: float = 0.0,
        post_cost: float = 0.0,
        pin_frozen_prefix: bool = False,
    ) -> None:
        self.costs = tuple(float(c) for c in costs)
        g = devices_per_node
        if not self.costs or any(c < 0 for c in self.costs) or pre_cost < 0 or post_cost < 0:
            raise ValueError(f"Block costs must be a non-empty list of non-negative numbers, got {list(costs)}.")
        if g < 1 or num_nodes < 1:
            raise ValueError(f"devices_per_node and num_nodes must be >= 1, got {g} and {num_nodes}.")
        k0 = g if pipe_len is None else pipe_len
        if k0 < 1 or g % k0:
            divisors = [d for d in range(1, g + 1) if g % d == 0]
            raise ValueError(
                f"The pipe length {k0} must divide the {g} devices per node: use one of {divisors}."
            )
        if k0 > len(self.costs):
            raise ValueError(
                f"Cannot split {len(self.costs)} blocks into {k0} stages: pass pipe_len <= {len(self.costs)}."
            )
        if not 0.0 <= frozen_cost <= 1.0:
            raise ValueError(
                f"frozen_cost must be in [0, 1] (paper: 1/6; 0 when frozen blocks are cached), got {frozen_cost}."
            )
        _check_chunks(chunks)
        if node_devices is None:
            node_devices = [f"cuda:{i}" for i in range(g)]
        if len(node_devices) != g:
            raise ValueError(f"node_devices names {len(node_devices)} devices, but devices_per_node is {g}.")

        self.devices_per_node = g
        self.num_nodes = num_nodes
        self.initial_pipe_len = k0
        self.frozen_cost = float(frozen_cost)
        self.chunks = chunks
        self.node_devices = tuple(str(d) for d in node_devices)
        self.pre_cost = float(pre_cost)
        self.post_cost = float(post_cost)
        self.pin_frozen_prefix = pin_frozen_prefix

        items, _ = self._items(0)
        #: The largest stage cost at the start (F = 0, K0): compression never exceeds it.
        self.budget = max(stage_costs(items, optimal_partition(items, k0)))
        self._pipe_len = k0
        self._num_frozen = 0

    @property
    def num_blocks(self) -> int:
        return len(self.costs)

    @property
    def pipe_len(self) -> int:
        """The current K: the initial one until :meth:`plan` compresses it."""
        return self._pipe_len

    def plan(self, num_frozen: int) -> Plan:
        """The plan once ``num_frozen`` leading blocks are frozen; compresses K when it can.

        K is only ever halved from the current value: to start over, build a new planner or
        :meth:`load_state_dict`. F may go back (something unfroze blocks: the strategy's plan follows
        what is frozen, whoever froze it); K then stays as it is and the blocks are balanced over it.
        """
        n = self.num_blocks
        if not 0 <= num_frozen <= n:
            raise ValueError(f"num_frozen must be in 0..{n} (the number of blocks), got {num_frozen}.")
        items, merged = self._items(num_frozen)
        k = self._pipe_len
        g = self.devices_per_node
        if k > len(items):
            # Only with a pinned prefix: fewer stage candidates than stages, so shrink to fit.
            k = max(d for d in range(1, len(items) + 1) if g % d == 0 and d <= k)
        if num_frozen > 0:
            k = compress_pipe_len(items, k, g, self.budget)
        assert k <= self._pipe_len, f"AutoPipe grew the pipe length {self._pipe_len} -> {k}"

        balance = optimal_partition(items, k)
        per_stage = stage_costs(items, balance)
        balance = (balance[0] + merged,) + balance[1:]
        chunks = self.chunks_for(k)
        replicas = g // k
        plan = Plan(
            num_frozen=num_frozen,
            pipe_len=k,
            chunks=chunks,
            partition=balance,
            devices=tuple(self.node_devices[r * k : (r + 1) * k] for r in range(replicas)),
            active_ranks=tuple(node * g + j * k for node in range(self.num_nodes) for j in range(replicas)),
            stage_costs=per_stage,
            budget=self.budget,
        )
        self._pipe_len, self._num_frozen = k, num_frozen
        return plan

    def chunks_for(self, pipe_len: int) -> int:
        """M for pipe length K, as given."""
        if isinstance(self.chunks, int):
            return self.chunks
        if pipe_len not in self.chunks:
            raise ValueError(f"chunks has no entry for pipe length {pipe_len}: give one for every K in use.")
        return self.chunks[pipe_len]

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state to resume planning: current K and F."""
        return {"pipe_len": self._pipe_len, "num_frozen": self._num_frozen}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        k, f = int(state["pipe_len"]), int(state["num_frozen"])
        if k < 1 or self.devices_per_node % k or k > self.initial_pipe_len or not 0 <= f <= self.num_blocks:
            raise ValueError(
                f"Planner state (pipe_len={k}, num_frozen={f}) does not fit this planner "
                f"({self.devices_per_node} devices per node, initial pipe length {self.initial_pipe_len}, "
                f"{self.num_blocks} blocks)."
            )
        self._pipe_len, self._num_frozen = k, f  # (a "chunk_cache" of older checkpoints is not needed)

    def _items(self, num_frozen: int) -> tuple[tuple[float, ...], int]:
        """The weighted cost list to partition, and how many blocks its first item stands for
        beyond one (a pinned frozen prefix is merged into a single item)."""
        weighted = list(weighted_costs(self.costs, num_frozen, self.frozen_cost))
        # The embeddings run with block 0 and the head with the last block: fold them in.
        weighted[0] += self.pre_cost * (self.frozen_cost if num_frozen > 0 else 1.0)
        weighted[-1] += self.post_cost
        if self.pin_frozen_prefix and num_frozen > 1:
            return (sum(weighted[:num_frozen]),) + tuple(weighted[num_frozen:]), num_frozen - 1
        return tuple(weighted), 0


def _check_chunks(chunks: Chunks) -> None:
    if isinstance(chunks, bool):
        raise ValueError(f"chunks must be an int >= 1 or a mapping pipe_len -> int; got {chunks!r}.")
    if isinstance(chunks, int):
        if chunks < 1:
            raise ValueError(f"chunks (micro-batches per mini-batch) must be >= 1, got {chunks}.")
    elif isinstance(chunks, Mapping):
        bad = {k: m for k, m in chunks.items() if not isinstance(m, int) or m < 1}
        if bad:
            raise ValueError(f"chunks per pipe length must be ints >= 1, got {bad}.")
    elif chunks == "auto":
        raise ValueError(
            "AutoPipe takes chunks as an int or a mapping pipe_len -> int. chunks='auto' is measured on real "
            "batches: pass it to PipeTransformerStrategy(chunks='auto'), which plans with 1 and times each K."
        )
    else:
        raise ValueError(f"chunks must be an int >= 1 or a mapping pipe_len -> int; got {chunks!r}.")
