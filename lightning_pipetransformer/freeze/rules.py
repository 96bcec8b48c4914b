"""Freeze rules' arithmetic: how many leading blocks are frozen after each freeze step.

Two rules from the PipeTransformer paper, the original AutoFreeze system's rule
(:func:`autofreeze_num_frozen`), and explicit plans for reproducible experiments. The policy
objects that hold each rule's state between points and answer AutoFreeze are in
:mod:`lightning_pipetransformer.freeze.policies`.
``L`` is the number of blocks, ``F(T)`` the number frozen after freeze step ``T`` (``F(0) = 0``):

* ``"schedule"`` (what the official code ran): the geometric term alone,
  ``F(T) = ceil(L * (1 - (1 - alpha) ** T))``. For L=12, alpha=1/3: 0, 4, 7, 9, 10, 11, 11, 12.
* ``"paper"`` (the paper's rule): ``F(T) = min(F(T-1) + alpha * (L - F(T-1)), argmin ...)``:
  the geometric step is an upper bound, and the freeze stops earlier at the active block with
  the smallest gradient norm during the last interval. Concretely the gradient term is
  ``j* + 1`` where ``j*`` is the active block (index ``>= F(T-1)``) with the smallest norm: the
  blocks up to and including it freeze. The geometric step is rounded up, so each step of the
  paper rule freezes at least one block while any stay active.
* ``"plasticity"`` (issue 41: an early rule without a block count): per active block, how far its
  weights have moved since fine-tuning began, relative to their size; the leading blocks that moved
  less than ``ratio`` times the most-moved active block freeze (:func:`plasticity_num_frozen`).

They are pure functions, so every process computes the same answer from the same inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

__all__ = [
    "ExplicitSchedule",
    "autofreeze_num_frozen",
    "geometric_num_frozen",
    "interval_steps",
    "paper_num_frozen",
    "plasticity_num_frozen",
    "validate_alpha",
    "validate_ratio",
    "validate_interval",
]

# ``1/3`` as a float times 12 is 3.9999999999999996 or 4.000000000000001 depending on the
# order of operations; ceil must not turn that into 5.
_EPS = 1e-9


def validate_alpha(alpha: float) -> float:
    """Check ``0 < alpha < 1`` and return it as a float."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < float(alpha) < 1.0:
        raise ValueError(
            f"alpha must be a number strictly between 0 and 1 (the fraction of the active blocks frozen "
            f"at each freeze step; the paper uses 1/3 to 1/2), got {alpha!r}."
        )
    return float(alpha)


def _ceil(x: float) -> int:
    return math.ceil(x - _EPS)


def geometric_num_frozen(num_blocks: int, alpha: float, step: int) -> int:
    """``ceil(L * (1 - (1 - alpha) ** step))``: the official code's fixed schedule."""
    alpha = validate_alpha(alpha)
    if step < 0:
        raise ValueError(f"The freeze step must be >= 0, got {step}.")
    return min(num_blocks, _ceil(num_blocks * (1.0 - (1.0 - alpha) ** step)))


def paper_num_frozen(prev_frozen: int, alpha: float, grad_norms: Sequence[float]) -> int:
    """One step of the paper's rule from ``prev_frozen`` with per-block gradient norms.

    Args:
        prev_frozen: blocks frozen before this step.
        alpha: the geometric fraction, ``0 < alpha < 1``.
        grad_norms: one norm per block (all ``L`` of them; entries of frozen blocks are ignored).
    """
    alpha = validate_alpha(alpha)
    num_blocks = len(grad_norms)
    if not 0 <= prev_frozen <= num_blocks:
        raise ValueError(f"prev_frozen={prev_frozen} is outside 0..{num_blocks}.")
    if prev_frozen == num_blocks:
        return num_blocks
    geometric = _ceil(prev_frozen + alpha * (num_blocks - prev_frozen))
    active = list(grad_norms[prev_frozen:])
    smallest = prev_frozen + min(range(len(active)), key=lambda i: active[i])
    return min(num_blocks, geometric, smallest + 1)


def autofreeze_num_frozen(prev_frozen: int, previous_l1: Sequence[float], current_l1: Sequence[float], percentile: float = 50.0) -> int:
    """One decision of the original AutoFreeze system (Liu et al., 2021, ``freeze_intermediate_e2e_lr.py``).

    Per block, the L1 norm of the gradient *summed over an interval*: a block whose gradients keep
    pointing the same way has a large one, a block that has stopped learning a small, steady one.
    The relative change from the previous interval, ``|prev - cur| / prev``, is computed for every
    block (0 where ``prev`` or ``cur`` is 0, as for frozen blocks); the threshold is its
    ``percentile``-th percentile over the active blocks (``index >= prev_frozen``); the blocks
    before the first block whose change reaches the threshold freeze. Never returns less than
    ``prev_frozen``; a non-finite norm of an active block (an overflowed interval) decides nothing.
    """
    import numpy as np

    if len(previous_l1) != len(current_l1):
        raise ValueError(f"Got {len(previous_l1)} previous and {len(current_l1)} current norms.")
    if not all(math.isfinite(v) for v in [*previous_l1[prev_frozen:], *current_l1[prev_frozen:]]):
        return prev_frozen
    ratios = [abs(p - c) / p if p > 0 and c > 0 else 0.0 for p, c in zip(previous_l1, current_l1)]
    active = ratios[prev_frozen:]
    if not active:
        return prev_frozen
    threshold = float(np.percentile(active, percentile))
    first = next((i for i, r in enumerate(ratios) if r >= threshold), prev_frozen)
    return max(prev_frozen, first)


def validate_ratio(ratio: float) -> float:
    """The ``"plasticity"`` rule's threshold: a share of the most-moved block's displacement, in (0, 1)."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < float(ratio) < 1.0:
        raise ValueError(
            f"ratio must be a number strictly between 0 and 1 (a block freezes once it has moved less than this share "
            f"of the most-moved active block; the default is 2/3), got {ratio!r}."
        )
    return float(ratio)


def plasticity_num_frozen(prev_frozen: int, displacement: Sequence[float], ratio: float) -> int:
    """The ``"plasticity"`` rule's candidate: ``prev_frozen`` plus the leading active blocks whose relative
    displacement is below ``ratio`` times the largest active one.

    ``displacement[i]`` is ``||w_i - w_i(0)|| / ||w_i(0)||``: how far block ``i``'s weights moved since
    fine-tuning began, as a share of their size (entries of the ``prev_frozen`` frozen blocks are ignored).
    Scanning upward from the first active block, the blocks freeze until the first one that moved at least
    ``ratio`` of the most-moved active block: that block, and everything above it, keep training, so the
    most-moved block never freezes. Nothing moved yet (the largest displacement is 0) or a non-finite value
    decides nothing: ``prev_frozen``.
    """
    ratio = validate_ratio(ratio)
    if not 0 <= prev_frozen <= len(displacement):
        raise ValueError(f"prev_frozen={prev_frozen} is outside 0..{len(displacement)}.")
    active = list(displacement[prev_frozen:])
    if not active or not all(math.isfinite(v) for v in active):
        return prev_frozen
    top = max(active)
    if top <= 0.0:
        return prev_frozen
    below = next((i for i, v in enumerate(active) if v >= ratio * top), len(active))
    return prev_frozen + below


def validate_interval(interval: int | float | None) -> int | float | None:
    """``freeze_interval``: ``None``, an int >= 1 (optimizer steps) or a float in (0, 1] (a fraction of an epoch)."""
    if interval is None:
        return None
    if isinstance(interval, bool) or not isinstance(interval, (int, float)):
        raise ValueError(f"freeze_interval must be an int (optimizer steps) or a float in (0, 1] (a fraction of an epoch), got {interval!r}.")
    if isinstance(interval, int) and interval < 1:
        raise ValueError(f"freeze_interval as a number of optimizer steps must be >= 1, got {interval}.")
    if isinstance(interval, float) and not 0.0 < interval <= 1.0:
        raise ValueError(f"freeze_interval as a fraction of an epoch must be in (0, 1], got {interval}; an int means optimizer steps.")
    return interval


def interval_steps(interval: int | float, steps_per_epoch: int | None) -> int:
    """Optimizer steps between freeze points: the int itself, or the fraction of an epoch rounded (at least 1)."""
    if isinstance(interval, int):
        return interval
    if steps_per_epoch is None:
        raise ValueError(f"freeze_interval={interval!r} is a fraction of an epoch: it needs the epoch's optimizer steps.")
    return max(1, round(interval * steps_per_epoch))


class ExplicitSchedule:
    """A user's per-epoch plan: ``{epoch: num_frozen}`` (a step function) or ``epoch -> num_frozen``.

    With a dict, the number frozen at epoch ``e`` is the value of the largest key ``<= e`` (0 before
    the first key). Plans must never decrease and never exceed ``limit`` blocks; dict plans are
    checked when built, callables for every epoch the run will see (:meth:`validate`).
    """

    def __init__(self, plan: Mapping[int, int] | Callable[[int], int]) -> None:
        if isinstance(plan, Mapping):
            items = sorted((int(k), int(v)) for k, v in plan.items())
            if any(k < 0 for k, _ in items):
                raise ValueError(f"schedule epochs must be >= 0, got {dict(items)}.")
            self._items: list[tuple[int, int]] | None = items
            self._fn: Callable[[int], int] | None = None
        elif callable(plan):
            self._items, self._fn = None, plan
        else:
            raise TypeError(f"schedule must be a dict epoch -> num_frozen or a callable, got {type(plan).__name__}.")

    def __call__(self, epoch: int) -> int:
        if self._fn is not None:
            value = self._fn(epoch)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"schedule({epoch}) returned {value!r}; it must return an int number of frozen blocks.")
            return value
        assert self._items is not None
        value = 0
        for key, frozen in self._items:
            if key > epoch:
                break
            value = frozen
        return value

    def validate(self, limit: int, num_epochs: int | None) -> None:
        """Raise if the plan decreases or exceeds ``limit`` over epochs ``0..num_epochs-1``."""
        if self._items is not None:
            epochs = [k for k, _ in self._items]
        elif num_epochs is not None:
            epochs = list(range(num_epochs))
        else:
            return  # a callable with an unbounded run: checked as it goes
        previous = 0
        for epoch in epochs:
            value = self(epoch)
            if value < 0 or value > limit:
                raise ValueError(
                    f"schedule asks for {value} frozen blocks at epoch {epoch}, outside 0..{limit} "
                    f"(the stack's blocks minus min_active)."
                )
            if value < previous:
                raise ValueError(
                    f"schedule decreases at epoch {epoch} ({previous} -> {value}): frozen blocks never unfreeze."
                )
            previous = value
