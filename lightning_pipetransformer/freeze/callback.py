"""AutoFreeze: progressive freezing of a model's leading blocks, as a Lightning callback.

Works alone under single-device and DDP-family strategies (plain progressive freezing: the
frozen prefix runs forward only and leaves DDP's gradient all-reduce), and under a strategy that
follows the freeze points (:class:`~lightning_pipetransformer.freeze.seam.FreezeFollower`:
``strategy="pipetransformer"``), which repartitions the pipeline at each.

This module is the Lightning side: the hooks, the strategy's part and smooth freezing's glue. The
mechanism (the stack, applying, the checkpoint) is its base,
:class:`~lightning_pipetransformer.freeze.mechanism.FreezeMechanism`; *when* a point falls is
asked of :class:`~lightning_pipetransformer.freeze.clock.FreezeClock`; *how many* blocks freeze
there is the rule's, a policy object (:class:`~lightning_pipetransformer.freeze.policies.FreezeRule`).
When things happen (every rank runs the same code on the same numbers, so decisions agree):

* every optimizer step (``on_before_optimizer_step``: gradients are final, after DDP averaging
  and gradient accumulation, and unscaled under AMP): the rule observes the gradients (the
  statistics of :mod:`lightning_pipetransformer.freeze.statistics`, on the device, no host sync).
* at each freeze point (an epoch start, or with ``freeze_interval`` a batch that opens an
  accumulation window, so that a freeze never splits one): the rule decides the new frozen count
  ``F``, capped at ``len(stack) - min_active`` and never below the current; the blocks freeze,
  and the strategy is told (DDP's wrapper is rebuilt so frozen parameters leave the gradient
  buckets; a :class:`~lightning_pipetransformer.freeze.seam.FreezeFollower` re-plans).
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
from lightning_pipetransformer.freeze.apply import ensure_frozen_eval
from lightning_pipetransformer.freeze.call_order import CallOrderWatch
from lightning_pipetransformer.freeze.config import AutoFreezeConfig
from lightning_pipetransformer.freeze.mechanism import FreezeMechanism
from lightning_pipetransformer.freeze.nested_tensor import NestedTensorGuard, guard_nested_tensor
from lightning_pipetransformer.freeze.policies import FreezeRule, Rule
from lightning_pipetransformer.freeze.seam import FreezeFollower
from lightning_pipetransformer.stack.discovery import BlockStack, BlockStackError
from lightning_pipetransformer.terminal import wrap
from lightning_pipetransformer.warn_once import WarnOnce

__all__ = ["AutoFreeze"]

def _info(message: str) -> None:
    """Say ``message`` on rank 0, wrapped to the terminal (a 300-column line wraps mid-word otherwise).

    Warnings stay one line each: pytest.warns and warnings filters match them by their text."""
    rank_zero_info(wrap(message))


class AutoFreeze(FreezeMechanism, Callback):
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
        config = AutoFreezeConfig(
            alpha=alpha, rule=rule, schedule=schedule, layers=layers, pre=pre, freeze_every_n_epochs=freeze_every_n_epochs,
            min_active=min_active, freeze_embeddings=freeze_embeddings, freeze_interval=freeze_interval, percentile=percentile,
            anneal=anneal,
        )  # fmt: skip
        super().__init__(config, say=_info, warn=rank_zero_warn)
        self._order = CallOrderWatch()  # the first training forward's call order (freeze/call_order.py)
        self._nested_guard: NestedTensorGuard | None = None  # nn.TransformerEncoder: nested tensors in eval mode only
        self._said = WarnOnce(lambda message, stacklevel: _info(message))

    # ------------------------------------------------------------------ set-up and checks

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

    def _finish_observation(self, pl_module: pl.LightningModule) -> None:
        """After the forward (before backward and any optimizer step): put ``pre``/``post`` where they ran."""
        split = self._order.finish(self.stack) if self.stack is not None else None
        if split is not None:
            self._refine(pl_module, split)

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
        ahead = self.freeze_rule.ahead(self._point(*following)) if following is not None else None
        target = min(ahead, self.max_frozen) if ahead is not None else self.num_frozen
        if target > self.num_frozen:
            self._begin_anneal(target, step, self._following_step(trainer, step, epoch))


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

