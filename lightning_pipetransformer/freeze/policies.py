"""Freeze rules as policy objects: what a rule observes each step, what it decides at a freeze point.

:class:`~lightning_pipetransformer.freeze.callback.AutoFreeze` owns the mechanism (when a point is
due, freezing, telling the strategy, annealing, checkpoints); a rule only answers "how many leading
blocks should be frozen now?". Keeping the two apart lets a rule be tested by feeding it statistics
and points by hand, without a Trainer, and lets a user bring a rule of their own::

    class FreezeHalfAtEpoch3(FreezeRuleBase):
        name = "half at epoch 3"

        def decide(self, point: FreezePoint) -> int:
            return point.num_blocks // 2 if point.epoch >= 3 else point.num_frozen

    AutoFreeze(rule=FreezeHalfAtEpoch3())

The callback keeps the result between the blocks already frozen and ``num_blocks - min_active``,
so a rule may ask for more (it is capped) and never unfreezes. Every process runs the same rule on
the same all-reduced numbers, so decisions agree without a collective.

The built-in rules (``"paper"``, ``"schedule"``, ``"autofreeze"``, ``"plasticity"``, explicit plans) are defined in
:mod:`lightning_pipetransformer.freeze.rules` as pure functions; the classes here hold the state
between points (statistics of :mod:`lightning_pipetransformer.freeze.statistics`) and checkpoint it
as flat keys of the callback's state (``norm_sum``, ``norm_steps``, ``previous_l1``, ``grad_sums``,
``plasticity_previous``, ``plasticity_reference``), so that a checkpoint loads whichever rule wrote it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args, runtime_checkable

from lightning_pipetransformer.freeze.rules import (
    ExplicitSchedule,
    autofreeze_num_frozen,
    geometric_num_frozen,
    paper_num_frozen,
    plasticity_num_frozen,
    validate_alpha,
    validate_ratio,
)
from lightning_pipetransformer.freeze.statistics import Displacement, GradientSums, NormSums
from lightning_pipetransformer.stack.discovery import BlockStack

__all__ = [
    "AutoFreezeRule",
    "ExplicitPlan",
    "FreezePoint",
    "FreezeRule",
    "GeometricSchedule",
    "PaperRule",
    "PlasticityRule",
    "FreezeRuleBase",
    "RULES",
    "Rule",
    "check_rule",
    "make_rule",
    "validate_percentile",
]


def validate_percentile(percentile: float) -> float:
    """The ``"autofreeze"`` rule's threshold: a percentile in (0, 100)."""
    if not 0.0 < float(percentile) < 100.0:
        raise ValueError(f"percentile must be in (0, 100) (the original AutoFreeze uses 50), got {percentile!r}.")
    return float(percentile)


@dataclass(frozen=True)
class FreezePoint:
    """Where a decision is taken, and the stack as it stands before it.

    ``index`` is ``T``, the freeze step: with ``freeze_every_n_epochs=n`` the point at the start of
    epoch ``e`` is ``e // n``; with ``freeze_interval`` the number of intervals passed (several
    when AutoDP applies the points of an epoch at the next epoch start); for a plan per epoch, the
    epoch. ``epoch``: the epoch the point falls in (for :meth:`FreezeRule.ahead` at epoch level, the
    coming point's epoch; inside epochs, the current one). ``untrainable``: leading blocks that had
    no trainable parameter at set-up (frozen before fit): they count as frozen whatever a rule says.
    ``learning_rate``: the rate of the coming optimizer step (the first optimizer's first parameter
    group) and ``previous_learning_rate`` the last step's, None where unknown; ``"plasticity"`` reads
    whether it still rises (a warm-up).
    """

    index: int
    epoch: int
    num_frozen: int
    num_blocks: int
    max_frozen: int
    untrainable: int = 0
    learning_rate: float | None = None
    previous_learning_rate: float | None = None


@runtime_checkable
class FreezeRule(Protocol):
    """What AutoFreeze asks of a freeze rule. Subclass :class:`FreezeRuleBase` for the defaults."""

    #: Shown in AutoFreeze's log lines.
    name: str
    #: Points a run needs before the rule's first freeze (a rule that compares two intervals: 2):
    #: AutoFreeze warns before training when fewer fit.
    points_before_first_freeze: int
    #: Every epoch start is a point (epoch 0 too), whatever ``freeze_every_n_epochs`` says, and
    #: ``freeze_interval`` is refused: the rule is a plan per epoch (``schedule=``).
    per_epoch: bool
    #: :meth:`ahead` knows the coming decisions (a fixed plan). A rule that decides from what the
    #: interval measured does not: with smooth freezing its blocks freeze one interval late.
    plans_ahead: bool

    def check(self, max_frozen: int, num_epochs: int | None) -> None:
        """Refuse a plan that cannot be followed, before training (``num_epochs``: None when unbounded)."""

    def observe(self, stack: BlockStack, num_frozen: int) -> None:
        """Every optimizer step, with the gradients final: gather what :meth:`decide` needs."""

    def decide(self, point: FreezePoint) -> int:
        """At a freeze point: the number of leading blocks that should be frozen from now on."""

    def ahead(self, point: FreezePoint) -> int | None:
        """The number :meth:`decide` will ask for at the coming ``point``, if the rule knows it in
        advance (a fixed plan), else None. Smooth freezing anneals the blocks in the interval
        before a known point, and one interval after the decision otherwise."""

    def state_dict(self, full: bool = True) -> dict[str, Any]:
        """The state between points. ``full=False``: what another process needs to follow this
        one's decisions (AutoDP's agree message), without bulk statistics it never reads."""

    def load_state_dict(self, state: Mapping[str, Any], stack: BlockStack | None) -> None:
        """Restore :meth:`state_dict` (keys of another rule are ignored)."""


class FreezeRuleBase:
    """Defaults for a rule that needs no statistics and knows nothing ahead: override :meth:`decide`."""

    name = "custom"
    points_before_first_freeze = 1
    per_epoch = False
    plans_ahead = False

    def check(self, max_frozen: int, num_epochs: int | None) -> None:
        return None

    def observe(self, stack: BlockStack, num_frozen: int) -> None:
        return None

    def decide(self, point: FreezePoint) -> int:
        raise NotImplementedError

    def ahead(self, point: FreezePoint) -> int | None:
        return None

    def state_dict(self, full: bool = True) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any], stack: BlockStack | None) -> None:
        return None


class GeometricSchedule(FreezeRuleBase):
    """``rule="schedule"``: ``F(T) = ceil(L (1 - (1 - alpha)^T))``, a fixed plan (no measurements)."""

    name = "schedule"
    plans_ahead = True

    def __init__(self, alpha: float) -> None:
        self.alpha = validate_alpha(alpha)

    def decide(self, point: FreezePoint) -> int:
        return geometric_num_frozen(point.num_blocks, self.alpha, point.index)

    def ahead(self, point: FreezePoint) -> int | None:
        return self.decide(point)


class PaperRule(FreezeRuleBase):
    """``rule="paper"``: the geometric step, stopped earlier at the active block with the smallest
    mean gradient norm over the interval (:func:`~lightning_pipetransformer.freeze.rules.paper_num_frozen`).
    An interval without a finite optimizer step decides nothing."""

    name = "paper"

    def __init__(self, alpha: float) -> None:
        self.alpha = validate_alpha(alpha)
        self.statistics = NormSums()

    def observe(self, stack: BlockStack, num_frozen: int) -> None:
        self.statistics.observe(stack, num_frozen)

    def decide(self, point: FreezePoint) -> int:
        norms = self.statistics.mean()
        self.statistics.reset()
        if norms is None:
            return point.num_frozen
        return paper_num_frozen(point.num_frozen, self.alpha, norms)

    def state_dict(self, full: bool = True) -> dict[str, Any]:
        return self.statistics.state_dict()

    def load_state_dict(self, state: Mapping[str, Any], stack: BlockStack | None) -> None:
        self.statistics.load_state_dict(dict(state))


class AutoFreezeRule(FreezeRuleBase):
    """``rule="autofreeze"`` (Liu et al., 2021): compare each block's summed-gradient L1 norm with the
    previous interval's (:func:`~lightning_pipetransformer.freeze.rules.autofreeze_num_frozen`). The
    first interval only sets the baseline; an overflowed interval decides nothing and drops it."""

    name = "autofreeze"
    points_before_first_freeze = 2

    def __init__(self, percentile: float = 50.0) -> None:
        self.percentile = validate_percentile(percentile)
        self.statistics = GradientSums()
        self.previous_l1: list[float] | None = None

    def observe(self, stack: BlockStack, num_frozen: int) -> None:
        self.statistics.observe(stack, num_frozen)

    def decide(self, point: FreezePoint) -> int:
        l1 = self.statistics.l1_norms(point.num_frozen)
        if l1 is None:
            return point.num_frozen
        self.statistics.reset()
        if not all(math.isfinite(v) for v in l1):  # overflowed sums: no decision, and no baseline for the next
            self.previous_l1 = None
            return point.num_frozen
        previous, self.previous_l1 = self.previous_l1, l1
        if previous is None:
            return point.num_frozen
        return autofreeze_num_frozen(point.num_frozen, previous, l1, self.percentile)

    def state_dict(self, full: bool = True) -> dict[str, Any]:
        # The summed gradients are a copy of the active blocks' size (~340 MB for BERT-base), read
        # only by the deciding process: checkpoints keep them, the agree message does not.
        return {"previous_l1": self.previous_l1, **(self.statistics.state_dict() if full else {})}

    def load_state_dict(self, state: Mapping[str, Any], stack: BlockStack | None) -> None:
        self.previous_l1 = state.get("previous_l1")
        self.statistics.load_state_dict(dict(state), stack)


class PlasticityRule(FreezeRuleBase):
    """``rule="plasticity"`` (issue 41): freeze early, without a block count, the leading blocks that fine-tuning
    moves least (:func:`~lightning_pipetransformer.freeze.rules.plasticity_num_frozen`).

    Why: the lower blocks of a pretrained Transformer change least in fine-tuning and can stay as they are
    (Lee et al., 2019, "What would Elsa do?"); Egeria (Wang et al., 2023) freezes the layers whose
    plasticity has fallen behind. Here plasticity is measured in weight space, where it costs nothing per
    step: per active block ``||w - w(0)|| / ||w(0)||``, the distance from the weights fine-tuning started
    from (copied at the first step) as a share of their size, read at each point. The leading blocks that
    moved less than ``ratio`` times the most-moved active block are the candidate.

    When: not while the learning rate still rises (a warm-up: the weights move at a fraction of the rate,
    nearly alike, before the task's gradients show which blocks it moves; on MiniLM the lower half looked
    least plastic during the warm-up and caught up after it). From the first point after that, a candidate
    freezes once two points in a row agree (the smaller of the two), so one noisy reading freezes nothing.
    Blocks keep freezing as the run goes on: the blocks near the head keep moving, the ones below them fall
    under the line; the most-moved block never freezes, so the rule stops by itself where the active blocks
    move alike. It is meant for points inside the first epoch: ``AutoFreeze(rule="plasticity")`` decides
    every ``default_interval`` of an epoch (1/16) unless ``freeze_interval`` is given. Memory: one copy of the
    active blocks (dropped block by block as they freeze). Checkpoints carry it; AutoDP's agree message
    (``full=False``) does not.

    Args:
        ratio: the share of the most-moved active block's displacement below which a leading block
            freezes, in (0, 1). Default 2/3: see docs/autofreeze.md for where it comes from.
    """

    name = "plasticity"
    points_before_first_freeze = 2  # a candidate needs a second reading
    #: The freeze interval ``AutoFreeze(rule="plasticity")`` uses when none is given: a sixteenth of an epoch.
    default_interval = 0.0625

    def __init__(self, ratio: float = 2 / 3) -> None:
        self.ratio = validate_ratio(ratio)
        self.statistics = Displacement()
        self.previous: int | None = None  # the candidate at the last point (None: none yet, or warming up)
        self._stack: BlockStack | None = None

    def observe(self, stack: BlockStack, num_frozen: int) -> None:
        self._stack = stack
        self.statistics.observe(stack, num_frozen)

    def candidate(self, num_frozen: int) -> int | None:
        """The blocks that moved less than ``ratio`` of the most-moved active one, now (None before the first step)."""
        if self._stack is None:
            return None
        moved = self.statistics.relative(self._stack, num_frozen)
        return None if moved is None else plasticity_num_frozen(num_frozen, moved, self.ratio)

    @staticmethod
    def warming_up(point: FreezePoint) -> bool:
        """Whether the coming optimizer step's learning rate is above the last step's (a warm-up). Unknown rates
        (no optimizer step yet, no ``lr`` in the optimizer) gate nothing."""
        now, last = point.learning_rate, point.previous_learning_rate
        return now is not None and last is not None and now > last * (1 + 1e-9)

    def decide(self, point: FreezePoint) -> int:
        now = None if self.warming_up(point) else self.candidate(point.num_frozen)
        previous, self.previous = self.previous, now
        if now is None or previous is None:
            return point.num_frozen
        return max(point.num_frozen, min(now, previous))

    def state_dict(self, full: bool = True) -> dict[str, Any]:
        # The copy of the weights is the active blocks' size (~340 MB for MPNet-base), read only by the deciding
        # process: checkpoints keep it, the agree message does not.
        return {"plasticity_previous": self.previous, **(self.statistics.state_dict() if full else {})}

    def load_state_dict(self, state: Mapping[str, Any], stack: BlockStack | None) -> None:
        self.previous = state.get("plasticity_previous")
        if stack is not None:
            self._stack = stack
        if "plasticity_reference" in state:  # absent from an agree message: the deciding process keeps its own
            self.statistics.load_state_dict(dict(state))


class ExplicitPlan(FreezeRuleBase):
    """``schedule=``: the user's plan, ``{epoch: num_frozen}`` (a step function) or ``epoch -> num_frozen``.

    A plan per epoch: it is asked at every epoch start, and a plan that decreases or exceeds the
    stack is refused (at set-up for a dict, at the epoch for a callable) rather than capped, since
    the experiment it describes would not be the one that runs.
    """

    name = "explicit schedule"
    per_epoch = True
    plans_ahead = True

    def __init__(self, plan: ExplicitSchedule | Mapping[int, int] | Callable[[int], int]) -> None:
        self.plan = plan if isinstance(plan, ExplicitSchedule) else ExplicitSchedule(plan)

    def check(self, max_frozen: int, num_epochs: int | None) -> None:
        self.plan.validate(max_frozen, num_epochs)

    def decide(self, point: FreezePoint) -> int:
        # Blocks without a trainable parameter count as frozen from the start, whatever the plan says.
        target = max(self.plan(point.epoch), point.untrainable)
        if target < point.num_frozen or target > max(point.max_frozen, point.untrainable):
            raise ValueError(
                f"schedule({point.epoch}) = {target}, but {point.num_frozen} blocks are already frozen and at most "
                f"{point.max_frozen} may be: a schedule must not decrease or exceed the stack."
            )
        return target

    def ahead(self, point: FreezePoint) -> int | None:
        target = self.plan(point.epoch)
        return target if point.num_frozen < target <= point.max_frozen else None  # a bad plan is refused at its epoch


def make_rule(
    rule: str | FreezeRule,
    alpha: float,
    percentile: float,
    schedule: Mapping[int, int] | Callable[[int], int] | None,
) -> FreezeRule:
    """The policy for AutoFreeze's arguments: an explicit ``schedule`` overrides ``rule`` and ``alpha``."""
    if schedule is not None:
        return ExplicitPlan(schedule)
    if isinstance(rule, FreezeRule) and not isinstance(rule, str):
        return rule
    check_rule(rule)
    built_in: dict[str, Callable[[], FreezeRule]] = {
        "paper": lambda: PaperRule(alpha), "schedule": lambda: GeometricSchedule(alpha),
        "autofreeze": lambda: AutoFreezeRule(percentile), "plasticity": PlasticityRule,
    }  # fmt: skip
    return built_in[rule]()


#: The built-in rules by name (AutoFreeze's ``rule=``), in the order an error lists them.
Rule = Literal["paper", "schedule", "autofreeze", "plasticity"]
RULES: tuple[str, ...] = get_args(Rule)


def check_rule(rule: object) -> None:
    """Refuse a ``rule`` that is neither a built-in rule's name (:data:`RULES`) nor a :class:`FreezeRule` object."""
    if not (isinstance(rule, FreezeRule) or rule in RULES):
        raise ValueError(f"rule must be {', '.join(map(repr, RULES))} or a FreezeRule object, got {rule!r}.")
