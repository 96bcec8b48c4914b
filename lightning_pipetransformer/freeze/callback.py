"""AutoFreeze: progressive freezing of a model's leading blocks, as a Lightning callback.

Works alone under single-device and DDP-family strategies (plain progressive freezing: the
frozen prefix runs forward only and leaves DDP's gradient all-reduce), and under
``strategy="pipetransformer"``, which it signals to repartition the pipeline.

When things happen (every rank runs the same code on the same numbers, so decisions agree):

* every optimizer step (``on_before_optimizer_step``: gradients are final, after DDP averaging
  and gradient accumulation, and unscaled under AMP): the ``"paper"`` rule adds each active
  block's gradient norm to an on-device running sum, the ``"autofreeze"`` rule the gradients
  themselves to per-block sums; a step with non-finite gradients (AMP skipped it) adds nothing.
  No host sync per step.
* at each freeze point: decide the new frozen count ``F``, freeze, and tell the strategy (DDP's
  wrapper is rebuilt so frozen parameters leave the gradient buckets; the pipeline strategy
  repartitions). Freeze points are the start of every ``freeze_every_n_epochs``-th epoch, or,
  with ``freeze_interval``, every N optimizer steps (an int) or every fraction of an epoch (a
  float: that share of the first epoch's optimizer steps, counted across epochs), checked in
  ``on_train_batch_start`` of a batch that begins an accumulation window, so that a freeze never
  splits one.
* at the end of every epoch: log ``autofreeze/num_frozen``.

Deciding at epoch *start* (not end) makes resuming exact wherever the checkpoint was written
(at validation end or train-epoch end): the gradient sums of the finished epoch are part of the
callback state, and the decision for the next epoch is taken after loading it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_pipetransformer.freeze.anneal import Annealer, AnnealPlan, AnnealSpec, anneal_curve
from lightning_pipetransformer.freeze.apply import (
    apply_freeze,
    ensure_frozen_eval,
    frozen_parameters,
    tied_outside,
    untrainable_prefix,
)
from lightning_pipetransformer.freeze.rules import (
    ExplicitSchedule,
    autofreeze_num_frozen,
    geometric_num_frozen,
    interval_steps,
    paper_num_frozen,
    validate_alpha,
    validate_interval,
)
from lightning_pipetransformer.stack.declared import block_stack_of
from lightning_pipetransformer.stack.discovery import BlockStack, BlockStackError
from lightning_pipetransformer.stack.execution import CallOrderObserver, split_by_order

__all__ = ["AutoFreeze"]

Rule = Literal["paper", "schedule", "autofreeze"]

#: A strategy that implements this method is told at every freeze point, on every rank, decided or not
#: (the pipeline strategy): ``hook(trainer, autofreeze, epoch_start)``. It runs inside AutoFreeze's own
#: hook, right after the decision, so its place does not depend on the order of ``trainer.callbacks``.
STRATEGY_HOOK = "on_freeze_point"


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
            See :mod:`lightning_pipetransformer.freeze.rules`.
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
            ``val_check_interval``). The first point comes after one interval. With several
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
            :mod:`lightning_pipetransformer.freeze.anneal` and docs/autofreeze.md.
    """

    def __init__(
        self,
        alpha: float = 1 / 3,
        rule: Rule = "paper",
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
        if anneal is not None:
            anneal_curve(anneal)  # refused at construction
        self.anneal = anneal
        self._annealer: Annealer | None = None  # built at setup, where it can engage (see _setup_anneal)
        self._anneal_told: set[str] = set()
        self.alpha = validate_alpha(alpha)
        if rule not in ("paper", "schedule", "autofreeze"):
            raise ValueError(f"rule must be 'paper', 'schedule' or 'autofreeze', got {rule!r}.")
        self.freeze_interval = validate_interval(freeze_interval)
        if self.freeze_interval is not None and schedule is not None:
            raise ValueError(
                "freeze_interval sets freeze points inside epochs; schedule is a plan per epoch. Pass one of them."
            )
        if self.freeze_interval is not None and freeze_every_n_epochs != 1:
            raise ValueError("Pass freeze_interval (points inside epochs) or freeze_every_n_epochs, not both.")
        if not 0.0 < float(percentile) < 100.0:
            raise ValueError(f"percentile must be in (0, 100) (the original AutoFreeze uses 50), got {percentile!r}.")
        self.percentile = float(percentile)
        if isinstance(freeze_every_n_epochs, bool) or not isinstance(freeze_every_n_epochs, int) or freeze_every_n_epochs < 1:
            raise ValueError(f"freeze_every_n_epochs must be a positive int, got {freeze_every_n_epochs!r}.")
        if isinstance(min_active, bool) or not isinstance(min_active, int) or min_active < 0:
            raise ValueError(f"min_active must be an int >= 0, got {min_active!r}.")
        self.rule: Rule = rule
        self.schedule = ExplicitSchedule(schedule) if schedule is not None else None
        self.layers = layers
        self.pre = list(pre) if pre is not None else None
        self.freeze_every_n_epochs = freeze_every_n_epochs
        self.min_active = min_active
        self.freeze_embeddings = freeze_embeddings
        self._asked_embeddings = freeze_embeddings
        #: Why the embeddings keep training although freeze_embeddings=True was asked (tied to the head); None otherwise.
        self.embeddings_kept_training: str | None = None
        self._observer: CallOrderObserver | None = None

        self.stack: BlockStack | None = None
        self.num_frozen = 0
        #: Whether the modules before the stack count as frozen (AutoFreeze froze them, or they were before fit).
        self._pre_frozen = False
        self._untrainable = 0  # leading blocks that had no trainable parameter when the stack was found
        self._module: pl.LightningModule | None = None  # the module of the current fit (lazily built models)
        self.history: list[tuple[int, int]] = []  # (epoch, num_frozen) at each freeze event
        #: (global step, num_frozen) at each freeze event.
        self.step_history: list[tuple[int, int]] = []
        self._decided_epoch = 0  # the last epoch whose start already took its freeze decision
        self._norm_sum: torch.Tensor | None = None  # per block, summed over optimizer steps
        self._norm_steps: int | torch.Tensor = 0  # finite optimizer steps summed (a device tensor while training)
        self._restored_norms: list[float] | None = None
        # freeze_interval: the global step of the next freeze point, and how many points have passed.
        self._next_point: int | None = None
        self._points = 0
        self._interval_steps: int | None = None
        self._deferred_told = False
        # rule="autofreeze": per block, the gradient summed over the interval, and the previous
        # interval's L1 norms.
        self._grad_sums: list[list[torch.Tensor]] | None = None
        self._previous_l1: list[float] | None = None

    # ------------------------------------------------------------------ set-up and checks

    @property
    def num_blocks(self) -> int:
        return len(self.stack) if self.stack is not None else 0

    @property
    def max_frozen(self) -> int:
        return self.num_blocks - self.min_active

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
        stack = block_stack_of(pl_module, self.layers, self.pre)
        if self.min_active > len(stack):
            raise ValueError(
                f"min_active={self.min_active} exceeds the {len(stack)} blocks of {stack.path}; use at most {len(stack)}."
            )
        self.stack = stack
        if self.min_active == 0 and not self._trains_outside_stack(pl_module):
            self.stack = None
            raise ValueError(
                "min_active=0 would leave nothing to train: every trainable parameter is in the block stack "
                "(or before it). Use min_active >= 1."
            )
        if self.schedule is not None:
            epochs = trainer.max_epochs if trainer is not None and trainer.max_epochs is not None and trainer.max_epochs > 0 else None
            self.schedule.validate(self.max_frozen, epochs)
        rank_zero_info(f"AutoFreeze: block stack {stack.describe()}; {self._rule_text()}.")
        untrainable = self._untrainable = untrainable_prefix(stack)
        if untrainable > self.num_frozen:
            rank_zero_info(
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
        self.freeze_embeddings, self.embeddings_kept_training = self._asked_embeddings, None
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
            rank_zero_info(f"AutoFreeze: {self.embeddings_kept_training}.")

    def _pre_applies(self) -> bool:
        """Whether to freeze ``pre`` now: it counts as frozen, and it is known (observed or declared) what runs before."""
        return self._pre_frozen and self.stack is not None and not self.stack.provisional

    # ------------------------------------------------------------------ what runs before the stack (observed)

    def _observe_order(self, pl_module: pl.LightningModule) -> None:
        """At a training batch start: watch this forward's call order, while ``pre``/``post`` are provisional."""
        if self.stack is not None and self.stack.provisional and self._observer is None:
            self._observer = CallOrderObserver(pl_module, self.stack)

    def _finish_observation(self, pl_module: pl.LightningModule) -> None:
        """After the forward (before backward and any optimizer step): put ``pre``/``post`` where they ran.

        A forward that ran no block (an idle AutoDP rank's stand-in step) tells nothing: watch the next one.
        """
        observer = self._observer
        if observer is None or self.stack is None:
            return
        order = observer.finish()
        self._observer = None
        if not self.stack.provisional:  # the order arrived meanwhile (an AutoDP rank: with rank 0's state)
            return
        if not order.saw_stack:
            self._observer = CallOrderObserver(pl_module, self.stack)
            return
        before = [p for p, _ in self.stack.pre]
        try:
            pre, post = split_by_order(self.stack, order)
        except BlockStackError as err:
            raise BlockStackError(f"AutoFreeze: {err}") from None
        self._refine(pl_module, pre, post, before)

    def _refine(self, pl_module: nn.Module, pre: list, post: list, before: list[str]) -> None:
        assert self.stack is not None
        self.stack.refine(pre, post)
        moved_in = [p for p, _ in pre if p not in before]
        moved_out = [p for p in before if p not in {q for q, _ in pre}]
        if moved_in or moved_out:
            rank_zero_info(
                "AutoFreeze: from the model's call order, "
                + "; ".join(
                    ([f"{', '.join(moved_out)} run(s) after the block stack (not frozen with the embeddings)"] if moved_out else [])
                    + ([f"{', '.join(moved_in)} run(s) before it (frozen with the embeddings)"] if moved_in else [])
                )
                + f". Before the stack: {', '.join(p for p, _ in pre) or 'nothing'}."
            )
        self._check_ties(pl_module)
        if not self.freeze_embeddings:
            self._pre_frozen = False
        if self.num_frozen and self._pre_applies():
            # A freeze decided before the first forward (an explicit schedule at epoch 0, a restored state)
            # froze the blocks; what runs before them freezes now, before any gradient reaches it.
            apply_freeze(self.stack, self.num_frozen, True)

    def _rule_text(self) -> str:
        if self.schedule is not None:
            return "explicit schedule" + self._anneal_text()
        every = (
            f"every {self.freeze_interval} optimizer step(s)" if isinstance(self.freeze_interval, int)
            else f"every {self.freeze_interval:g} of an epoch" if self.freeze_interval is not None
            else f"every {self.freeze_every_n_epochs} epoch(s)"
        )
        return f"rule '{self.rule}', alpha={self.alpha:.3g}, {every}, min_active={self.min_active}{self._anneal_text()}"

    def _trains_outside_stack(self, pl_module: pl.LightningModule) -> bool:
        assert self.stack is not None
        covered = {id(p) for p in frozen_parameters(self.stack, self.num_blocks, self.freeze_embeddings)}
        return any(p.requires_grad and id(p) not in covered for p in pl_module.parameters())

    @staticmethod
    def _check_strategy(trainer: pl.Trainer) -> None:
        strategy = trainer.strategy
        if callable(getattr(strategy, STRATEGY_HOOK, None)):
            return
        if isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
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

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._finish_observation(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._finish_observation(pl_module)  # a step that skipped backward (training_step returned None)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.freeze_interval is not None:
            self._interval_steps = interval_steps(self.freeze_interval, _steps_per_epoch(trainer))
            if self._next_point is None:  # a fresh run; a resumed one restored its next point
                self._next_point = trainer.global_step + self._interval_steps
            self._anneal_ahead(trainer, trainer.global_step)
        self._warn_if_no_point_fits(trainer)

    def _warn_if_no_point_fits(self, trainer: pl.Trainer) -> None:
        """Once, before training: a run too short for any freeze decision freezes nothing, and says so."""
        if self.schedule is not None or self.num_frozen >= self.max_frozen:
            return
        needed = 2 if self.rule == "autofreeze" else 1  # the autofreeze rule compares two intervals
        lag = self._anneal_lags()  # anneal: a gradient rule's freeze comes one point after its decision
        needed += lag
        if self.freeze_interval is not None:
            total = trainer.estimated_stepping_batches
            assert self._next_point is not None and self._interval_steps is not None
            if total == float("inf"):
                return
            fits = max(0, (int(total) - 1 - self._next_point) // self._interval_steps + 1) if self._next_point < total else 0
            every = f"freeze_interval={self.freeze_interval!r} ({self._interval_steps} optimizer steps)"
            length, fix = f"{int(total)} optimizer steps", "a shorter freeze_interval (a float is a fraction of an epoch)"
        else:
            epochs = trainer.max_epochs
            if epochs is None or epochs < 0:
                return
            first = max(self.freeze_every_n_epochs, self._decided_epoch + self.freeze_every_n_epochs)
            fits = len(range(first, epochs, self.freeze_every_n_epochs))
            every = f"freeze_every_n_epochs={self.freeze_every_n_epochs}"
            length, fix = f"max_epochs={epochs}", "more epochs, or freeze points inside epochs (freeze_interval=0.5)"
        if fits < needed:
            rule = f"rule='{self.rule}'" + (" with anneal (each freeze one point after its decision)" if lag else "")
            what = "freeze point falls inside it" if fits == 0 else f"freeze point{'s fit' if fits > 1 else ' fits'}, and {rule} needs {('two', 'three')[needed - 2]}"
            rank_zero_warn(
                f"AutoFreeze: with {every} and a run of {length}, {'no' if fits == 0 else 'only one' if fits == 1 else f'only {fits}'} {what}: "
                f"nothing will be frozen. Use {fix}."
            )

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_start_point(trainer)
        # Every rank, every epoch start: under AutoDP this is where the replicas change, together.
        self._tell_strategy(trainer, epoch_start=True)

    def _epoch_start_point(self, trainer: pl.Trainer) -> None:
        if self.freeze_interval is not None:
            if self._points_wait_for_epochs(trainer):
                self._at_point(trainer, trainer.global_step)
            elif self.stack is not None:
                ensure_frozen_eval(self.stack, self.num_frozen, self._pre_applies())
            return
        if not getattr(trainer.strategy, "autofreeze_decides_here", True):
            # AutoDP: global rank 0 alone decides (an idle rank has no gradient norms, and stale
            # ones from rank 0's half-finished interval would decide otherwise). Its decision and
            # state reach this rank with the plan, in the strategy's transition right after this
            # (on_freeze_point), and load_state_dict freezes the same blocks here.
            if self.stack is not None:
                ensure_frozen_eval(self.stack, self.num_frozen, self._pre_applies())
            return
        epoch = trainer.current_epoch
        self._freeze_annealed(trainer, trainer.global_step, epoch)
        target = self._decide(epoch)
        if target > self.num_frozen and not self._anneal_first(trainer, target, trainer.global_step, epoch):
            self._apply(trainer, target, announce=True, epoch=epoch)
        elif self.stack is not None:
            ensure_frozen_eval(self.stack, self.num_frozen, self._pre_applies())
        self._anneal_ahead(trainer, trainer.global_step, epoch)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if (
            self.freeze_interval is not None
            and batch_idx % max(1, trainer.accumulate_grad_batches) == 0  # never inside an accumulation window
            and not self._points_wait_for_epochs(trainer)
            and self._at_point(trainer, trainer.global_step)
        ):
            self._tell_strategy(trainer, epoch_start=False)  # one process: the plan follows inside the epoch
        # A user's `model.train()` (e.g. in on_validation_model_train) would re-enable dropout in
        # frozen blocks; one attribute read per frozen module puts that right.
        if self.stack is not None and self.num_frozen:
            ensure_frozen_eval(self.stack, self.num_frozen, self._pre_applies())
        self._observe_order(pl_module)
        if self._annealer is not None and self.stack is not None:  # which optimizer step comes next: its update's factor
            self._annealer.bind(self.stack, self.freeze_embeddings, self._pre_frozen)
            self._annealer.at_step(trainer.global_step, trainer.optimizers)

    def _points_wait_for_epochs(self, trainer: pl.Trainer) -> bool:
        """Several processes under the pipeline strategy: AutoDP changes replicas at epoch starts only."""
        waits = callable(getattr(trainer.strategy, STRATEGY_HOOK, None)) and trainer.world_size > 1
        if waits and not self._deferred_told:
            self._deferred_told = True
            rank_zero_info(
                "AutoFreeze: with several processes under strategy='pipetransformer', freeze points inside an epoch are "
                "applied at the next epoch start, where AutoDP can change the number of replicas."
            )
        return waits

    def _at_point(self, trainer: pl.Trainer, step: int) -> bool:
        """At a batch start (or an epoch start under AutoDP): decide if a freeze point is due; whether one was."""
        if self._next_point is None or self._interval_steps is None or step < self._next_point:
            return False
        self._points += (step - self._next_point) // self._interval_steps + 1
        self._next_point += ((step - self._next_point) // self._interval_steps + 1) * self._interval_steps
        if not getattr(trainer.strategy, "autofreeze_decides_here", True):
            if self.stack is not None:  # rank 0's decision arrives with the plan (load_state_dict)
                ensure_frozen_eval(self.stack, self.num_frozen, self._pre_applies())
            return True
        self._freeze_annealed(trainer, step, trainer.current_epoch)
        target = self._decide_at_point()
        if target > self.num_frozen and not self._anneal_first(trainer, target, step, trainer.current_epoch):
            self._apply(trainer, target, announce=True, epoch=trainer.current_epoch, step=step)
        self._anneal_ahead(trainer, step)
        return True

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.schedule is not None or self.stack is None:
            return
        if self.rule == "autofreeze":
            self._add_gradients()
            return
        if self.rule != "paper":
            return
        norms = self._block_grad_norms()
        if norms is None:
            return
        if self._norm_sum is None:
            self._norm_sum = torch.zeros_like(norms)
            if self._restored_norms is not None:
                self._norm_sum += torch.tensor(self._restored_norms, dtype=norms.dtype, device=norms.device)
                self._restored_norms = None
        # A step skipped by AMP's scaler has inf/nan gradients: it must not decide a freeze, so it is
        # left out of both the sums and the count (a tensor count: no host sync per step).
        finite = torch.isfinite(norms).all()
        self._norm_sum += torch.where(finite, norms, torch.zeros_like(norms))
        self._norm_steps = self._norm_steps + finite.to(torch.int64)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.log("autofreeze/num_frozen", float(self.num_frozen), on_step=False, on_epoch=True, sync_dist=True)

    # ------------------------------------------------------------------ decisions

    def _decide(self, epoch: int) -> int:
        """The frozen count the rule asks for at the start of ``epoch`` (never below the current)."""
        if self.stack is None:
            return self.num_frozen
        if self.schedule is not None:
            # Blocks without a trainable parameter count as frozen from the start, whatever the plan says.
            target = max(self.schedule(epoch), self._untrainable)
            if target < self.num_frozen or target > max(self.max_frozen, self._untrainable):
                raise ValueError(
                    f"schedule({epoch}) = {target}, but {self.num_frozen} blocks are already frozen and at most "
                    f"{self.max_frozen} may be: a schedule must not decrease or exceed the stack."
                )
            return target
        n = self.freeze_every_n_epochs
        if epoch == 0 or epoch % n != 0 or epoch <= self._decided_epoch:
            return self.num_frozen
        self._decided_epoch = epoch
        if self.rule == "schedule":
            target = geometric_num_frozen(self.num_blocks, self.alpha, epoch // n)
        elif self.rule == "autofreeze":
            target = self._autofreeze_rule()
        else:
            norms = self._mean_norms()
            self._reset_norms()
            if norms is None:  # no optimizer step in the interval: nothing to go on
                return self.num_frozen
            target = paper_num_frozen(self.num_frozen, self.alpha, norms)
        return max(self.num_frozen, min(target, self.max_frozen))

    def _decide_at_point(self) -> int:
        """The frozen count at a point of ``freeze_interval`` (never below the current)."""
        if self.rule == "schedule":
            target = geometric_num_frozen(self.num_blocks, self.alpha, self._points)
        elif self.rule == "paper":
            norms = self._mean_norms()
            self._reset_norms()
            if norms is None:
                return self.num_frozen
            target = paper_num_frozen(self.num_frozen, self.alpha, norms)
        else:
            target = self._autofreeze_rule()
        return max(self.num_frozen, min(target, self.max_frozen))

    def _add_gradients(self) -> None:
        """rule="autofreeze": add this step's gradients of the active blocks to the interval's sums.

        A step with a non-finite gradient (skipped by AMP's scaler) adds nothing, decided on the
        device (no host sync). Sums restored from a checkpoint sit where the checkpoint was loaded
        (callbacks load before the strategy moves the model): they follow their gradients here.
        """
        assert self.stack is not None
        if self._grad_sums is None:
            self._grad_sums = [[torch.zeros_like(p) for p in block.parameters()] for block in self.stack.blocks]
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for index, block in enumerate(self.stack.blocks):
            if index < self.num_frozen:
                continue
            sums = self._grad_sums[index]
            for position, p in enumerate(block.parameters()):
                if p.grad is None:
                    continue
                if sums[position].device != p.grad.device:
                    sums[position] = sums[position].to(p.grad.device)
                by_device.setdefault(p.grad.device, []).append((sums[position], p.grad))
        if not by_device:
            return
        # One flag for the whole step, as the optimizer skips a step as a whole (pipeline stages may
        # sit on several devices: each checks its own gradients, the flags meet on one device).
        # The largest magnitude (ord=inf) cannot overflow in half precision as an L2 norm can, and keeps nan and inf.
        flags = [torch.isfinite(torch.stack(torch._foreach_norm([g for _, g in pairs], ord=math.inf))).all() for pairs in by_device.values()]
        finite = torch.stack([f.to(flags[0].device) for f in flags]).all()
        for device, pairs in by_device.items():
            ok = finite.to(device)
            torch._foreach_add_([s for s, _ in pairs], [torch.where(ok, g, 0.0) for _, g in pairs])

    def _autofreeze_rule(self) -> int:
        """Liu et al.'s decision: compare each block's summed-gradient L1 norm with the previous interval's."""
        if self._grad_sums is None:
            return self.num_frozen
        l1 = [float(sum(float(s.abs().sum()) for s in sums)) for sums in self._grad_sums]
        self._grad_sums = None
        if not all(math.isfinite(v) for v in l1):  # overflowed sums: no decision, and no baseline for the next
            self._previous_l1 = None
            return self.num_frozen
        previous, self._previous_l1 = self._previous_l1, l1
        if previous is None:
            return self.num_frozen
        return autofreeze_num_frozen(self.num_frozen, previous, l1, self.percentile)

    def _block_grad_norms(self) -> torch.Tensor | None:
        """Per-block gradient norms (0 for frozen blocks), on the device of the last block."""
        assert self.stack is not None
        blocks = self.stack.blocks
        device = next((p.grad.device for p in blocks[-1].parameters() if p.grad is not None), None)
        if device is None:
            return None
        norms = []
        for index, block in enumerate(blocks):
            grads = [p.grad for p in block.parameters() if p.grad is not None] if index >= self.num_frozen else []
            if not grads:
                norms.append(torch.zeros((), device=device))
                continue
            per_tensor = torch._foreach_norm(grads, dtype=torch.float32)  # in fp16 a finite gradient's L2 norm can overflow
            norms.append(torch.linalg.vector_norm(torch.stack(per_tensor)).to(device, non_blocking=True))
        return torch.stack(norms).float()

    def _mean_norms(self) -> list[float] | None:
        steps = int(self._norm_steps)  # the finite steps of the interval (a device tensor while training)
        if steps == 0:
            return None
        if self._norm_sum is None:
            return None if self._restored_norms is None else [v / steps for v in self._restored_norms]
        return (self._norm_sum / steps).tolist()

    def _reset_norms(self) -> None:
        self._norm_sum, self._norm_steps, self._restored_norms = None, 0, None

    # ------------------------------------------------------------------ applying a freeze

    def _apply(self, trainer: pl.Trainer, target: int, announce: bool, epoch: int | None = None, step: int | None = None) -> None:
        assert self.stack is not None
        before = self.num_frozen
        self._pre_frozen = self.freeze_embeddings
        changed = apply_freeze(self.stack, target, self._pre_applies())
        self.num_frozen = target
        if self._grad_sums is not None:  # rule="autofreeze": frozen blocks' sums are not needed any more
            for index in range(before, target):
                self._grad_sums[index] = [torch.zeros_like(s) for s in self._grad_sums[index]]
        if announce:
            epoch = int(epoch if epoch is not None else trainer.current_epoch)
            step = int(step if step is not None else trainer.global_step)
            self.history.append((epoch, target))
            self.step_history.append((step, target))
            where = f"epoch {epoch}" + (f", step {step}" if self.freeze_interval is not None else "")
            rank_zero_info(
                f"AutoFreeze: {where}: froze blocks {before}..{target - 1} "
                f"({target}/{self.num_blocks} frozen{', embeddings too' if self.freeze_embeddings else ''})."
            )
        self._notify_strategy(trainer, target, changed)

    def _tell_strategy(self, trainer: pl.Trainer, epoch_start: bool) -> None:
        """The pipeline strategy brings its plan in line with :attr:`num_frozen` (also when no parameter
        changed: blocks that had none trainable still move the plan)."""
        hook = getattr(trainer.strategy, STRATEGY_HOOK, None)
        if callable(hook):
            hook(trainer, self, epoch_start)

    def _notify_strategy(self, trainer: pl.Trainer, target: int, changed: int) -> None:
        strategy = trainer.strategy
        if callable(getattr(strategy, STRATEGY_HOOK, None)):
            return  # told at the freeze point (_tell_strategy), after the decision is complete
        if changed and isinstance(strategy, DDPStrategy) and isinstance(strategy.model, DistributedDataParallel):
            # DDP's reducer fixed its gradient buckets when it was built; parameters frozen
            # afterwards would still be all-reduced (or raise "Expected to have finished
            # reduction"). Re-wrapping drops them (Lightning issue #20340).
            strategy.model = strategy.lightning_module
            strategy.configure_ddp()

    # ------------------------------------------------------------------ smooth freezing (anneal=..., freeze/anneal.py)

    def _setup_anneal(self, trainer: pl.Trainer) -> None:
        """Build the annealer for this fit, or say once why it cannot engage (the stack may be found later)."""
        if self.anneal is None:
            return
        if callable(getattr(trainer.strategy, STRATEGY_HOOK, None)) and trainer.world_size > 1:
            self._annealer = None
            self._tell_anneal(
                "autodp",
                "AutoFreeze(anneal=...) is off: with several processes under strategy='pipetransformer', AutoDP applies "
                "freezes at epoch starts whose optimizer step is not known in advance (replicas joining change the "
                "epoch's length), so an interval cannot be annealed to end at the freeze. Blocks freeze without annealing.",
            )
            return
        if self._annealer is None:
            self._annealer = Annealer(self.anneal)

    def _anneal_text(self) -> str:
        if self.anneal is None:
            return ""
        name = self.anneal if isinstance(self.anneal, str) else "custom"
        lag = self.schedule is None and self.rule in ("paper", "autofreeze")
        return f", anneal={name}" + (" (each freeze one interval after its decision)" if lag else "")

    def _tell_anneal(self, key: str, message: str) -> None:
        if key not in self._anneal_told:
            self._anneal_told.add(key)
            rank_zero_warn(message)

    def _anneal_lags(self) -> bool:
        """The rules that decide from the interval's gradients know the next F only at the point itself."""
        return self._annealer is not None and self.schedule is None and self.rule in ("paper", "autofreeze")

    def _next_point_step(self, trainer: pl.Trainer, step: int, epoch: int | None) -> int | None:
        """The optimizer step of the next freeze point after the one at ``step`` (None: unknown)."""
        if self.freeze_interval is not None:
            return self._next_point
        if epoch is None:
            return None
        try:
            per_epoch = _steps_per_epoch(trainer)
        except ValueError:
            self._tell_anneal(
                "length", "AutoFreeze(anneal=...) cannot anneal: the training loader has no length, so the step of the next "
                "epoch-start freeze point is unknown. Blocks freeze without annealing.",
            )
            return None
        n = 1 if self.schedule is not None else self.freeze_every_n_epochs
        return step + ((epoch // n + 1) * n - epoch) * per_epoch

    def _begin_anneal(self, trainer: pl.Trainer, target: int, step: int, end: int | None) -> bool:
        """Anneal blocks ``num_frozen..target-1`` over the steps ``step..end-1``; False if it cannot engage."""
        if self._annealer is None or end is None or target <= self.num_frozen:
            return False
        if end - step < 2:
            self._tell_anneal(
                "short", f"AutoFreeze(anneal=...): the interval before the freeze at step {end} has {end - step} optimizer "
                "step(s); annealing needs at least 2 (an interval's first step runs at the full rate), so its blocks "
                "freeze without annealing.",
            )
            return False
        assert self.stack is not None
        self._annealer.bind(self.stack, self.freeze_embeddings, self._pre_frozen)
        if self._annealer.begin(AnnealPlan(self.num_frozen, target, step, end)):
            rank_zero_info(
                f"AutoFreeze: step {step}: annealing blocks {self.num_frozen}..{target - 1} to a zero learning rate "
                f"({self.anneal if isinstance(self.anneal, str) else 'custom curve'}) until the freeze point at step {end}."
            )
        return True

    def _anneal_first(self, trainer: pl.Trainer, target: int, step: int, epoch: int) -> bool:
        """``"paper"``/``"autofreeze"``: the decision of this point anneals over the next interval and freezes
        at the next point. True when it does (nothing freezes now)."""
        if not self._anneal_lags():
            return False
        epoch_level = None if self.freeze_interval is not None else epoch
        return self._begin_anneal(trainer, target, step, self._next_point_step(trainer, step, epoch_level))

    def _freeze_annealed(self, trainer: pl.Trainer, step: int, epoch: int) -> None:
        """At a freeze point: freeze the blocks whose interval ends here (their rate reached zero)."""
        plan = self._annealer.plan if self._annealer is not None else None
        if plan is None or step < plan.end:
            return
        assert self._annealer is not None
        self._annealer.clear()
        if plan.target > self.num_frozen:
            self._apply(trainer, plan.target, announce=True, epoch=epoch, step=step)

    def _anneal_ahead(self, trainer: pl.Trainer, step: int, epoch: int | None = None) -> None:
        """``"schedule"`` and explicit schedules know the next F: anneal its blocks over the interval before it."""
        if self._annealer is None or self._anneal_lags() or self.stack is None:
            return
        if self.schedule is not None:
            assert epoch is not None
            if trainer.max_epochs is not None and 0 < trainer.max_epochs <= epoch + 1:
                return  # no freeze point after the last epoch
            target = self.schedule(epoch + 1)
            if not self.num_frozen < target <= self.max_frozen:
                return  # nothing to freeze next (or a bad plan, which _decide refuses at that epoch)
        elif self.freeze_interval is not None:
            target = geometric_num_frozen(self.num_blocks, self.alpha, self._points + 1)
        else:
            assert epoch is not None
            n = self.freeze_every_n_epochs
            target = geometric_num_frozen(self.num_blocks, self.alpha, epoch // n + 1)
        target = min(target, self.max_frozen)
        if target > self.num_frozen:
            self._begin_anneal(trainer, target, step, self._next_point_step(trainer, step, epoch))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._observer is not None:
            self._observer.remove()
            self._observer = None
        if self._annealer is not None:
            self._annealer.detach()  # the optimizer's step hooks go with the fit

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        return {
            **self.decision_state(),
            # rule="autofreeze" mid-interval: the summed gradients (a copy of the active blocks' size).
            "grad_sums": [[t.detach().cpu() for t in block] for block in self._grad_sums] if self._grad_sums is not None else None,
        }

    def decision_state(self) -> dict[str, Any]:
        """What every rank needs of rank 0's decisions (what AutoDP's agree message carries): the
        state without the summed gradients, which only the deciding rank reads and which are a copy
        of the active blocks' size (~340 MB for BERT-base). :meth:`load_state_dict` takes it; the
        receiving rank's own sums restart empty, as they are never read there."""
        norms = self._mean_sum_list()
        return {
            "num_frozen": self.num_frozen,
            "num_blocks": self.num_blocks,
            "history": [list(h) for h in self.history],
            "decided_epoch": self._decided_epoch,
            "norm_sum": norms,
            "norm_steps": int(self._norm_steps),
            "step_history": [list(h) for h in self.step_history],
            "next_point": self._next_point,
            "points": self._points,
            "previous_l1": self._previous_l1,
            "pre_frozen": self._pre_frozen,
            # anneal: the interval that anneals now (blocks, steps); None without one.
            "anneal": self._annealer.state_dict() if self._annealer is not None else None,
            # What runs before and after the stack, once observed: a resumed run freezes the same modules.
            "pre": [p for p, _ in self.stack.pre] if self.stack is not None and not self.stack.provisional else None,
            "post": [p for p, _ in self.stack.post] if self.stack is not None and not self.stack.provisional else None,
        }

    def _mean_sum_list(self) -> list[float] | None:
        if self._norm_sum is not None:
            return self._norm_sum.tolist()
        return self._restored_norms

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
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
        self._decided_epoch = int(state_dict.get("decided_epoch", 0))
        self._norm_sum = None
        self._restored_norms = state_dict.get("norm_sum")
        self._norm_steps = int(state_dict.get("norm_steps", 0))
        self.step_history = [(int(a), int(b)) for a, b in state_dict.get("step_history", [])]
        self._next_point = state_dict.get("next_point")
        self._points = int(state_dict.get("points", 0))
        self._previous_l1 = state_dict.get("previous_l1")
        self._pre_frozen = bool(state_dict.get("pre_frozen", self.freeze_embeddings and self.num_frozen > 0))
        sums = state_dict.get("grad_sums")
        if sums is not None and self.stack is not None:
            self._grad_sums = [
                [t.to(p.device) for t, p in zip(block, module.parameters())] for block, module in zip(sums, self.stack.blocks)
            ]
        else:
            self._grad_sums = None
        if self._annealer is not None:
            self._annealer.load_state_dict(state_dict.get("anneal"))
        order = state_dict.get("pre"), state_dict.get("post")
        if self.stack is not None and self.stack.provisional and order[0] is not None and self._module is not None:
            root = self._module
            self._refine(root, [(p, root.get_submodule(p)) for p in order[0]], [(p, root.get_submodule(p)) for p in order[1] or []],
                         [p for p, _ in self.stack.pre])
        if self.stack is not None and self.num_frozen:
            # Callbacks are restored before the strategy wraps the model: freeze now so DDP's
            # first wrapper already leaves the frozen prefix out.
            apply_freeze(self.stack, self.num_frozen, self._pre_applies())


def _steps_per_epoch(trainer: pl.Trainer) -> int:
    """Optimizer steps in one training epoch (what a fractional ``freeze_interval`` is a fraction of)."""
    batches = trainer.num_training_batches
    if batches == float("inf") or batches is None:
        raise ValueError(
            "freeze_interval as a fraction of an epoch needs a training loader with a length; pass an int number of "
            "optimizer steps instead."
        )
    return max(1, -(-int(batches) // max(1, trainer.accumulate_grad_batches)))


def _builds_lazily(pl_module: pl.LightningModule) -> bool:
    """Whether the module builds (part of) its model after the callbacks' setup: in setup() or configure_model()."""
    return any(is_overridden(hook, pl_module) for hook in ("setup", "configure_model", "configure_sharded_model"))


def _pre_trainable(stack: BlockStack) -> bool:
    """Whether a parameter before the stack (embeddings, a cls token) still requires grad."""
    return any(p.requires_grad for _, m in stack.pre for p in m.parameters()) or any(p.requires_grad for _, p in stack.pre_params)
