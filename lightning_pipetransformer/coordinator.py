"""The coordinator: what the ranks do together around the plan in force (AutoDP's choreography).

Why apart from the strategy: Lightning's hooks say *when* (setup, a training step, a freeze point);
this object says *what, in which order, on every rank*: the first plan and agreeing on it, each
transition and the state the joining ranks receive, the cache boundary opened together, every rank
stopping on a signal at the same step, and the plan following what the model has frozen. It takes
the parts (the engine, the replicas, the stack, the cache, the ranks) and a :class:`LoopSide` for
the few things only Lightning's side can do, and returns data; it never sees the strategy or the
trainer (``tests/unit/test_coordinator.py`` drives it with fakes).
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_pipetransformer import devices as dev
from lightning_pipetransformer import report
from lightning_pipetransformer.cache.autocache import AutoCache
from lightning_pipetransformer.cache.cached_stack import CachedStack
from lightning_pipetransformer.cache.watch import PrefixChange
from lightning_pipetransformer.dp import faults, groups, loop_state, state_transfer
from lightning_pipetransformer.dp.clock import PhaseClock
from lightning_pipetransformer.dp.replicas import Elastic, Ranks, Replicas, stage_devices
from lightning_pipetransformer.engine import Engine
from lightning_pipetransformer.freeze.apply import untrainable_prefix
from lightning_pipetransformer.freeze.seam import FreezeSource
from lightning_pipetransformer.plan import Plan
from lightning_pipetransformer.plan.change import PlanChange
from lightning_pipetransformer.stack.discovery import BlockStack
from lightning_pipetransformer.stack.interception import arm_self_check, installed_pipeline
from lightning_pipetransformer.stack.self_check import SelfCheck

__all__ = ["Coordinator", "LoopSide", "replaced_blocks"]


@dataclasses.dataclass(frozen=True)
class LoopSide:
    """What the coordinator reads of Lightning's loop and asks of it, for one trainer call (the strategy fills it in)."""

    #: (epoch, global step) now: every rank must be where rank 0 is when they agree.
    position: Callable[[], tuple[int, int]]
    #: Whether the trainer call is ``fit`` (validate, test and predict never arm a self-check or log a plan).
    fitting: bool
    #: The LightningModule: its weights go to the joining ranks, its metrics sync over the replicas.
    module: torch.nn.Module
    #: The optimizers now (their state follows the blocks and goes to the joining ranks).
    optimizers: Callable[[], list[torch.optim.Optimizer]]
    #: The LR schedulers and the precision's gradient scaler (None without one): the rest of a joining replica's loop state.
    loop_state: Callable[[], tuple[list[Any], Any]]
    #: To every logger, at the current global step.
    log_metrics: Callable[[dict[str, float]], None]
    #: DDP's wrapper off the model (its reducer holds the old group and frozen set; blocks must not move under it).
    drop_gradient_sync: Callable[[], None]
    #: DDP (or the average by hand) over the active group of the plan in force, without copying rank 0's weights.
    sync_gradients: Callable[[], None]
    #: Before a new active group: the order in which logged metrics sync starts over.
    restart_metric_order: Callable[[], None]
    #: The training data re-split over the replicas of the plan in force.
    rebuild_train_loader: Callable[[], None]
    #: Lightning's loops stop after the current batch, as after its own SIGTERM.
    stop_after_this_batch: Callable[[], None]


def replaced_blocks(stack: BlockStack) -> list[int]:
    """The positions whose block is another module object than the one the installed runner runs (``layers[i] = m``)."""
    runner = installed_pipeline(stack.container)
    blocks = stack.blocks
    if runner is None or len(runner.blocks) != len(blocks):  # another depth: not followed (the interception refuses it)
        return []
    return [i for i, (old, new) in enumerate(zip(runner.blocks, blocks)) if old is not new]


class Coordinator:
    """AutoDP's choreography for one trainer call: one process re-plans alone; several do every step together."""

    def __init__(
        self,
        engine: Engine,
        replicas: Replicas,
        loop: LoopSide,
        *,
        stack: BlockStack,
        cache: AutoCache | None,
        ranks: Ranks,
        signals: faults.SignalNotice,
        self_check: bool,
        announce: Callable[[str], None],
    ) -> None:
        self.engine, self.replicas, self.loop, self.stack, self.cache = engine, replicas, loop, stack, cache
        self.ranks, self.signals, self.self_check, self.announce = ranks, signals, self_check, announce
        #: Seconds per phase of the last AutoDP transition on this rank (for logs and benchmarks).
        self.last_transition: dict[str, float] = {}
        #: The signal every rank agreed to stop for (0: none).
        self.stopping_signal = 0
        #: Whether every rank agreed on a failure at a step (their exception hooks then meet).
        self.failing_together = False
        self._synced_boundary: int | None = None  # the cache boundary all ranks opened together last
        self._last_stage = ""  # the stage of the last step: a step of another stage begins a pass

    @property
    def is_active(self) -> bool:
        return self.replicas.is_active(self.engine.plan)

    # ------------------------------------------------------------------ the plan: first, agreed, applied

    def _target_frozen(self, autofreeze: FreezeSource | None) -> int:
        """The frozen prefix to plan for: the leading blocks without a trainable parameter, whoever froze them.

        AutoFreeze's freezes count through ``requires_grad`` like anybody else's, so a block it froze and a callback
        unfroze trains again (``autofreeze`` is kept for the callers' symmetry: every freeze point passes it)."""
        return untrainable_prefix(self.stack)

    def first_plan(self, autofreeze: FreezeSource | None) -> Plan:
        """One process: the planner's plan. Several: rank 0's, agreed on, with the groups made."""
        replicas = self.replicas
        if not isinstance(replicas, Elastic):
            return self.engine.propose(self._target_frozen(autofreeze))
        replicas.connect()
        if self.cache is not None:
            # One namespace for the node's processes: index i names the same sample on every rank.
            self.cache.namespace = replicas.broadcast(self.cache.namespace)
        plan = self.agree(autofreeze)
        replicas.regroup(plan.active_ranks)
        return plan

    def agree(self, autofreeze: FreezeSource | None) -> Plan:
        """Rank 0's plan (and planner and AutoFreeze state) on every rank; the others take its decision."""
        assert isinstance(self.replicas, Elastic)
        proposal = None
        if self.ranks.global_rank == 0:
            proposal = {
                "plan": self.engine.propose(self._target_frozen(autofreeze)).to_dict(),
                "planner": self.engine.planner.state_dict(),
                # The decisions only: the gradient sums stay on rank 0, the one rank that reads them.
                "autofreeze": autofreeze.decision_state() if autofreeze is not None else None,
            }
        message = self.replicas.agree(proposal, self.loop.position())
        if self.ranks.global_rank != 0:
            self.engine.planner.load_state_dict(message["planner"])
            if autofreeze is not None and message["autofreeze"] is not None:
                autofreeze.load_state_dict(message["autofreeze"])  # a shadow rank's rule saw no gradients
        return Plan.from_dict(message["plan"])

    def apply(self, plan: Plan) -> None:
        """Make ``plan`` (this process's view of it) the one in force, and say so."""
        local = self.replicas.localize(plan)
        active = self.replicas.is_active(local)
        devices = stage_devices(local, self.ranks, self.replicas)
        plan = self._placing(lambda: self.engine.apply(local, active=active, devices=devices, defer_boundary=self.ranks.distributed))
        self.announce(report.plan_text(plan))
        self._arm_self_check()
        # Like Lightning's own metrics: to the loggers while fitting only, never at validate/test/predict.
        if self.ranks.global_rank == 0 and self.loop.fitting:
            self.loop.log_metrics(report.plan_metrics(plan))

    def _placing(self, apply: Callable[[], Plan]) -> Plan:
        """``apply()`` (a plan made the one in force); the optimizer state follows blocks that moved between devices
        (K 4 -> 2); then, only where blocks left a device of this process, the allocator's cache is emptied
        (:func:`~lightning_pipetransformer.devices.streams.release_cached_memory`): the devices left keep no cached
        blocks for the replica that takes them over, and a plan change that moves no block (the boundary alone, a
        plan applied again) keeps the cache warm. Decided from where the blocks' tensors are before and after, not
        from the plans: a runner places blocks its own way (the cache's frozen prefix)."""
        before = dev.module_devices(self.stack.blocks)
        plan = apply()
        if self.is_active:
            dev.optimizer_state_to_param_devices(self.loop.optimizers())
        left = dev.devices_left(before, dev.module_devices(self.stack.blocks))
        if left:
            dev.release_cached_memory(left)
        return plan

    def _arm_self_check(self) -> None:
        """While fitting: the next training pass through the new runner is compared with the plain loop (stack/self_check.py)."""
        if not self.self_check or not self.loop.fitting:
            return
        runner = installed_pipeline(self.stack.container)
        if runner is not None:
            what = "the activation cache" if isinstance(runner, CachedStack) else "the pipeline"
            arm_self_check(self.stack.container, SelfCheck(self.stack.blocks, what, announce=self.announce))

    # ------------------------------------------------------------------ freeze points and the transition

    def on_freeze_point(self, autofreeze: FreezeSource, epoch_start: bool) -> None:
        """One process re-plans now, also inside an epoch; several change replicas together, at epoch starts only."""
        if self.engine.plan is None:  # not set up
            return
        if self.ranks.distributed:
            if epoch_start:
                self.transition(autofreeze)
            return
        num_frozen = self._target_frozen(autofreeze)
        if num_frozen != self.engine.plan.num_frozen:
            self.apply(self.engine.propose(num_frozen))

    def transition(self, autofreeze: FreezeSource | None) -> None:
        """The AutoDP transition, on every rank at a train-epoch start, every step in order, under one SIGTERM hold.

        1. agree on rank 0's plan and what changes (:class:`~lightning_pipetransformer.plan.change.PlanChange`);
        2. drop DDP (its reducer holds the old group and frozen set; blocks must not move under it);
        3. this rank's pipeline for the new plan (none on a shadow rank);
        4. a new active group; the ranks that join receive weights and loop state;
        5. DDP (or the average by hand) over the active group;
        6. the training data re-split over the replicas;
        7. the cache boundary opened on every rank together, old entries advanced in shards.
        """
        old = self.engine.plan
        if old is None:
            return
        replicas, rank = self.replicas, self.ranks.global_rank
        with faults.signals_held():  # every rank is in collectives: a SIGTERM waits for their end
            clock = PhaseClock()
            change = PlanChange.between(old, self.agree(autofreeze))  # 1
            clock.lap("plan_broadcast")
            if change.rebuild:
                assert isinstance(replicas, Elastic)
                self.loop.drop_gradient_sync()  # 2
                # 3: the ranks already active first (blocks off the GPUs they leave, caches freed), then the joiners.
                replicas.place_in_turn(lambda: self.apply(change.new), joining=rank in change.joining)
                clock.lap("partition")
                old_group = replicas.active_group
                if change.regroup:  # 4
                    self.loop.restart_metric_order()
                    replicas.regroup(change.new.active_ranks)
                    clock.lap("new_group")
                    if self.is_active:
                        self.send_state(autofreeze, change.joining, clock)
                if self.is_active:
                    groups.point_metrics_at(self.loop.module, replicas.active_group)
                self.loop.sync_gradients()  # 5: the joining ranks hold rank 0's weights already
                if change.regroup:
                    replicas.release(old_group, was_member=rank in old.active_ranks)
                clock.lap("ddp_rebuild")
                if change.resplit:  # 6 (the batch size too under batch_policy='global')
                    self.loop.rebuild_train_loader()
                    clock.lap("loader_rebuild")
                self.last_transition = clock.laps
            self.sync_cache_boundary()  # 7
        # A signal that came during the transition (held until now): every rank stops before the epoch's first batch.
        self.agree_on_signal("the transition")

    def send_state(self, autofreeze: FreezeSource | None, joining: Sequence[int], clock: PhaseClock) -> None:
        """Rank 0's weights to ``joining`` (buffers to every replica), then its optimizer, LR-scheduler and scaler state."""
        replicas, rank, device = self.replicas, self.ranks.global_rank, self.ranks.root_device
        assert isinstance(replicas, Elastic)
        joining = tuple(joining)
        replicas.send_weights(self.loop.module, joining, device)
        clock.lap("model_state")
        optimizers = self.loop.optimizers()
        schedulers, scaler = self.loop.loop_state()
        state = None
        if rank == 0:
            state = loop_state.replica_state(optimizers, schedulers, scaler, state_transfer.frozen_for_good(autofreeze))
        state = replicas.send_state(state, joining, device)
        if rank in joining:
            loop_state.load_replica_state(state, optimizers, schedulers, scaler)
        clock.lap("optimizer_state")

    def sync_cache_boundary(self) -> None:
        """Several processes: open the plan's cache boundary on every rank and advance the old entries together, once per boundary."""
        plan, group = self.engine.plan, self.replicas.control_group
        if self.cache is None or plan is None or group is None or plan.num_frozen == self._synced_boundary:
            return
        self._synced_boundary = plan.num_frozen
        self.cache.sync_boundary(group, self.ranks.node_rank)

    # ------------------------------------------------------------------ every step: a new pass, the model followed

    def new_pass(self, stage: str, batch_idx: int | None) -> None:
        """A step that begins a pass: the cache compares the frozen weights' bits too before it serves (cache/watch.py),
        which sees writes no version counter does (``param.data``). At every validation, test and predict run and
        every training epoch; when training resumes after validation, only if the validation saw a change (weights
        swapped in for it, Lightning's EMA/SWA, must be seen swapped back)."""
        cache, begins = self.cache, stage != self._last_stage or batch_idx == 0
        if cache is not None and begins and (stage != "train" or batch_idx == 0 or cache.changed is not None):
            cache.new_pass()
        if cache is not None and begins:
            cache.indices.new_pass()  # index keys: the pass's first forwards probe what reaches the model
        self._last_stage = stage

    def follow_the_model(self, batch_idx: int, autofreeze: FreezeSource | None) -> None:
        """Before every training step: the plan and the cache follow what is frozen now and what computed the
        cache's entries, whoever froze, unfroze, edited or swapped them (a callback, ``BaseFinetuning``, the user),
        not only AutoFreeze. One process re-plans before this step; several agree at each epoch's first step."""
        engine, plan, stack, cache = self.engine, self.engine.plan, self.stack, self.cache
        if plan is None:
            return
        frozen_now = untrainable_prefix(stack)
        change = cache.prefix_change() if cache is not None and self.is_active else None
        if change is not None and change.transient:
            change = None  # a mode or a hook, not the weights: the cache stands aside while it differs, its entries kept
        # A block replaced by another module object (layers[i] = ...): the runner still holds the old one.
        replaced = replaced_blocks(stack)
        if replaced:
            gone = PrefixChange((f"block(s) {', '.join(map(str, replaced))} of the stack replaced by other module objects",))
            if change is None and cache is not None and replaced[0] < plan.num_frozen:
                cache.counters.prefix_changes += 1
                change = gone
        if self.ranks.distributed:
            self._follow_together(batch_idx, frozen_now, change, autofreeze)
            return
        if frozen_now == plan.num_frozen and change is None and not replaced:
            return
        why = (
            change.describe() if change is not None else gone.describe() if replaced
            else f"the leading {frozen_now} block(s) have no trainable parameter now"
        )
        self.announce(f"PipeTransformer: the plan follows the model ({why}): {plan.num_frozen} -> {frozen_now} frozen blocks.")
        if cache is not None and change is not None:
            cache.retire()
        self.apply(engine.propose(frozen_now))

    def _follow_together(self, batch_idx: int, frozen_now: int, change: PrefixChange | None, autofreeze: FreezeSource | None) -> None:
        """Several processes: what trains changes with the replicas, at epoch starts, on every rank together (one
        small collective per epoch). Inside an epoch the cache stands aside while its prefix differs (exact), and a
        block unfrozen there is refused: DDP would leave its gradient out of the average."""
        plan, cache = self.engine.plan, self.cache
        assert plan is not None
        if batch_idx != 0:
            if frozen_now < plan.num_frozen:
                raise RuntimeError(
                    f"Block {frozen_now} was unfrozen inside an epoch, with several processes: its gradient would not be "
                    "averaged over the replicas until the next epoch start, where every rank re-plans together. Unfreeze "
                    "in on_train_epoch_start (Lightning's BaseFinetuning.finetune_function runs there), or use one process."
                )
            return
        wants = torch.tensor([int(frozen_now != plan.num_frozen or change is not None)], dtype=torch.int64)
        torch.distributed.all_reduce(wants, op=torch.distributed.ReduceOp.MAX, group=self.replicas.control_group)
        if not int(wants):
            return
        if cache is not None:
            cache.retire()  # every rank: the boundary opens again on all of them together
        self._synced_boundary = None
        self.transition(autofreeze)
        now = self.engine.plan
        replicas = now.active_ranks if now is not None else ()
        if frozen_now < plan.num_frozen and len(replicas) > 1 and self.is_active:
            # A replica that joined while these blocks were frozen holds no optimizer state for them (it was not sent):
            # every replica takes rank 0's now, or their updates of the thawed blocks would differ.
            self.send_state(autofreeze, tuple(r for r in replicas if r != 0), PhaseClock())
        if cache is not None and now is plan:  # nothing rebuilt: reopen the same boundary, on every rank together
            devices = stage_devices(plan, self.ranks, self.replicas)
            self._placing(lambda: self.engine.apply(plan, active=self.is_active, devices=devices, defer_boundary=True))
            self._synced_boundary = None
            with faults.signals_held():
                self.sync_cache_boundary()

    # ------------------------------------------------------------------ failures and signals: every rank together

    def step_together(self, where: str, run: Callable[[], Any]) -> Any:
        """``run`` (this rank's step, or a shadow rank's stand-in), then, with several processes, the step's
        agreement over the control group (:func:`~lightning_pipetransformer.dp.faults.agree_at_step`): a failure
        one rank alone reaches (its step raised, a cache verdict) ends every rank within seconds, instead of
        leaving them in DDP until the timeout, and a signal any rank received stops every rank after this same batch."""
        group, cache = self.replicas.control_group, self.cache
        if group is None:
            return run()
        if cache is not None:
            cache.verdicts.defer = True
        error: BaseException | None = None
        output = None
        try:
            output = run()
        except Exception as err:  # noqa: BLE001 - raised below, on every rank together
            error = err
        if error is None and cache is not None:
            error = cache.verdicts.take()
        try:
            signum = faults.agree_at_step(error, self.signals.signum, group, where)
        except BaseException as raised:
            # Every rank raises here (a broken collective is not that): their exception hooks meet.
            self.failing_together = raised is error or isinstance(raised, faults.PeerFailedError)
            raise
        if signum and not self.stopping_signal:
            self._stop_for_signal(signum)
        return output

    def agree_on_signal(self, where: str) -> None:
        """Outside a step (after a transition): whether any rank received a signal, agreed on every rank."""
        group = self.replicas.control_group
        if group is not None and not self.stopping_signal:
            signum = faults.agree_at_step(None, self.signals.signum, group, where)
            if signum:
                self._stop_for_signal(signum)

    def _stop_for_signal(self, signum: int) -> None:
        """Every rank agreed at this step that a signal came: Lightning's loops stop after this batch
        (``SIGTERMException``, with the ``on_exception`` checkpoints), on every rank together."""
        self.stopping_signal = signum
        self.loop.stop_after_this_batch()
        self.announce(
            f"PipeTransformer: {signal.Signals(signum).name} received; every rank stops after this batch "
            "(the checkpoints Lightning writes on an exception are written)."
        )
