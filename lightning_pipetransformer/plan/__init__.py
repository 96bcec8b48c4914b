"""The plan in force: how the model runs for one freeze step, shared by AutoPipe, AutoDP and the strategy.

:class:`Plan` is plain data, broadcast from rank 0 and written into checkpoints. AutoPipe
(:mod:`lightning_pipetransformer.pipe.planner`) makes one per freeze step; AutoDP reads its
``active_ranks`` and ``devices``; ``trainer.strategy.plan`` shows the one in force.

The plan imports nothing of the package: the planner (pipe/) and the cost model import it, and
:mod:`~lightning_pipetransformer.plan.change` says what moving from one plan to another takes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["Plan", "boundaries"]


def boundaries(balance: Sequence[int]) -> tuple[int, ...]:
    """Block index where each stage starts, plus the total: ``(4, 4, 4) -> (0, 4, 8, 12)``."""
    out = [0]
    for size in balance:
        out.append(out[-1] + size)
    return tuple(out)


@dataclass(frozen=True)
class Plan:
    """How to run the model for one freeze step. Plain data: see :meth:`to_dict`.

    Attributes:
        num_frozen: F, the number of leading frozen blocks.
        pipe_len: K, the number of stages of each pipeline replica.
        chunks: M, the number of micro-batches per mini-batch.
        partition: the balance, blocks per stage (sums to the number of blocks).
        devices: ``devices[j]`` are the K device names of the node's replica ``j`` (one per
            stage), driven by local rank ``j*K``; the same on every node; ``len(devices) == G / K``.
        active_ranks: the global ranks that drive a replica, ascending; the others idle.
        stage_costs: the weighted cost of each stage (for logs and the cost model), in the planner's
            unit: under the strategy, parameters, a frozen block's count times ``frozen_cost``.
        budget: the largest stage cost at the start (same unit), which compression must not exceed.
    """

    num_frozen: int
    pipe_len: int
    chunks: int
    partition: tuple[int, ...]
    devices: tuple[tuple[str, ...], ...]
    active_ranks: tuple[int, ...]
    stage_costs: tuple[float, ...] = ()
    budget: float | None = None

    def __post_init__(self) -> None:
        # Accept lists (JSON, broadcast objects) but store tuples: a Plan stays hashable.
        set_ = object.__setattr__
        set_(self, "partition", tuple(int(b) for b in self.partition))
        set_(self, "devices", tuple(tuple(str(d) for d in ds) for ds in self.devices))
        set_(self, "active_ranks", tuple(int(r) for r in self.active_ranks))
        set_(self, "stage_costs", tuple(float(c) for c in self.stage_costs))
        if self.pipe_len < 1 or len(self.partition) != self.pipe_len or any(b < 1 for b in self.partition):
            raise ValueError(f"Plan: partition {self.partition} must have pipe_len={self.pipe_len} non-empty stages.")
        if not 0 <= self.num_frozen <= sum(self.partition):
            raise ValueError(f"Plan: num_frozen={self.num_frozen} is outside 0..{sum(self.partition)}.")
        if self.chunks < 1:
            raise ValueError(f"Plan: chunks must be >= 1, got {self.chunks}.")
        if not self.devices or any(len(ds) != self.pipe_len for ds in self.devices):
            raise ValueError(f"Plan: every replica needs pipe_len={self.pipe_len} devices, got {self.devices}.")
        if not self.active_ranks or list(self.active_ranks) != sorted(set(self.active_ranks)):
            raise ValueError(f"Plan: active_ranks must be non-empty, unique and ascending, got {self.active_ranks}.")
        if self.stage_costs and len(self.stage_costs) != self.pipe_len:
            raise ValueError(f"Plan: {len(self.stage_costs)} stage costs for {self.pipe_len} stages.")

    def __str__(self) -> str:
        """The plan in words (``repr`` keeps the fields). Costs are in the planner's unit: under the
        strategy, parameters, with a frozen block's count weighted by ``frozen_cost``."""
        text = (
            f"Plan: {self.num_frozen} of {self.num_blocks} blocks frozen; pipe length {self.pipe_len} "
            f"(blocks per stage {self.partition}); {self.chunks} micro-batch(es) per batch; "
            f"{len(self.active_ranks)} replica(s) on rank(s) {', '.join(map(str, self.active_ranks))}"
        )
        if self.stage_costs:
            text += f"; stage costs {' / '.join(f'{c:,.0f}' for c in self.stage_costs)} weighted parameters"
        if self.budget is not None:
            text += f" (budget {self.budget:,.0f}: the largest stage cost at the start, which a shorter pipeline must not exceed)"
        return text + "."

    @property
    def num_blocks(self) -> int:
        return sum(self.partition)

    @property
    def boundaries(self) -> tuple[int, ...]:
        """Block index where each stage starts, plus the total: ``(4, 4, 4) -> (0, 4, 8, 12)``."""
        return boundaries(self.partition)

    @property
    def num_replicas(self) -> int:
        """Data-parallel width: the number of pipeline replicas over all nodes."""
        return len(self.active_ranks)

    def is_active(self, rank: int) -> bool:
        return rank in self.active_ranks

    def replica_index(self, rank: int) -> int:
        """The rank's position among the replicas (its rank in the active training group)."""
        try:
            return self.active_ranks.index(rank)
        except ValueError:
            raise ValueError(f"Rank {rank} is idle under this plan (active ranks {self.active_ranks}).") from None

    def devices_for(self, local_rank: int) -> tuple[str, ...]:
        """The K devices local rank ``local_rank`` drives, one per stage (its own device first)."""
        k = self.pipe_len
        if local_rank % k or not 0 <= local_rank // k < len(self.devices):
            raise ValueError(
                f"Local rank {local_rank} drives no pipeline at pipe_len={k}: only local ranks "
                f"{', '.join(str(j * k) for j in range(len(self.devices)))} are active."
            )
        return self.devices[local_rank // k]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (lists, ints, floats, strings) for broadcast and checkpoints."""
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, tuple):
                out[key] = [list(v) if isinstance(v, tuple) else v for v in value]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Inverse of :meth:`to_dict`; rejects missing and unknown keys (a corrupt checkpoint)."""
        names = {f.name for f in fields(cls)}
        required = {"num_frozen", "pipe_len", "chunks", "partition", "devices", "active_ranks"}
        missing, unknown = required - set(data), set(data) - names
        if missing or unknown:
            raise ValueError(f"Not a Plan: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}.")
        return cls(**dict(data))

