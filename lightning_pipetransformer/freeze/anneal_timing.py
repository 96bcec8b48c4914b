"""When smooth freezing anneals: which blocks, over which optimizer steps, for which freeze point.

:mod:`lightning_pipetransformer.freeze.anneal` scales the updates of the blocks in one
:class:`~lightning_pipetransformer.freeze.anneal.AnnealPlan`; this module chooses the plans from
the freeze points. A rule that knows its next decision in advance (a fixed plan) anneals the blocks
of that decision over the interval before its point, so they freeze exactly where they would
without annealing. A rule that decides from the interval's gradients learns its decision only at
the point: its blocks anneal over the next interval and freeze at the point after (one interval
late), and nothing freezes at the decision itself.

An annealing that cannot engage says why, once per reason, and the blocks then freeze as without
annealing: never a silent half-annealed run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_pipetransformer.freeze.anneal import Annealer, AnnealPlan, AnnealSpec
from lightning_pipetransformer.stack.discovery import BlockStack
from lightning_pipetransformer.warn_once import WarnOnce

__all__ = ["AnnealTiming"]

#: Why annealing stands aside, said once each.
SEVERAL_PROCESSES = (
    "AutoFreeze(anneal=...) is off: with several processes under strategy='pipetransformer', AutoDP applies "
    "freezes at epoch starts whose optimizer step is not known in advance (replicas joining change the "
    "epoch's length), so an interval cannot be annealed to end at the freeze. Blocks freeze without annealing."
)
NO_LENGTH = (
    "AutoFreeze(anneal=...) cannot anneal: the training loader has no length, so the step of the next "
    "epoch-start freeze point is unknown. Blocks freeze without annealing."
)


class AnnealTiming:
    """The annealing of one AutoFreeze: built at set-up where it can engage, off (with the reason) where not.

    Args:
        spec: the curve (checked by :class:`~lightning_pipetransformer.freeze.config.AutoFreezeConfig`).
        plans_ahead: the rule knows its coming decisions (a fixed plan); else its freezes come one
            interval after their decisions.
        warn: how a reason is said (rank zero's warning in the callback).
        info: how a begun annealing is logged.
    """

    def __init__(self, spec: AnnealSpec, plans_ahead: bool, warn: Callable[[str], None], info: Callable[[str], None]) -> None:
        self.spec = spec
        self.plans_ahead = plans_ahead
        self.annealer: Annealer | None = None
        self._said = WarnOnce(lambda message, stacklevel: warn(message))
        self._info = info

    @property
    def label(self) -> str:
        return self.spec if isinstance(self.spec, str) else "custom"

    @property
    def lags(self) -> bool:
        """Engaged for a rule that decides from the interval's gradients: it knows the next ``F`` only at
        the point itself, so that decision anneals over the next interval and freezes at the point after."""
        return self.annealer is not None and not self.plans_ahead

    def describe(self) -> str:
        """The annealing in AutoFreeze's first log line."""
        return f", anneal={self.label}" + ("" if self.plans_ahead else " (each freeze one interval after its decision)")

    @property
    def plan(self) -> AnnealPlan | None:
        return self.annealer.plan if self.annealer is not None else None

    def setup(self, several_processes_under_autodp: bool) -> None:
        """At each fit's set-up: engage, or say why not."""
        if several_processes_under_autodp:
            self.annealer = None
            self._said("autodp", SEVERAL_PROCESSES)
            return
        if self.annealer is None:
            self.annealer = Annealer(self.spec)

    def no_length(self) -> None:
        """The step of the next epoch-start point is unknown (a loader without a length)."""
        self._said("length", NO_LENGTH)

    def begin(self, stack: BlockStack, include_pre: bool, pre_frozen: bool, source: int, target: int, step: int, end: int | None) -> bool:
        """Anneal blocks ``source..target-1`` over the steps ``step..end-1``; False if it cannot engage."""
        if self.annealer is None or end is None or target <= source:
            return False
        if end - step < 2:
            self._said(
                "short", f"AutoFreeze(anneal=...): the interval before the freeze at step {end} has {end - step} optimizer "
                "step(s); annealing needs at least 2 (an interval's first step runs at the full rate), so its blocks "
                "freeze without annealing.",
            )
            return False
        self.annealer.bind(stack, include_pre, pre_frozen)
        if self.annealer.begin(AnnealPlan(source, target, step, end)):
            self._info(
                f"AutoFreeze: step {step}: annealing blocks {source}..{target - 1} to a zero learning rate "
                f"({self.spec if isinstance(self.spec, str) else 'custom curve'}) until the freeze point at step {end}."
            )
        return True

    def due(self, step: int) -> int | None:
        """At a freeze point: the frozen count whose annealing ended by ``step`` (its rate reached zero), else None."""
        plan = self.plan
        if plan is None or step < plan.end:
            return None
        assert self.annealer is not None
        self.annealer.clear()
        return plan.target

    def at_step(self, stack: BlockStack, include_pre: bool, pre_frozen: bool, step: int, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Before an optimizer step: the step that comes (its update's factor), hooks on every optimizer."""
        if self.annealer is not None:
            self.annealer.bind(stack, include_pre, pre_frozen)
            self.annealer.at_step(step, optimizers)

    def detach(self) -> None:
        if self.annealer is not None:
            self.annealer.detach()  # the optimizer's step hooks go with the fit

    def state_dict(self) -> dict[str, Any] | None:
        return self.annealer.state_dict() if self.annealer is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.annealer is not None:
            self.annealer.load_state_dict(state)
