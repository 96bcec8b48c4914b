"""What moving from one plan to another takes, as plain data that can be printed and tested.

A transition (``Coordinator.transition``) does only what its :class:`PlanChange`
says: rebuild this process's pipeline, regroup the replicas, send state to the ranks that join,
re-split the training data, move the cache boundary. Keeping the decision as data, the way
``torch.distributed.pipelining`` keeps a schedule as printable actions, means the order of the
steps is one function's body and the conditions are unit-tested here, without processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_pipetransformer.plan import Plan

__all__ = ["PlanChange"]


@dataclass(frozen=True)
class PlanChange:
    """The steps a move from ``old`` to ``new`` needs (``old`` is None at the first plan of a fit).

    Attributes:
        old, new: the plans.
        rebuild: the pipeline must be rebuilt (frozen blocks, partition, pipe length or replicas changed).
        regroup: the set of active ranks changed: a new active process group, DDP rebuilt on it.
        joining: ranks that drive a replica under ``new`` and did not under ``old``; they receive
            the replicas' weights, optimizer and LR-scheduler state.
        leaving: ranks that drove a replica under ``old`` and idle under ``new``.
        resplit: the number of replicas changed: the training data is split anew.
        boundary: ``(old F, new F)`` when the frozen prefix grew (the cache's boundary moves), else None.
    """

    old: Plan | None
    new: Plan
    rebuild: bool
    regroup: bool
    joining: tuple[int, ...]
    leaving: tuple[int, ...]
    resplit: bool
    boundary: tuple[int, int] | None

    @classmethod
    def between(cls, old: Plan | None, new: Plan) -> PlanChange:
        """The change from ``old`` to ``new``; everything is to do when there is no old plan."""
        if old is None:
            return cls(None, new, True, True, new.active_ranks, (), True, None)
        was, now = set(old.active_ranks), set(new.active_ranks)
        moved = new.num_frozen != old.num_frozen
        return cls(
            old,
            new,
            rebuild=moved or new.partition != old.partition or new.active_ranks != old.active_ranks or new.devices != old.devices,
            regroup=new.active_ranks != old.active_ranks,
            joining=tuple(sorted(now - was)),
            leaving=tuple(sorted(was - now)),
            resplit=new.num_replicas != old.num_replicas,
            boundary=(old.num_frozen, new.num_frozen) if moved else None,
        )

    @property
    def is_empty(self) -> bool:
        """Nothing to do: the same plan (chunks aside, which the runner reads when it is rebuilt)."""
        return not (self.rebuild or self.regroup or self.resplit or self.boundary)

    def steps(self) -> list[str]:
        """The transition's steps for this change, in the order the strategy runs them."""
        if self.is_empty:
            return []
        new, old = self.new, self.old
        out = []
        if self.rebuild:
            was = f"F={old.num_frozen} K={old.pipe_len} {old.partition}" if old is not None else "nothing"
            out.append(f"rebuild: {was} -> F={new.num_frozen} K={new.pipe_len} {new.partition}")
        if self.regroup:
            out.append(f"regroup: active ranks {old.active_ranks if old is not None else ()} -> {new.active_ranks}")
        if self.joining and old is not None:
            out.append(f"send state: rank {new.active_ranks[0]} -> joining {self.joining}")
        if self.leaving:
            out.append(f"idle: {self.leaving}")
        if self.resplit:
            out.append(f"resplit: data over {new.num_replicas} replica(s)")
        if self.boundary is not None:
            out.append(f"boundary: F {self.boundary[0]} -> {self.boundary[1]}")
        return out

    def __str__(self) -> str:
        steps = self.steps()
        return "PlanChange(nothing)" if not steps else "PlanChange:\n" + "\n".join(f"  {i + 1}. {s}" for i, s in enumerate(steps))
