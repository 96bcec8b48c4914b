"""AutoFreeze's mechanism, without Lightning: the stack, what is frozen, applying a freeze, the checkpoint.

As Lightning's ``BaseFinetuning`` keeps the freezing itself apart from the policy it is handed
the epoch for, :class:`FreezeMechanism` holds what any freezing callback over a block stack
needs: finding and checking the stack (:mod:`~lightning_pipetransformer.freeze.stack_checks`),
putting ``pre``/``post`` where they ran (:mod:`~lightning_pipetransformer.freeze.call_order`),
asking the rule at a point and applying its answer, following blocks that other code unfroze,
and the state a checkpoint and AutoDP's agree message carry. *When* a point falls is the clock's
(:mod:`~lightning_pipetransformer.freeze.clock`); the Lightning hooks that drive all of it, and
the strategy's part, are :class:`~lightning_pipetransformer.freeze.callback.AutoFreeze`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from lightning_pipetransformer.freeze.anneal_timing import AnnealTiming
from lightning_pipetransformer.freeze.apply import apply_freeze, untrainable_prefix
from lightning_pipetransformer.freeze.call_order import Split, refine
from lightning_pipetransformer.freeze.clock import FreezeClock
from lightning_pipetransformer.freeze.config import AutoFreezeConfig
from lightning_pipetransformer.freeze.policies import FreezePoint, FreezeRule, make_rule
from lightning_pipetransformer.freeze.rules import ExplicitSchedule
from lightning_pipetransformer.freeze.stack_checks import check_min_active, choose_embeddings, pre_trainable
from lightning_pipetransformer.stack.declared import block_stack_of
from lightning_pipetransformer.stack.discovery import BlockStack
from lightning_pipetransformer.terminal import debug_log

__all__ = ["FreezeMechanism"]


class FreezeMechanism:
    """The frozen prefix of one model's block stack, its rule and its clock, for a freezing callback.

    Args:
        config: the checked arguments.
        say: how a notice is said (rank zero's info in the callback).
        warn: how a warning is said (rank zero's warning in the callback).
    """

    def __init__(self, config: AutoFreezeConfig, say: Callable[[str], None], warn: Callable[[str], None]) -> None:
        #: The arguments, checked once (:class:`~lightning_pipetransformer.freeze.config.AutoFreezeConfig`).
        self.config = config
        self._say, self._warn = say, warn
        #: The policy that decides at each freeze point (:mod:`lightning_pipetransformer.freeze.policies`).
        self.freeze_rule: FreezeRule = make_rule(config.rule, config.alpha, config.percentile, config.explicit_schedule)
        #: When the freeze points fall (:mod:`lightning_pipetransformer.freeze.clock`).
        self.clock = FreezeClock(config.interval_for(self.freeze_rule), config.freeze_every_n_epochs, self.freeze_rule.per_epoch)
        self.rule: str = config.rule if isinstance(config.rule, str) else config.rule.name
        self.pre = list(config.pre) if config.pre is not None else None
        #: Whether the modules before the stack freeze with the first block: as asked, unless tied to the head.
        self.freeze_embeddings = config.freeze_embeddings
        #: Why the embeddings keep training although freeze_embeddings=True was asked (tied to the head); None otherwise.
        self.embeddings_kept_training: str | None = None
        # Smooth freezing's timing; its annealer is built at setup, where it can engage.
        self._anneal = AnnealTiming(config.anneal, self.freeze_rule.plans_ahead, warn=warn, info=say) if config.anneal is not None else None

        self.stack: BlockStack | None = None
        self.num_frozen = 0
        #: Whether the modules before the stack count as frozen (AutoFreeze froze them, or they were before fit).
        self._pre_frozen = False
        self._untrainable = 0  # leading blocks that had no trainable parameter when the stack was found
        self._module: nn.Module | None = None  # the module of the current fit (lazily built models)
        self.history: list[tuple[int, int]] = []  # (epoch, num_frozen) at each freeze event
        #: (global step, num_frozen) at each freeze event.
        self.step_history: list[tuple[int, int]] = []
        self._last_rate: float | None = None  # the learning rate of the last optimizer step (FreezePoint)

    # ------------------------------------------------------------------ the stack and what is frozen

    @property
    def freeze_interval(self) -> int | float | None:
        """The interval between freeze points inside epochs in force (a rule's own when none was given), or None."""
        return self.clock.interval

    # AutoFreeze's arguments as they were readable before they moved to :attr:`config` (user code reads them).

    @property
    def alpha(self) -> float:
        return self.config.alpha

    @property
    def schedule(self) -> ExplicitSchedule | None:
        return self.config.explicit_schedule

    @property
    def layers(self) -> Any:
        return self.config.layers

    @property
    def freeze_every_n_epochs(self) -> int:
        return self.config.freeze_every_n_epochs

    @property
    def min_active(self) -> int:
        return self.config.min_active

    @property
    def percentile(self) -> float:
        return self.config.percentile

    @property
    def anneal(self) -> Any:
        return self.config.anneal

    @property
    def num_blocks(self) -> int:
        return len(self.stack) if self.stack is not None else 0

    @property
    def max_frozen(self) -> int:
        return self.num_blocks - self.config.min_active

    def find_stack(self, pl_module: nn.Module, trainer: Any = None) -> BlockStack:
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
        check_min_active(stack, pl_module, self.config.min_active, self.freeze_embeddings)
        self.stack = stack
        epochs = trainer.max_epochs if trainer is not None and trainer.max_epochs is not None and trainer.max_epochs > 0 else None
        self.freeze_rule.check(self.max_frozen, epochs)
        # One short line (module lists cut to a few names) for the console; the full lists at DEBUG.
        self._say(f"AutoFreeze: block stack {stack.describe(limit=3)}; {self._rule_text()}.")
        debug_log.debug("AutoFreeze: block stack %s.", stack.describe())
        untrainable = self._untrainable = untrainable_prefix(stack)
        if untrainable > self.num_frozen:
            self._say(
                f"AutoFreeze: blocks 0..{untrainable - 1} have no trainable parameter: counted as frozen from the start "
                "(eval mode, as blocks AutoFreeze freezes)."
            )
            self.num_frozen = untrainable
        self._check_ties(pl_module)
        if self.freeze_embeddings and self.num_frozen and not pre_trainable(stack):
            self._pre_frozen = True  # frozen before fit (PEFT): treated as AutoFreeze would
        if self.num_frozen:  # a second fit() with the same callback, or blocks frozen before fit
            apply_freeze(stack, self.num_frozen, self._pre_applies())
        return stack

    def _check_ties(self, pl_module: nn.Module) -> None:
        """Input embeddings tied to an output head keep training unless ``pre=`` names them (see ``freeze_embeddings``)."""
        assert self.stack is not None
        said = self.embeddings_kept_training
        choice = choose_embeddings(self.stack, pl_module, self.config.freeze_embeddings, named=self.pre is not None)
        self.freeze_embeddings, self.embeddings_kept_training = choice.freeze, choice.kept_training
        if choice.warning is not None:
            self._warn(choice.warning)
        if choice.kept_training is not None and choice.kept_training != said:  # once (checked again when the call order refines pre)
            self._say(f"AutoFreeze: {choice.kept_training}.")

    def _pre_applies(self) -> bool:
        """Whether to freeze ``pre`` now: it counts as frozen, and it is known (observed or declared) what runs before."""
        return self._pre_frozen and self.stack is not None and not self.stack.provisional

    def _refine(self, pl_module: nn.Module, split: Split) -> None:
        assert self.stack is not None
        refine(self.stack, split, self._say)
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

    def _follow_thaws(self) -> None:
        """Blocks it froze that other code made trainable again (a callback's ``requires_grad_(True)``, Lightning's
        ``BaseFinetuning.unfreeze_and_add_param_group``): counted as active again, so that AutoFreeze neither keeps
        them in eval mode nor ignores their gradients (its rule may freeze them again at a later point), and a
        replica that takes its state (AutoDP) does not freeze them back."""
        if self.stack is None or not self.num_frozen:
            return
        frozen_now = untrainable_prefix(self.stack)
        if frozen_now < self.num_frozen:
            self._say(
                f"AutoFreeze: blocks {frozen_now}..{self.num_frozen - 1} train again (other code unfroze them): counted as "
                f"active from here on ({frozen_now}/{self.num_blocks} frozen)."
            )
            self.num_frozen = frozen_now

    # ------------------------------------------------------------------ deciding and applying a freeze

    def _epoch_index(self, epoch: int) -> int | None:
        """The index of the freeze point at the start of ``epoch`` (None: no point there, or no stack yet)."""
        return self.clock.epoch_point(epoch) if self.stack is not None else None

    def _point(self, index: int, epoch: int, learning_rate: float | None = None) -> FreezePoint:
        return FreezePoint(
            index, epoch, self.num_frozen, self.num_blocks, self.max_frozen, self._untrainable, learning_rate, self._last_rate
        )

    def _decide(self, index: int, epoch: int, learning_rate: float | None = None) -> int:
        """The rule's answer at point ``index``, kept between the blocks frozen now and ``max_frozen``:
        blocks never thaw. The point is built here, after any freeze earlier at the same point."""
        if self.stack is None:
            return self.num_frozen
        return max(self.num_frozen, min(self.freeze_rule.decide(self._point(index, epoch, learning_rate)), self.max_frozen))

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
        self._say(
            f"AutoFreeze: {where}: froze {blocks} "
            f"({target}/{self.num_blocks} frozen{', embeddings too' if self.freeze_embeddings else ''})."
        )
        return changed

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
