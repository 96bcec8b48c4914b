"""How the run's processes share the work, picked once per fit: one process, or elastic replicas.

The strategy asks the object it picked at ``setup_environment`` instead of branching on the
world size: whether this process drives a replica, how the sampler splits the data, where a
plan comes from, what a freeze point does, and how the cache opens a boundary.

* :class:`OneProcess`: one process drives every plan on virtual stages of its own device.
  A freeze point re-plans at once (also inside an epoch); nothing is agreed, sent or split.
* :class:`Elastic`: several processes (AutoDP). Global rank 0 decides, every rank applies its
  plan at each train-epoch start (:class:`~lightning_pipetransformer.dp.transition.TransitionCallback`),
  ranks that join receive the replicas' state, and the sampler is re-split over the replicas.
  Which collective runs on which group: :mod:`lightning_pipetransformer.dp.groups`.

Neither imports Lightning directly: they work on the trainer and strategy objects they are given,
and reach Lightning's private parts only through :mod:`lightning_pipetransformer.lightning_internals`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from lightning_pipetransformer import devices as dev
from lightning_pipetransformer import lightning_internals
from lightning_pipetransformer.dp import faults, groups, idle_hooks, state_transfer, transition
from lightning_pipetransformer.plan import Plan

if TYPE_CHECKING:
    from lightning_pipetransformer.strategy import PipeTransformerStrategy

__all__ = ["Elastic", "OneProcess", "Replicas"]


class OneProcess:
    """One process in all: every plan runs here; a freeze point re-plans at once."""

    control_group: Any = None
    active_group: Any = None
    peers: list[tuple[str, int]] = []

    def __init__(self, strategy: PipeTransformerStrategy) -> None:
        self.strategy = strategy

    def is_active(self, plan: Plan | None) -> bool:
        return True

    @property
    def decides_here(self) -> bool:
        return True

    def sampler_kwargs(self, plan: Plan | None) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}

    def first_plan(self, trainer: Any, autofreeze: Any, num_frozen: int) -> Plan:
        assert self.strategy.planner is not None
        return self.strategy.planner.plan(num_frozen)

    def localize(self, plan: Plan) -> Plan:
        """One process cannot add data-parallel replicas: it keeps its single pipeline."""
        return dataclasses.replace(plan, devices=plan.devices[:1], active_ranks=(0,))

    def on_freeze(self, num_frozen: int) -> None:
        """AutoFreeze froze more blocks (an epoch start or a sub-epoch freeze point): re-plan now."""
        strategy = self.strategy
        assert strategy.planner is not None
        strategy._apply_plan(strategy.planner.plan(num_frozen), announce=True)

    def transition(self, trainer: Any, autofreeze: Any) -> None:
        """Nothing to agree on: :meth:`on_freeze` applied the plan already."""

    def open_boundary(self, cache: Any, stack: Any, num_frozen: int, include_pre: bool, device: Any) -> None:
        """Open the store of the new boundary; the previous entries advance as they are read (all of them here)."""
        cache.move_boundary(stack, num_frozen, include_pre, device, shard=(0, 1), lazy=True)


class Elastic:
    """Several processes (AutoDP): rank 0 decides, all apply at epoch starts, joiners receive state."""

    def __init__(self, strategy: PipeTransformerStrategy) -> None:
        self.strategy = strategy
        #: All ranks, static: plan broadcast, barrier, boolean decisions, new_group.
        self.control_group: Any = None
        #: The ranks that drive a replica under the current plan, rebuilt when they change.
        self.active_group: Any = None
        #: (host, pid) per rank, to name a rank that died.
        self.peers: list[tuple[str, int]] = []

    def is_active(self, plan: Plan | None) -> bool:
        return plan is None or plan.is_active(self.strategy.global_rank)

    @property
    def decides_here(self) -> bool:
        """Only global rank 0's rule decides: the others' (absent or stale) gradient norms could
        freeze blocks rank 0 keeps training; they take its decision with the plan."""
        return self.strategy.global_rank == 0

    def sampler_kwargs(self, plan: Plan | None) -> dict[str, Any]:
        # The data is split over the active replicas only. A shadow rank asks for an active
        # replica's share, so its (stand-in) loader has the same length as everyone's.
        strategy = self.strategy
        if plan is None:
            return {"num_replicas": strategy.world_size, "rank": strategy.global_rank}
        rank = plan.replica_index(strategy.global_rank) if plan.is_active(strategy.global_rank) else 0
        return {"num_replicas": plan.num_replicas, "rank": rank}

    def first_plan(self, trainer: Any, autofreeze: Any, num_frozen: int) -> Plan:
        """Agree on rank 0's plan and make the active group before DDP wraps on it."""
        strategy = self.strategy
        assert strategy.planner is not None
        backend = strategy._get_process_group_backend()
        self.control_group = groups.control_group(backend, strategy._timeout)
        self.peers = faults.peer_processes(self.control_group)
        if strategy._autocache is not None:
            # One namespace for the node's processes: index i names the same sample on every
            # rank (one dataset, split by the sampler), so replicas share index-keyed entries.
            strategy._autocache.namespace = groups.broadcast_object(strategy._autocache.namespace, src=0, group=self.control_group)
        plan = self.agree(trainer, autofreeze, strategy.planner.plan(num_frozen) if strategy.global_rank == 0 else None)
        self.active_group = groups.active_group(plan.active_ranks, backend, strategy._timeout)
        if trainer.state.fn == "fit" and not any(isinstance(c, transition.TransitionCallback) for c in trainer.callbacks):
            # Right after AutoFreeze (or first): later callbacks see the new loader length.
            at = next((i + 1 for i, c in enumerate(trainer.callbacks) if c is autofreeze), 0)
            trainer.callbacks.insert(at, transition.TransitionCallback(strategy))
        self._prepare_idle_ranks(trainer, plan)
        return plan

    def _prepare_idle_ranks(self, trainer: Any, plan: Plan) -> None:
        """Idle ranks skip the module's batch and epoch-end hooks and get rank 0's metrics."""
        module = self.strategy.lightning_module
        assert module is not None
        idle_hooks.skip_module_hooks_when_idle(
            module,
            lambda: self.strategy.is_active,
            after={"on_train_epoch_end": lambda: idle_hooks.share_callback_metrics(trainer, self.strategy.is_active, self.control_group)},
        )
        if self.is_active(plan):  # torchmetrics sync over the replicas, not WORLD (idle ranks never compute)
            groups.point_metrics_at(module, self.active_group)
        trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, idle_hooks.ShareMetrics)]
        # First of all callbacks: its on_validation_end runs before the monitoring ones read metrics.
        trainer.callbacks.insert(0, idle_hooks.ShareMetrics(self.strategy, idle_hooks.monitors_every_n_steps(trainer)))

    def localize(self, plan: Plan) -> Plan:
        return plan

    def on_freeze(self, num_frozen: int) -> None:
        """Only some ranks get here (a shadow rank's rule may see no gradients), and a change of
        replicas must happen on all of them together: :meth:`transition` runs at the next
        train-epoch start, on every rank."""

    def open_boundary(self, cache: Any, stack: Any, num_frozen: int, include_pre: bool, device: Any) -> None:
        """A new replica gets its weights after the plan is applied (the store's name is their
        fingerprint), so the store opens in BoundarySync, where all ranks advance the previous
        boundary's entries together (see docs/cache.md)."""
        cache.defer_boundary(stack, num_frozen, include_pre, device)

    def transition(self, trainer: Any, autofreeze: Any) -> None:
        """One AutoDP transition, on every rank at a train-epoch start, right after AutoFreeze.

        AutoFreeze decided F -> rank 0 broadcasts (F, K, M, active ranks) -> partitions rebuilt ->
        groups + DDP rebuilt, state sent to new ranks -> sampler re-split -> next epoch.
        """
        strategy = self.strategy
        if strategy.planner is None or strategy.plan is None:
            return
        old = strategy.plan
        clock = transition.PhaseClock()
        # 1-2. AutoFreeze has decided F on every rank; rank 0's F and plan are the ones applied.
        num_frozen = autofreeze.num_frozen if autofreeze is not None else 0
        plan = self.agree(trainer, autofreeze, strategy.planner.plan(num_frozen) if strategy.global_rank == 0 else None)
        clock.lap("plan_broadcast")
        if plan.num_frozen == old.num_frozen and plan.active_ranks == old.active_ranks and plan.partition == old.partition:
            return
        # 3. Partitions rebuilt: this rank's pipeline for the new plan (none on a shadow rank). DDP
        # is dropped first: its reducer holds the old group and frozen set, and blocks must not
        # move under it.
        strategy._drop_ddp()
        strategy._apply_plan(plan, announce=True)
        clock.lap("partition")
        # 4. Groups + DDP rebuilt; ranks that were idle receive the replicas' state.
        old_group = self.active_group
        if plan.active_ranks != old.active_ranks:
            idle_hooks.restart_metric_order(trainer)
            self.active_group = groups.active_group(plan.active_ranks, strategy._get_process_group_backend(), strategy._timeout)
            clock.lap("new_group")
            if strategy.is_active:
                joining = [r for r in plan.active_ranks if r not in old.active_ranks]
                self.send_state(trainer, autofreeze, joining=joining, clock=clock)
        if strategy.is_active:
            groups.point_metrics_at(strategy.lightning_module, self.active_group)
        strategy._ddp_init_sync = False
        strategy.configure_ddp()  # DDP over the active group; frozen parameters leave its buckets
        if old_group is not self.active_group and strategy.global_rank in old.active_ranks:
            groups.destroy_group(old_group)  # its communicators would otherwise live as long as the process
        clock.lap("ddp_rebuild")
        # 5. Sampler re-split over the new replicas (batch size too under batch_policy='global').
        if plan.num_replicas != old.num_replicas:
            lightning_internals.rebuild_train_loader(trainer)
            clock.lap("loader_rebuild")
        #: Seconds per phase of the last transition on this rank (for logs and benchmarks).
        strategy.last_transition = clock.laps

    def agree(self, trainer: Any, autofreeze: Any, plan: Plan | None) -> Plan:
        """Rank 0's plan (and planner and AutoFreeze state) on every rank, over the control group; checks lock-step."""
        strategy = self.strategy
        assert strategy.planner is not None
        message = None
        if strategy.global_rank == 0:
            assert plan is not None
            message = {
                "plan": plan.to_dict(),
                "planner": strategy.planner.state_dict(),
                "autofreeze": autofreeze.state_dict() if autofreeze is not None else None,
                "step": (trainer.current_epoch, trainer.global_step),
            }
        message = groups.broadcast_object(message, src=0, group=self.control_group)
        if strategy.global_rank != 0:
            here = (trainer.current_epoch, trainer.global_step)
            if tuple(message["step"]) != here:
                raise RuntimeError(
                    f"Rank {strategy.global_rank} is at (epoch, global_step) {here} but rank 0 at {tuple(message['step'])}: "
                    "idle ranks fell out of lock-step with the replicas. This is a bug in strategy='pipetransformer'; "
                    "please report it with your Trainer arguments."
                )
            strategy.planner.load_state_dict(message["planner"])
            if autofreeze is not None and message["autofreeze"] is not None:
                # A shadow rank's own rule saw no gradients: take rank 0's decision (and state).
                autofreeze.load_state_dict(message["autofreeze"])
        return Plan.from_dict(message["plan"])

    def send_state(self, trainer: Any, autofreeze: Any, joining: list[int], clock: transition.PhaseClock) -> None:
        """Global rank 0's model, optimizer and LR-scheduler state to the ranks that join the replicas.

        Runs on every active rank. Only ``joining`` (the ranks that were idle) receive parameters and
        optimizer state: replicas that were already active hold the same (DDP kept them equal);
        buffers go to all replicas. The optimizer state of parameters AutoFreeze has frozen is not
        sent: they never thaw, so it is never read again (global rank 0, which writes
        checkpoints, keeps it). Loop counters need no transfer (shadow ranks kept them in
        lock-step, checked by :meth:`agree`) and AutoFreeze state came with the plan.
        """
        strategy, group = self.strategy, self.active_group
        state_transfer.broadcast_module_state(strategy.lightning_module, src=0, group=group, receivers=joining, via=strategy.root_device)
        clock.lap("model_state")
        state = self.replica_state(trainer, autofreeze) if strategy.global_rank == 0 else None
        state = state_transfer.broadcast_state(state, src=0, group=group, receivers=joining, via=strategy.root_device)
        if strategy.global_rank in joining:
            self.load_sent_state(trainer, state)
        clock.lap("optimizer_state")

    def replica_state(self, trainer: Any, autofreeze: Any) -> dict[str, Any]:
        """What a joining replica needs besides the weights: optimizer, LR-scheduler and loss-scaler state."""
        strategy = self.strategy
        frozen = state_transfer.frozen_for_good(autofreeze)
        scaler = getattr(strategy.precision_plugin, "scaler", None)
        return {
            "optimizers": [state_transfer.without_state_of(o.state_dict(), o, frozen) for o in strategy.optimizers],
            "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            # 16-mixed: replicas must unscale by the same factor, or they diverge silently.
            "scaler": scaler.state_dict() if scaler is not None else None,
        }

    def load_sent_state(self, trainer: Any, state: dict[str, Any]) -> None:
        strategy = self.strategy
        for optimizer, optimizer_state in zip(strategy.optimizers, state["optimizers"]):
            optimizer.load_state_dict(optimizer_state)
        dev.optimizer_state_to_param_devices(strategy.optimizers)
        for config, scheduler_state in zip(trainer.lr_scheduler_configs, state["schedulers"]):
            config.scheduler.load_state_dict(scheduler_state)
        scaler = getattr(strategy.precision_plugin, "scaler", None)
        if scaler is not None and state.get("scaler") is not None:
            scaler.load_state_dict(state["scaler"])


#: What the strategy holds: one of the two, picked at ``setup_environment``.
Replicas = OneProcess | Elastic
