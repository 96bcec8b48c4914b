"""AutoFreeze: progressive freezing of a model's leading blocks, as a Lightning callback.

Works alone under single-device and DDP-family strategies (plain progressive freezing: the
frozen prefix runs forward only and leaves DDP's gradient all-reduce), and under a strategy that
follows the freeze points (:class:`~lightning_pipetransformer.freeze.seam.FreezeFollower`:
``strategy="pipetransformer"``), which repartitions the pipeline at each.

The callback is the mechanism; the rule is a policy object
(:class:`~lightning_pipetransformer.freeze.policies.FreezeRule`) that observes each optimizer step
and answers, at a freeze point, how many blocks should be frozen. When things happen (every rank
runs the same code on the same numbers, so decisions agree):

* every optimizer step (``on_before_optimizer_step``: gradients are final, after DDP averaging
  and gradient accumulation, and unscaled under AMP): the rule observes the gradients (the
  statistics of :mod:`lightning_pipetransformer.freeze.statistics`, on the device, no host sync).
* at each freeze point: the rule decides the new frozen count ``F``, capped at
  ``len(stack) - min_active`` and never below the current; the blocks freeze, and the strategy is
  told (DDP's wrapper is rebuilt so frozen parameters leave the gradient buckets; a
  :class:`~lightning_pipetransformer.freeze.seam.FreezeFollower` re-plans). Freeze points are the
  start of every ``freeze_every_n_epochs``-th epoch, or, with ``freeze_interval``, every N
  optimizer steps (an int) or every fraction of an epoch (a float: that share of the first epoch's
  optimizer steps, counted across epochs), checked in ``on_train_batch_start`` of a batch that
  begins an accumulation window, so that a freeze never splits one. A plan per epoch
  (``schedule=``) is asked at every epoch start.
* at the end of every epoch: log ``autofreeze/num_frozen``.

Deciding at epoch *start* (not end) makes resuming exact wherever the checkpoint was written
(at validation end or train-epoch end): the statistics of the finished epoch are part of the
callback state, and the decision for the next epoch is taken after loading it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_pipetransformer.freeze.anneal import AnnealSpec
from lightning_pipetransformer.freeze.anneal_timing import AnnealTiming
from lightning_pipetransformer.freeze.apply import (
    apply_freeze,
    ensure_frozen_eval,
    frozen_parameters,
    tied_outside,
    untrainable_prefix,
)
from lightning_pipetransformer.freeze.call_order import CallOrderWatch, Split, refine
from lightning_pipetransformer.freeze.clock import FreezeClock
from lightning_pipetransformer.freeze.config import AutoFreezeConfig, Rule
from lightning_pipetransformer.freeze.nested_tensor import NestedTensorGuard, guard_nested_tensor
from lightning_pipetransformer.freeze.policies import FreezePoint, FreezeRule, make_rule
from lightning_pipetransformer.freeze.seam import FreezeFollower
from lightning_pipetransformer.stack.declared import block_stack_of
from lightning_pipetransformer.stack.discovery import BlockStack, BlockStackError
from lightning_pipetransformer.terminal import debug_log, wrap
from lightning_pipetransformer.warn_once import WarnOnce

__all__ = ["AutoFreeze"]

def _info(message: str) -> None:
    """Say ``message`` on rank 0, wrapped to the terminal (a 300-column line wraps mid-word otherwise).

    Warnings stay one line each: pytest.warns and warnings filters match them by their text."""
    rank_zero_info(wrap(message))


class AutoFreeze(Callback):
    """Freeze a model's leading Transformer blocks progressively while it trains.

    Args:
        alpha: fraction of the still-active blocks frozen per freeze step, ``0 < alpha < 1``.
            1/3 freezes a 12-block stack as 0, 4, 7, 9, 10, 11, ... over the steps.
        rule: ``"paper"`` (default): the geometric step ``F + alpha (L - F)`` is an upper bound and
            the freeze stops at the active block with the smallest gradient norm over the last
            interval, so a block still learning fast is not frozen just because the schedule says
            so. ``"schedule"``: the geometric step alone, a fixed plan, as the official
            PipeTransformer code ran; no gradient norms are measured. ``"autofreeze"``: the rule of
            the original AutoFreeze system (Liu et al., 2021): per block, the L1 norm of the
            gradient summed over the interval; the blocks before the first one whose norm changed
            by at least the ``percentile``-th percentile of the active blocks' relative changes
            (since the previous interval) freeze. It needs two intervals before its first freeze.
            ``"plasticity"`` (issue 41): early freezing without a block count: the leading blocks whose
            weights moved less than 2/3 of the most-moved active block's since the start of fit
            (relative to their size) freeze once two points in a row agree; it decides every 1/16 of
            an epoch unless ``freeze_interval`` is given (``PlasticityRule(ratio=...)`` for another share).
            Or a rule of your own: an object implementing
            :class:`~lightning_pipetransformer.freeze.policies.FreezeRule` (subclass
            ``FreezeRuleBase`` and override ``decide``). See
            :mod:`lightning_pipetransformer.freeze.rules` and docs/autofreeze.md.
        schedule: an explicit plan, ``{epoch: num_frozen}`` (a step function) or a callable
            ``epoch -> num_frozen``. Overrides ``rule`` and ``alpha``; for reproducible experiments.
        layers: the block container's attribute path relative to the LightningModule (e.g.
            ``"model.bert.encoder.layer"``), the container, or a ``BlockStack``. Default: the module's
            ``configure_block_stack()`` hook if it has one, else automatic discovery.
        pre: attribute paths of the modules that run before the blocks, taken as given. Default:
            what the first training forward runs before the stack (observed once, see
            :mod:`lightning_pipetransformer.stack.execution`), whatever the registration order.
        freeze_every_n_epochs: epochs between freeze points. The first freeze point is the start
            of epoch ``freeze_every_n_epochs``: the first interval always trains the whole model.
        freeze_interval: freeze points inside epochs instead: an int is a number of optimizer
            steps, a float in (0, 1] a fraction of an epoch's optimizer steps (like
            ``val_check_interval``). The first point comes after one interval. A rule meant for points
            inside epochs (``"plasticity"``: 0.0625) brings its own when none is given. With several
            processes under ``strategy="pipetransformer"`` a point that falls inside an epoch is
            applied at the next epoch start, where AutoDP can change the replicas (logged once).
        percentile: the ``"autofreeze"`` rule's threshold (the original's default, 50: the median).
        min_active: blocks that are never frozen. ``0`` lets the whole stack freeze (the head
            after it still trains).
        freeze_embeddings: freeze the modules before the stack (embeddings) together with the
            first block. Keep ``True`` to let AutoCache skip them. Input embeddings tied to an
            output head (GPT-2's ``lm_head``) keep training by default whatever this says: freezing
            them would freeze the head; name them in ``pre=`` to freeze both, or untie the model
            (``tie_word_embeddings=False``) to freeze the embeddings alone. See docs/autofreeze.md.
        anneal: smooth freezing (FreezeOut): ``"linear"`` or ``"cosine"`` (or a callable
            ``progress -> factor``) anneals the learning rate of the blocks that freeze at the next
            point to zero over the interval before it, so the freeze itself changes nothing.
            ``"schedule"`` and explicit schedules know the next ``F`` in advance and anneal in the
            interval before their freeze points (the same freezes as without); ``"paper"`` and
            ``"autofreeze"`` decide at a point as without, anneal the chosen blocks over the next
            interval and freeze them at the point after (one interval later). See
            :mod:`lightning_pipetransformer.freeze.anneal_timing` and docs/autofreeze.md.
    """

    def __init__(
        self,
        alpha: float = 1 / 3,
        rule: Rule | FreezeRule = "paper",
        schedule: Mapping[int, int] | Callable[[int], int] | None = None,
        layers: str | nn.Module | BlockStack | None = None,
        pre: Sequence[str] | None = None,
        freeze_every_n_epochs: int = 1,
        min_active: int = 1,
        freeze_embeddings: bool = True,
        freeze_interval: int | float | None = None,
        percentile: float = 50.0,
        anneal: AnnealSpec | None = None,
    ) -> None:
        super().__init__()
        #: The arguments, checked once (:class:`~lightning_pipetransformer.freeze.config.AutoFreezeConfig`).
        self.config = config = AutoFreezeConfig(
            alpha=alpha, rule=rule, schedule=schedule, layers=layers, pre=pre, freeze_every_n_epochs=freeze_every_n_epochs,
            min_active=min_active, freeze_embeddings=freeze_embeddings, freeze_interval=freeze_interval, percentile=percentile,
            anneal=anneal,
        )  # fmt: skip
        #: The policy that decides at each freeze point (:mod:`lightning_pipetransformer.freeze.policies`).
        self.freeze_rule: FreezeRule = make_rule(config.rule, config.alpha, config.percentile, config.explicit_schedule)
        #: When the freeze points fall (:mod:`lightning_pipetransformer.freeze.clock`).
        self.clock = FreezeClock(config.interval_for(self.freeze_rule), config.freeze_every_n_epochs, self.freeze_rule.per_epoch)
        self.rule: str = rule if isinstance(rule, str) else rule.name
        self.pre = list(config.pre) if config.pre is not None else None
        #: Whether the modules before the stack freeze with the first block: as asked, unless tied to the head.
        self.freeze_embeddings = config.freeze_embeddings
        #: Why the embeddings keep training although freeze_embeddings=True was asked (tied to the head); None otherwise.
        self.embeddings_kept_training: str | None = None
        # Smooth freezing's timing; its annealer is built at setup, where it can engage (see _setup_anneal).
        self._anneal = (
            AnnealTiming(anneal, self.freeze_rule.plans_ahead, warn=rank_zero_warn, info=_info) if anneal is not None else None
        )
        self._order = CallOrderWatch()
        self._nested_guard: NestedTensorGuard | None = None  # nn.TransformerEncoder: nested tensors in eval mode only
        self._said = WarnOnce(lambda message, stacklevel: _info(message))

        self.stack: BlockStack | None = None
        self.num_frozen = 0
        #: Whether the modules before the stack count as frozen (AutoFreeze froze them, or they were before fit).
        self._pre_frozen = False
        self._untrainable = 0  # leading blocks that had no trainable parameter when the stack was found
        self._module: pl.LightningModule | None = None  # the module of the current fit (lazily built models)
        self.history: list[tuple[int, int]] = []  # (epoch, num_frozen) at each freeze event
        #: (global step, num_frozen) at each freeze event.
        self.step_history: list[tuple[int, int]] = []
        self._last_rate: float | None = None  # the learning rate of the last optimizer step (FreezePoint)

    @property
    def freeze_interval(self) -> int | float | None:
        """The interval between freeze points inside epochs in force (a rule's own when none was given), or None."""
        return self.clock.interval

    # ------------------------------------------------------------------ set-up and checks

    @property
    def num_blocks(self) -> int:
        return len(self.stack) if self.stack is not None else 0

    @property
    def max_frozen(self) -> int:
        return self.num_blocks - self.config.min_active

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise ValueError(
                "AutoFreeze supports automatic optimization only: remove `self.automatic_optimization = False` "
                "or freeze by hand in your training_step."
            )
        self._check_strategy(trainer)
        self._setup_anneal(trainer)
        self._module = pl_module
        try:
            self.find_stack(pl_module, trainer)
        except BlockStackError:
            # Lightning calls the callbacks' setup before the module's own setup() and configure_model(),
            # where large models are built: look again once they ran (load_state_dict, the strategy's
            # setup, on_fit_start), and fail then if it is still missing.
            if not _builds_lazily(pl_module):
                raise

    def find_stack(self, pl_module: pl.LightningModule, trainer: pl.Trainer | None = None) -> BlockStack:
        """The block stack this callback freezes, found (and checked) the first time it is asked for.

        Called at ``setup`` and, for a model built in ``setup()`` / ``configure_model()``, again once
        it exists (by the pipeline strategy's setup, :meth:`load_state_dict` or ``on_fit_start``).
        Leading blocks without a trainable parameter (frozen before fit, or PEFT adapters on the upper
        layers only) count as frozen from the start: AutoFreeze treats them as blocks it froze (eval
        mode) and the strategy's plan packs and caches past them.
        """
        if self.stack is not None:
            return self.stack
        stack = block_stack_of(pl_module, self.config.layers, self.pre)
        if self.config.min_active > len(stack):
            raise ValueError(
                f"min_active={self.config.min_active} exceeds the {len(stack)} blocks of {stack.path}; use at most {len(stack)}."
            )
        self.stack = stack
        if self.config.min_active == 0 and not self._trains_outside_stack(pl_module):
            self.stack = None
            raise ValueError(
                "min_active=0 would leave nothing to train: every trainable parameter is in the block stack "
                "(or before it). Use min_active >= 1."
            )
        epochs = trainer.max_epochs if trainer is not None and trainer.max_epochs is not None and trainer.max_epochs > 0 else None
        self.freeze_rule.check(self.max_frozen, epochs)
        # One short line (module lists cut to a few names) for the console; the full lists at DEBUG.
        _info(f"AutoFreeze: block stack {stack.describe(limit=3)}; {self._rule_text()}.")
        debug_log.debug("AutoFreeze: block stack %s.", stack.describe())
        untrainable = self._untrainable = untrainable_prefix(stack)
        if untrainable > self.num_frozen:
            _info(
                f"AutoFreeze: blocks 0..{untrainable - 1} have no trainable parameter: counted as frozen from the start "
                "(eval mode, as blocks AutoFreeze freezes)."
            )
            self.num_frozen = untrainable
        self._check_ties(pl_module)
        if self.freeze_embeddings and self.num_frozen and not _pre_trainable(stack):
            self._pre_frozen = True  # frozen before fit (PEFT): treated as AutoFreeze would
        if self.num_frozen:  # a second fit() with the same callback, or blocks frozen before fit
            apply_freeze(stack, self.num_frozen, self._pre_applies())
        return stack

    def _check_ties(self, pl_module: nn.Module) -> None:
        """Input embeddings tied to an output head keep training unless ``pre=`` names them (see ``freeze_embeddings``)."""
        assert self.stack is not None
        said = self.embeddings_kept_training
        self.freeze_embeddings, self.embeddings_kept_training = self.config.freeze_embeddings, None
        if not self.freeze_embeddings:
            return
        tied = tied_outside(self.stack, pl_module)
        if not tied:
            return
        listed = ", ".join(f"{a} is {b}" for a, b in tied[:3])
        if self.pre is not None:  # asked for by name: freeze them, and the head with them
            rank_zero_warn(
                f"AutoFreeze(pre=[...]) freezes the embeddings with the first block, but they are tied to a module after "
                f"the stack ({listed}): that output head stops training too, as asked. To keep the head training, leave "
                "the tied module out of pre=; to freeze the embeddings alone, untie the weights (tie_word_embeddings=False)."
            )
            return
        self.freeze_embeddings = False
        self.embeddings_kept_training = (
            f"the input embeddings are tied to the output head ({listed}): freezing them would freeze the head, so they "
            "keep training, the frozen blocks still run backward for them (without weight gradients of their own) and "
            "AutoCache stands aside. For the cache, untie them (tie_word_embeddings=False: the head gets its own copy of "
            "the weights, which then trains alone while the embeddings freeze with the first block); to freeze the head "
            "with the embeddings, name them in AutoFreeze(pre=[...])"
        )
        if self.embeddings_kept_training != said:  # once (checked again when the call order refines pre)
            _info(f"AutoFreeze: {self.embeddings_kept_training}.")

    def _pre_applies(self) -> bool:
        """Whether to freeze ``pre`` now: it counts as frozen, and it is known (observed or declared) what runs before."""
        return self._pre_frozen and self.stack is not None and not self.stack.provisional

    # ------------------------------------------------------------------ what runs before the stack (observed, freeze/call_order.py)

    def _finish_observation(self, pl_module: pl.LightningModule) -> None:
        """After the forward (before backward and any optimizer step): put ``pre``/``post`` where they ran."""
        split = self._order.finish(self.stack) if self.stack is not None else None
        if split is not None:
            self._refine(pl_module, split)

    def _refine(self, pl_module: nn.Module, split: Split) -> None:
        assert self.stack is not None
        refine(self.stack, split, _info)
        self._check_ties(pl_module)
        if not self.freeze_embeddings:
            self._pre_frozen = False
        if self.num_frozen and self._pre_applies():
            # A freeze decided before the first forward (an explicit schedule at epoch 0, a restored state)
            # froze the blocks; what runs before them freezes now, before any gradient reaches it.
            apply_freeze(self.stack, self.num_frozen, True)

    def _rule_text(self) -> str:
        anneal = self._anneal.describe() if self._anneal is not None else ""
        if self.freeze_rule.per_epoch:
            return self.freeze_rule.name + anneal
        c = self.config
        return f"rule '{self.freeze_rule.name}', alpha={c.alpha:.3g}, {self.clock.describe()}, min_active={c.min_active}{anneal}"

    def _trains_outside_stack(self, pl_module: pl.LightningModule) -> bool:
        assert self.stack is not None
        covered = {id(p) for p in frozen_parameters(self.stack, self.num_blocks, self.freeze_embeddings)}
        return any(p.requires_grad and id(p) not in covered for p in pl_module.parameters())

    @staticmethod
    def _check_strategy(trainer: pl.Trainer) -> None:
        strategy = trainer.strategy
        if _follower(trainer) is not None or isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
            return
        raise ValueError(
            f"AutoFreeze supports single-device, DDP-family and 'pipetransformer' strategies, not "
            f"{type(strategy).__name__}: sharded or wrapped parameters are not reached by freezing with "
            "requires_grad. Use strategy='ddp' or strategy='pipetransformer'."
        )

    # ------------------------------------------------------------------ the loop

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.stack is None:  # built in setup() / configure_model(), and no strategy asked yet
            self.find_stack(pl_module, trainer)
        if self._nested_guard is None and self.stack is not None:  # before the sanity check's validation too
            self._nested_guard = guard_nested_tensor(pl_module, self.stack)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._finish_observation(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._finish_observation(pl_module)  # a step that skipped backward (training_step returned None)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.clock.start(trainer.global_step, trainer.num_training_batches, trainer.accumulate_grad_batches)
        if self.clock.within_epochs:
            self._anneal_ahead(trainer, trainer.global_step)
        self._warn_if_no_point_fits(trainer)

    def _warn_if_no_point_fits(self, trainer: pl.Trainer) -> None:
        """Once, before training: a run too short for any freeze decision freezes nothing, and says so."""
        if self.freeze_rule.per_epoch or self.num_frozen >= self.max_frozen:
            return
        lag = self._anneal is not None and self._anneal.lags  # anneal: a gradient rule's freeze comes one point after its decision
        rule = f"rule='{self.freeze_rule.name}'" + (" with anneal (each freeze one point after its decision)" if lag else "")
        total = trainer.estimated_stepping_batches if self.clock.within_epochs else None
        why = self.clock.too_few_points(self.freeze_rule.points_before_first_freeze + lag, rule, total, trainer.max_epochs)
        if why is not None:
            rank_zero_warn(why)

    def _follow_thaws(self) -> None:
        """Blocks it froze that other code made trainable again (a callback's ``requires_grad_(True)``, Lightning's
        ``BaseFinetuning.unfreeze_and_add_param_group``): counted as active again, so that AutoFreeze neither keeps
        them in eval mode nor ignores their gradients (its rule may freeze them again at a later point), and a
        replica that takes its state (AutoDP) does not freeze them back."""
        if self.stack is None or not self.num_frozen:
            return
        frozen_now = untrainable_prefix(self.stack)
        if frozen_now < self.num_frozen:
            _info(
                f"AutoFreeze: blocks {frozen_now}..{self.num_frozen - 1} train again (other code unfroze them): counted as "
                f"active from here on ({frozen_now}/{self.num_blocks} frozen)."
            )
            self.num_frozen = frozen_now

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._follow_thaws()
        changed = 0
        if not self.clock.within_epochs:
            if self._decides_here(trainer):
                changed = self._at_point(trainer, self._epoch_index(trainer.current_epoch), epoch_level=True)
        elif self._points_wait_for_epochs(trainer):
            index = self.clock.step_point(trainer.global_step)
            if index is not None and self._decides_here(trainer):
                changed = self._at_point(trainer, index, epoch_level=False)
        if self.stack is not None:
            ensure_frozen_eval(self.stack, self.num_frozen, self._pre_applies())
        # Every rank, every epoch start: under AutoDP this is where the replicas change, together.
        self._tell_strategy(trainer, epoch_start=True, changed=changed)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if (
            self.clock.within_epochs
            and self.clock.opens_window(batch_idx, trainer.accumulate_grad_batches)  # never inside an accumulation window
            and not self._points_wait_for_epochs(trainer)
        ):
            index = self.clock.step_point(trainer.global_step)
            if index is not None:
                changed = self._at_point(trainer, index, epoch_level=False) if self._decides_here(trainer) else 0
                self._tell_strategy(trainer, epoch_start=False, changed=changed)  # one process: the plan follows inside the epoch
        # A user's `model.train()` (e.g. in on_validation_model_train) would re-enable dropout in
        # frozen blocks; one attribute read per frozen module puts that right.
        self._follow_thaws()
        if self.stack is not None and self.num_frozen:
            ensure_frozen_eval(self.stack, self.num_frozen, self._pre_applies())
        if self.stack is not None:
            self._order.start(pl_module, self.stack)
        if self._anneal is not None and self.stack is not None:  # which optimizer step comes next: its update's factor
            self._anneal.at_step(self.stack, self.freeze_embeddings, self._pre_frozen, trainer.global_step, trainer.optimizers)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.stack is not None:
            self.freeze_rule.observe(self.stack, self.num_frozen)
        self._last_rate = _rate_of(optimizer)  # a Python float of the optimizer's first group: no device sync

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.log("autofreeze/num_frozen", float(self.num_frozen), on_step=False, on_epoch=True, sync_dist=True)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._order.remove()
        if self._nested_guard is not None:
            self._nested_guard.remove()
            self._nested_guard = None
        if self._anneal is not None:
            self._anneal.detach()

    # ------------------------------------------------------------------ freeze points

    def _epoch_index(self, epoch: int) -> int | None:
        """The index of the freeze point at the start of ``epoch`` (None: no point there, or no stack yet)."""
        return self.clock.epoch_point(epoch) if self.stack is not None else None

    def _point(self, index: int, epoch: int, learning_rate: float | None = None) -> FreezePoint:
        return FreezePoint(
            index, epoch, self.num_frozen, self.num_blocks, self.max_frozen, self._untrainable, learning_rate, self._last_rate
        )

    def _decides_here(self, trainer: pl.Trainer) -> bool:
        """AutoDP: global rank 0 alone decides (an idle rank has no gradient statistics, and stale
        ones from rank 0's half-finished interval would decide otherwise). Its decision and state
        reach the other ranks with the plan, in the strategy's transition right after the point
        (``on_freeze_point``), and :meth:`load_state_dict` freezes the same blocks there."""
        follower = _follower(trainer)
        return follower is None or follower.autofreeze_decides_here

    def _at_point(self, trainer: pl.Trainer, index: int | None, epoch_level: bool) -> int:
        """At freeze point ``index`` on the deciding rank (None: an epoch start that is no point,
        where smooth freezing still moves on): freeze what annealed to zero, decide, freeze or
        anneal first, and anneal ahead for the next point. Returns how many parameters froze."""
        step, epoch = trainer.global_step, trainer.current_epoch
        changed = 0
        annealed = self._anneal.due(step) if self._anneal is not None else None
        if annealed is not None and annealed > self.num_frozen:
            changed += self._apply(annealed, epoch, step)
        target = self._decide(index, epoch, _learning_rate(trainer)) if index is not None else self.num_frozen
        if target > self.num_frozen and not self._anneal_lagging(trainer, target, step, epoch if epoch_level else None):
            changed += self._apply(target, epoch, step)
        self._anneal_ahead(trainer, step, epoch if epoch_level else None)
        return changed

    def _decide(self, index: int, epoch: int, learning_rate: float | None = None) -> int:
        """The rule's answer at point ``index``, kept between the blocks frozen now and ``max_frozen``:
        blocks never thaw. The point is built here, after any freeze earlier at the same point."""
        if self.stack is None:
            return self.num_frozen
        return max(self.num_frozen, min(self.freeze_rule.decide(self._point(index, epoch, learning_rate)), self.max_frozen))

    def _points_wait_for_epochs(self, trainer: pl.Trainer) -> bool:
        """Several processes under the pipeline strategy: AutoDP changes replicas at epoch starts only."""
        waits = _follower(trainer) is not None and trainer.world_size > 1
        if waits:
            self._said(
                "deferred", "AutoFreeze: with several processes under strategy='pipetransformer', freeze points inside an epoch "
                "are applied at the next epoch start, where AutoDP can change the number of replicas.",
            )
        return waits

    # ------------------------------------------------------------------ applying a freeze

    def _apply(self, target: int, epoch: int, step: int) -> int:
        """Freeze ``target`` leading blocks, record and log the event; how many parameters froze."""
        assert self.stack is not None
        before = self.num_frozen
        self._pre_frozen = self.freeze_embeddings
        changed = apply_freeze(self.stack, target, self._pre_applies())
        self.num_frozen = target
        self.history.append((int(epoch), target))
        self.step_history.append((int(step), target))
        where = self.clock.where(epoch, step)
        blocks = f"block {before}" if target - before == 1 else f"blocks {before}..{target - 1}"
        _info(
            f"AutoFreeze: {where}: froze {blocks} "
            f"({target}/{self.num_blocks} frozen{', embeddings too' if self.freeze_embeddings else ''})."
        )
        return changed

    def _tell_strategy(self, trainer: pl.Trainer, epoch_start: bool, changed: int) -> None:
        """After a freeze point: a :class:`FreezeFollower` brings its plan in line with :attr:`num_frozen`
        (on every rank, decided or not); under DDP the wrapper is rebuilt if a parameter froze."""
        strategy = trainer.strategy
        follower = _follower(trainer)
        if follower is not None:
            follower.on_freeze_point(trainer, self, epoch_start)
        elif changed and isinstance(strategy, DDPStrategy) and isinstance(strategy.model, DistributedDataParallel):
            # DDP's reducer fixed its gradient buckets when it was built; parameters frozen
            # afterwards would still be all-reduced (or raise "Expected to have finished
            # reduction"). Re-wrapping drops them (Lightning issue #20340).
            strategy.model = strategy.lightning_module
            strategy.configure_ddp()

    # ------------------------------------------------------------------ smooth freezing (anneal=..., freeze/anneal_timing.py)

    def _setup_anneal(self, trainer: pl.Trainer) -> None:
        """Engage smooth freezing for this fit, or say once why it cannot (several AutoDP processes)."""
        if self._anneal is not None:
            self._anneal.setup(_follower(trainer) is not None and trainer.world_size > 1)

    def _following_step(self, trainer: pl.Trainer, step: int, epoch: int | None) -> int | None:
        """The optimizer step of the next freeze point after the one at ``step`` (None: unknown)."""
        try:
            return self.clock.following_step(step, epoch, trainer.num_training_batches, trainer.accumulate_grad_batches)
        except ValueError:
            assert self._anneal is not None
            self._anneal.no_length()
            return None

    def _begin_anneal(self, target: int, step: int, end: int | None) -> bool:
        assert self._anneal is not None and self.stack is not None
        return self._anneal.begin(self.stack, self.freeze_embeddings, self._pre_frozen, self.num_frozen, target, step, end)

    def _anneal_lagging(self, trainer: pl.Trainer, target: int, step: int, epoch: int | None) -> bool:
        """A rule that decides from gradients: this point's decision anneals over the next interval
        and freezes at the next point. True when it does (nothing freezes now)."""
        if self._anneal is None or not self._anneal.lags:
            return False
        return self._begin_anneal(target, step, self._following_step(trainer, step, epoch))

    def _anneal_ahead(self, trainer: pl.Trainer, step: int, epoch: int | None = None) -> None:
        """A rule that knows its next decision: anneal that decision's blocks over the interval before its point."""
        if self._anneal is None or self._anneal.annealer is None or self._anneal.lags or self.stack is None:
            return
        following = self.clock.following(epoch, trainer.current_epoch, trainer.max_epochs)
        target = self.freeze_rule.ahead(self._point(*following)) if following is not None else None
        if target is not None and min(target, self.max_frozen) > self.num_frozen:
            self._begin_anneal(min(target, self.max_frozen), step, self._following_step(trainer, step, epoch))

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        return self._state(full=True)

    def decision_state(self) -> dict[str, Any]:
        """What every rank needs of rank 0's decisions (what AutoDP's agree message carries): the
        state without the rule's bulk statistics (the ``"autofreeze"`` rule's summed gradients, a
        copy of the active blocks' size: ~340 MB for BERT-base), which only the deciding rank reads.
        :meth:`load_state_dict` takes it; the receiving rank's own statistics restart empty."""
        return self._state(full=False)

    def _state(self, full: bool) -> dict[str, Any]:
        known = self.stack is not None and not self.stack.provisional
        return {
            "num_frozen": self.num_frozen,
            "num_blocks": self.num_blocks,
            "history": [list(h) for h in self.history],
            "step_history": [list(h) for h in self.step_history],
            **self.clock.state_dict(),  # decided_epoch, next_point, points
            "pre_frozen": self._pre_frozen,
            "last_rate": self._last_rate,
            # anneal: the interval that anneals now (blocks, steps); None without one.
            "anneal": self._anneal.state_dict() if self._anneal is not None else None,
            # What runs before and after the stack, once observed: a resumed run freezes the same modules.
            "pre": [p for p, _ in self.stack.pre] if known and self.stack is not None else None,
            "post": [p for p, _ in self.stack.post] if known and self.stack is not None else None,
            # The rule's state between points, as flat keys ("norm_sum"/"norm_steps", "previous_l1"/"grad_sums").
            **self.freeze_rule.state_dict(full),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if self.stack is None and self._module is not None:
            # Restored after the module's setup() and configure_model(): a lazily built model exists now.
            self.find_stack(self._module)
        if self.stack is not None and state_dict["num_blocks"] not in (0, self.num_blocks):
            raise ValueError(
                f"The checkpoint's AutoFreeze state is for {state_dict['num_blocks']} blocks, this model's stack "
                f"has {self.num_blocks}."
            )
        self.num_frozen = int(state_dict["num_frozen"])
        self.history = [(int(e), int(f)) for e, f in state_dict.get("history", [])]
        self.step_history = [(int(a), int(b)) for a, b in state_dict.get("step_history", [])]
        self.clock.load_state_dict(state_dict)
        self._last_rate = state_dict.get("last_rate")
        self._pre_frozen = bool(state_dict.get("pre_frozen", self.freeze_embeddings and self.num_frozen > 0))
        self.freeze_rule.load_state_dict(state_dict, self.stack)
        if self._anneal is not None:
            self._anneal.load_state_dict(state_dict.get("anneal"))
        order = state_dict.get("pre"), state_dict.get("post")
        if self.stack is not None and self.stack.provisional and order[0] is not None and self._module is not None:
            root = self._module
            self._refine(root, ([(p, root.get_submodule(p)) for p in order[0]], [(p, root.get_submodule(p)) for p in order[1] or []]))
        if self.stack is not None and self.num_frozen:
            # Callbacks are restored before the strategy wraps the model: freeze now so DDP's
            # first wrapper already leaves the frozen prefix out.
            apply_freeze(self.stack, self.num_frozen, self._pre_applies())

    def most_frozen(self, num_epochs: int | None) -> int:
        """The most blocks this run will freeze, as far as known before it: ``max_frozen``, or an
        explicit plan's largest value over ``num_epochs`` epochs (never below the blocks frozen now)."""
        most = self.max_frozen
        schedule = self.config.explicit_schedule
        if schedule is not None and num_epochs is not None and num_epochs > 0:
            most = min(most, max(schedule(e) for e in range(num_epochs)))
        return max(most, self.num_frozen)


def _follower(trainer: pl.Trainer) -> FreezeFollower | None:
    """The strategy, if it follows the freeze points itself (the pipeline strategy)."""
    strategy = trainer.strategy
    return strategy if isinstance(strategy, FreezeFollower) else None


def _learning_rate(trainer: pl.Trainer) -> float | None:
    """The learning rate the next optimizer step will use (the first optimizer's first group), for the rules that
    read it (``"plasticity"`` waits for the warm-up to end); None without an optimizer."""
    optimizers = getattr(trainer, "optimizers", None) or []
    return _rate_of(optimizers[0]) if optimizers else None


def _rate_of(optimizer: Any) -> float | None:
    """The ``lr`` of an optimizer's first parameter group (Lightning's wrapper passes ``param_groups`` through)."""
    groups = getattr(optimizer, "param_groups", None)
    value = groups[0].get("lr") if groups else None
    return float(value) if isinstance(value, (int, float)) or torch.is_tensor(value) else None


def _builds_lazily(pl_module: pl.LightningModule) -> bool:
    """Whether the module builds (part of) its model after the callbacks' setup: in setup() or configure_model()."""
    return any(is_overridden(hook, pl_module) for hook in ("setup", "configure_model", "configure_sharded_model"))


def _pre_trainable(stack: BlockStack) -> bool:
    """Whether a parameter before the stack (embeddings, a cls token) still requires grad."""
    return any(p.requires_grad for _, m in stack.pre for p in m.parameters()) or any(p.requires_grad for _, p in stack.pre_params)
