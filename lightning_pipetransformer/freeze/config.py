"""AutoFreeze's arguments, as a frozen dataclass validated on construction.

Why a dataclass next to a callback whose ``__init__`` lists the same arguments: LightningCLI builds
AutoFreeze from YAML and reads the types, defaults and help from the ``__init__`` signature and
docstring, so those stay explicit there; every check, and every error text, lives here once, as
for the strategy's :class:`~lightning_pipetransformer.config.PipeTransformerConfig`. The field
docstrings are the rows of the AutoFreeze table in ``docs/configuration.md``
(``tests/unit/freeze/test_config.py`` holds them equal).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from lightning_pipetransformer.freeze.anneal import AnnealSpec, anneal_curve
from lightning_pipetransformer.freeze.policies import FreezeRule, Rule, check_rule, validate_percentile
from lightning_pipetransformer.freeze.rules import ExplicitSchedule, validate_alpha, validate_interval

if TYPE_CHECKING:
    from torch import nn

    from lightning_pipetransformer.stack.discovery import BlockStack

__all__ = ["AutoFreezeConfig"]

@dataclasses.dataclass(frozen=True)
class AutoFreezeConfig:
    """AutoFreeze's arguments (``AutoFreeze(alpha=..., rule=..., ...)``), checked once."""

    alpha: float = 1 / 3
    """fraction of the still-active blocks frozen per freeze step; `0 < alpha < 1`."""

    rule: Rule | FreezeRule = "paper"
    """`"paper"`: the geometric step is an upper bound and the freeze stops at the active block
    with the smallest gradient norm. `"schedule"`: the geometric step alone (the official code).
    `"autofreeze"`: the original AutoFreeze system's rule (Liu et al.), by the change of each
    block's summed gradient between intervals. `"plasticity"`: early freezing without a block
    count, the leading blocks whose weights moved least since the start of fit (every 1/16 of an
    epoch unless `freeze_interval` says otherwise). Or a `FreezeRule` of your own. See
    [autofreeze.md](autofreeze.md)."""

    schedule: Mapping[int, int] | Callable[[int], int] | None = None
    """an explicit plan, `{epoch: num_frozen}` (a step function) or `epoch -> num_frozen`;
    overrides `rule` and `alpha`."""

    layers: str | nn.Module | BlockStack | None = None
    """the block container's attribute path relative to the LightningModule
    (`"model.bert.encoder.layer"`), the container, or a `BlockStack`. Default: the module's
    `configure_block_stack()` hook, else discovery."""

    pre: Sequence[str] | None = None
    """attribute paths of the modules that run before the blocks, taken as given. Default: what the
    first training forward runs before the stack (observed once), whatever the registration
    order."""

    freeze_every_n_epochs: int = 1
    """epochs between freeze points; the first is at the start of epoch `n`."""

    min_active: int = 1
    """blocks that are never frozen."""

    freeze_embeddings: bool = True
    """freeze the modules before the stack together with the first block (needed for AutoCache).
    Input embeddings tied to an output head keep training whatever this says, unless `pre` names
    them."""

    freeze_interval: int | float | None = None
    """freeze points inside epochs: an int is every N optimizer steps, a float in (0, 1] that
    fraction of an epoch's optimizer steps (rounded, at least 1). Excludes `schedule` and
    `freeze_every_n_epochs`. See [autofreeze.md](autofreeze.md#freeze-points-inside-epochs)."""

    percentile: float = 50.0
    """`rule="autofreeze"`: the threshold is this percentile of the active blocks' relative
    gradient changes; the blocks before the first block that reaches it freeze. In (0, 100)."""

    anneal: AnnealSpec | None = None
    """smooth freezing (FreezeOut): `"linear"` or `"cosine"` (or a callable `progress in [0, 1) ->
    factor in [0, 1]`) anneals the learning rate of the blocks that freeze at the next point to
    zero over the interval before it (their optimizer update scaled by the curve; the optimizer,
    its groups and the schedulers are untouched). `"schedule"` and `schedule=` anneal before
    their points (the same freezes as without); `"paper"` and `"autofreeze"` anneal the blocks
    they decided on over the next interval and freeze them one interval later. Off, with a
    warning, where it cannot engage (an interval of one optimizer step; several processes under
    `"pipetransformer"`). See [autofreeze.md](autofreeze.md#smooth-freezing-anneal)."""

    def __post_init__(self) -> None:
        if self.anneal is not None:
            anneal_curve(self.anneal)
        object.__setattr__(self, "alpha", validate_alpha(self.alpha))
        check_rule(self.rule)
        object.__setattr__(self, "freeze_interval", validate_interval(self.freeze_interval))
        if self.freeze_interval is not None and self.schedule is not None:
            raise ValueError("freeze_interval sets freeze points inside epochs; schedule is a plan per epoch. Pass one of them.")
        if self.freeze_interval is not None and self.freeze_every_n_epochs != 1:
            raise ValueError("Pass freeze_interval (points inside epochs) or freeze_every_n_epochs, not both.")
        object.__setattr__(self, "percentile", validate_percentile(self.percentile))
        n = self.freeze_every_n_epochs
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"freeze_every_n_epochs must be a positive int, got {n!r}.")
        if isinstance(self.min_active, bool) or not isinstance(self.min_active, int) or self.min_active < 0:
            raise ValueError(f"min_active must be an int >= 0, got {self.min_active!r}.")
        if self.pre is not None:
            object.__setattr__(self, "pre", tuple(self.pre))
        _ = self.explicit_schedule  # a dict plan is checked now

    @functools.cached_property
    def explicit_schedule(self) -> ExplicitSchedule | None:
        """``schedule`` as a plan (None without one)."""
        return ExplicitSchedule(self.schedule) if self.schedule is not None else None

    def interval_for(self, rule: FreezeRule) -> int | float | None:
        """The interval between freeze points inside epochs that ``rule`` runs with (None: at epoch starts).

        A rule meant for points inside epochs (``"plasticity"``) brings its own ``default_interval``
        when none was given; a plan per epoch refuses one."""
        interval = self.freeze_interval
        preferred = getattr(rule, "default_interval", None)
        if preferred is not None and interval is None and self.schedule is None and self.freeze_every_n_epochs == 1:
            interval = validate_interval(preferred)
        if rule.per_epoch and interval is not None:
            raise ValueError(f"The rule {rule.name!r} is a plan per epoch: pass it without freeze_interval.")
        return interval
