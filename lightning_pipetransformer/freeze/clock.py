"""When AutoFreeze's freeze points fall: handed steps, epochs and batch counts, it answers.

The arithmetic of *when* lives here, apart from the callback, so that it is tested with numbers
(no Trainer) and the callback asks it as Lightning's ``BaseFinetuning`` asks its policy hook with
the epoch. Two kinds of points:

* epoch starts (``freeze_interval=None``): the start of every ``every_n_epochs``-th epoch from
  epoch ``n`` on (the first interval always trains the whole model), or every epoch start for a
  rule that is a plan per epoch;
* inside epochs: every ``freeze_interval`` optimizer steps (an int), or that fraction of an
  epoch's optimizer steps (a float, rounded, at least 1), counted across epochs from the first
  step. A point is checked at a batch that opens an accumulation window, so a freeze never
  splits one; points passed meanwhile (AutoDP applies them at the next epoch start) all count.

Its state (the last epoch that decided, the next point's step, the points passed) is part of
AutoFreeze's checkpoint under the keys ``decided_epoch``, ``next_point`` and ``points``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_pipetransformer.freeze.rules import interval_steps

__all__ = ["FreezeClock", "steps_per_epoch"]


def steps_per_epoch(batches: float | None, accumulate: int) -> int:
    """Optimizer steps in one training epoch of ``batches`` batches (what a fractional interval is a fraction of)."""
    if batches is None or batches == float("inf"):
        raise ValueError(
            "freeze_interval as a fraction of an epoch needs a training loader with a length; pass an int number of "
            "optimizer steps instead."
        )
    return max(1, -(-int(batches) // max(1, accumulate)))


class FreezeClock:
    """The freeze points of one AutoFreeze.

    Args:
        interval: points inside epochs (an int: optimizer steps; a float: a fraction of an
            epoch), or None for points at epoch starts.
        every_n_epochs: epochs between epoch-start points.
        per_epoch: the rule is a plan per epoch: every epoch start is a point (epoch 0 too).
    """

    def __init__(self, interval: int | float | None, every_n_epochs: int = 1, per_epoch: bool = False) -> None:
        self.interval = interval
        self.every_n_epochs = every_n_epochs
        self.per_epoch = per_epoch
        #: The last epoch whose start took its decision (a resumed epoch start does not decide twice).
        self.decided_epoch = 0
        #: Inside epochs: the optimizer step of the next point (set at the first train start), and the points passed.
        self.next_point: int | None = None
        self.points = 0
        #: Inside epochs: optimizer steps between points (known once the epoch's length is).
        self.interval_steps: int | None = None

    @property
    def within_epochs(self) -> bool:
        """Whether the points fall inside epochs (``freeze_interval``) rather than at epoch starts."""
        return self.interval is not None

    def start(self, step: int, batches: float | None, accumulate: int) -> None:
        """At train start: the interval in optimizer steps, and (for a fresh run) the first point, one interval on."""
        if self.interval is None:
            return
        # An int is optimizer steps, whatever the epoch's length: a loader without one (an
        # IterableDataset) is fine then; only a fraction of an epoch needs to know it.
        epoch_steps = steps_per_epoch(batches, accumulate) if isinstance(self.interval, float) else None
        self.interval_steps = interval_steps(self.interval, epoch_steps)
        if self.next_point is None:  # a resumed run restored its next point
            self.next_point = step + self.interval_steps

    # ------------------------------------------------------------------ is a point due

    def epoch_point(self, epoch: int) -> int | None:
        """The index of the point at the start of ``epoch`` (``epoch // n``; the epoch itself for a plan
        per epoch), or None when that start is no point. Counts the epoch as decided."""
        if self.per_epoch:
            return epoch
        n = self.every_n_epochs
        if epoch == 0 or epoch % n != 0 or epoch <= self.decided_epoch:
            return None
        self.decided_epoch = epoch
        return epoch // n

    @staticmethod
    def opens_window(batch_idx: int, accumulate: int) -> bool:
        """Whether batch ``batch_idx`` begins an accumulation window (a point never falls inside one)."""
        return batch_idx % max(1, accumulate) == 0

    def step_point(self, step: int) -> int | None:
        """Inside epochs: the index of the point due at optimizer step ``step``, counting every interval
        passed since the last point, or None when none is due."""
        if self.next_point is None or self.interval_steps is None or step < self.next_point:
            return None
        passed = (step - self.next_point) // self.interval_steps + 1
        self.points += passed
        self.next_point += passed * self.interval_steps
        return self.points

    # ------------------------------------------------------------------ the point after this one (smooth freezing)

    def following(self, epoch: int | None, current_epoch: int, max_epochs: int | None) -> tuple[int, int] | None:
        """The index and epoch of the point after the one at the start of ``epoch`` (None: a point inside
        an epoch, then the one after the last passed); None when no point follows the last epoch."""
        if self.per_epoch:
            assert epoch is not None
            if max_epochs is not None and 0 < max_epochs <= epoch + 1:
                return None
            return epoch + 1, epoch + 1
        if epoch is None:
            return self.points + 1, current_epoch
        n = self.every_n_epochs
        return epoch // n + 1, (epoch // n + 1) * n

    def following_step(self, step: int, epoch: int | None, batches: float | None, accumulate: int) -> int | None:
        """The optimizer step of the point after the one at ``step`` (at the start of ``epoch``; None:
        inside an epoch). Raises ``ValueError`` when that needs the epoch's length and the loader has none."""
        if self.interval is not None:
            return self.next_point
        if epoch is None:
            return None
        n = 1 if self.per_epoch else self.every_n_epochs
        return step + ((epoch // n + 1) * n - epoch) * steps_per_epoch(batches, accumulate)

    # ------------------------------------------------------------------ does a point fit the run

    def too_few_points(self, needed: int, rule: str, total_steps: float | None, max_epochs: int | None) -> str | None:
        """Before training: why a run of ``total_steps`` optimizer steps (inside epochs) or ``max_epochs``
        epochs freezes nothing, when fewer than ``needed`` points fit; None when enough do or the length is
        unknown. ``rule`` names the rule in the warning."""
        if self.interval is not None:
            if total_steps is None or total_steps == float("inf") or total_steps < 0:  # Lightning's -1: a stream, no max_steps
                return None
            assert self.next_point is not None and self.interval_steps is not None
            total = int(total_steps)
            fits = max(0, (total - 1 - self.next_point) // self.interval_steps + 1) if self.next_point < total_steps else 0
            every = f"freeze_interval={self.interval!r} ({self.interval_steps} optimizer steps)"
            length, fix = f"{total} optimizer steps", "a shorter freeze_interval (a float is a fraction of an epoch)"
        else:
            if max_epochs is None or max_epochs < 0:
                return None
            n = self.every_n_epochs
            fits = len(range(max(n, self.decided_epoch + n), max_epochs, n))
            every = f"freeze_every_n_epochs={n}"
            length, fix = f"max_epochs={max_epochs}", "more epochs, or freeze points inside epochs (freeze_interval=0.5)"
        if fits >= needed:
            return None
        count = {2: "two", 3: "three"}.get(needed, str(needed))
        what = "freeze point falls inside it" if fits == 0 else f"freeze point{'s fit' if fits > 1 else ' fits'}, and {rule} needs {count}"
        few = "no" if fits == 0 else "only one" if fits == 1 else f"only {fits}"
        return f"AutoFreeze: with {every} and a run of {length}, {few} {what}: nothing will be frozen. Use {fix}."

    # ------------------------------------------------------------------ words and state

    def describe(self) -> str:
        """How often the points come, for the callback's first log line."""
        if isinstance(self.interval, int):
            return f"every {self.interval} optimizer step(s)"
        if self.interval is not None:
            return f"every {self.interval:g} of an epoch"
        return f"every {self.every_n_epochs} epoch(s)"

    def where(self, epoch: int, step: int) -> str:
        """Where a freeze happened, for its log line (the step too when points fall inside epochs)."""
        return f"epoch {epoch}" + (f", step {step}" if self.interval is not None else "")

    def state_dict(self) -> dict[str, Any]:
        return {"decided_epoch": self.decided_epoch, "next_point": self.next_point, "points": self.points}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.decided_epoch = int(state.get("decided_epoch", 0))
        self.next_point = state.get("next_point")
        self.points = int(state.get("points", 0))
