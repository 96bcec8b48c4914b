"""How the run's processes share the work: one process, or elastic replicas. Data in, data out.

* :class:`OneProcess`: one process drives every plan on virtual stages of its own device;
  nothing is agreed, grouped or sent.
* :class:`Elastic`: several processes (AutoDP). Global rank 0 decides; :meth:`Elastic.agree`
  hands its message to every rank and checks they are in lock-step; :meth:`Elastic.regroup`
  makes the group of the active ranks; :meth:`Elastic.send_weights` and
  :meth:`Elastic.send_state` bring the ranks that join up to date.
* :class:`Ranks` and :func:`stage_devices`: where this process stands, and the devices its
  pipeline stages run on under a plan (none on a shadow rank).

Both take ranks, the backend, the timeout, plans, modules and state dicts, and return data; they
never see the strategy or the trainer (the strategy's transition composes them, in order), which
is why ``tests/unit/dp/test_replicas.py`` can drive them with fake groups. Which collective runs
on which group: :mod:`lightning_pipetransformer.dp.groups`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from lightning_pipetransformer.dp import faults, groups, state_transfer
from lightning_pipetransformer.plan import Plan

__all__ = ["Elastic", "LockStepError", "OneProcess", "Ranks", "Replicas", "stage_devices"]


class LockStepError(RuntimeError):
    """A rank reached a transition at another (epoch, step) than rank 0: a bug, never a user error."""


class OneProcess:
    """One process in all: every plan runs here, on virtual stages of this process's device."""

    control_group: Any = None
    active_group: Any = None
    active_host_group: Any = None
    peers: list[tuple[str, int]] = []
    decides_here = True

    def is_active(self, plan: Plan | None) -> bool:
        return True

    def sampler_kwargs(self, plan: Plan | None) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}

    def localize(self, plan: Plan) -> Plan:
        """One process cannot add data-parallel replicas: it keeps its single pipeline."""
        return dataclasses.replace(plan, devices=plan.devices[:1], active_ranks=(0,))

    def close(self) -> None:
        """No groups to free."""


class Elastic:
    """Several processes (AutoDP): rank 0 decides, every rank applies, joiners receive state."""

    def __init__(self, global_rank: int, world_size: int, backend: str, timeout: timedelta) -> None:
        self.global_rank = global_rank
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        #: All ranks, static: plan broadcast, barrier, boolean decisions, new_group.
        self.control_group: Any = None
        #: The ranks that drive a replica under the current plan, rebuilt when they change.
        self.active_group: Any = None
        #: The active group's gloo twin (itself under gloo): flags the hosts hold, without a device round trip.
        self.active_host_group: Any = None
        #: (host, pid) per rank, to name a rank that died.
        self.peers: list[tuple[str, int]] = []

    @property
    def decides_here(self) -> bool:
        """Only global rank 0's rule decides: the others' (absent or stale) gradient norms could
        freeze blocks rank 0 keeps training; they take its decision with the plan."""
        return self.global_rank == 0

    def is_active(self, plan: Plan | None) -> bool:
        return plan is None or plan.is_active(self.global_rank)

    def sampler_kwargs(self, plan: Plan | None) -> dict[str, Any]:
        """The data is split over the active replicas only. A shadow rank asks for an active
        replica's share, so its (stand-in) loader has the same length as everyone's."""
        if plan is None:
            return {"num_replicas": self.world_size, "rank": self.global_rank}
        rank = plan.replica_index(self.global_rank) if plan.is_active(self.global_rank) else 0
        return {"num_replicas": plan.num_replicas, "rank": rank}

    def localize(self, plan: Plan) -> Plan:
        return plan

    def connect(self) -> None:
        """The control group over all ranks and the peers' (host, pid); every rank calls this once per fit."""
        self.control_group = groups.control_group(self.backend, self.timeout)
        self.peers = faults.peer_processes(self.control_group)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank, over the control group."""
        return groups.broadcast_object(obj, src=0, group=self.control_group)

    def agree(self, message: dict[str, Any] | None, step: tuple[int, int]) -> dict[str, Any]:
        """Rank 0's ``message`` on every rank; raises :class:`LockStepError` where ``step`` (epoch,
        global step) differs from rank 0's. Other ranks pass None."""
        if self.global_rank == 0:
            assert message is not None, "rank 0 proposes the plan"
            message = {**message, "step": list(step)}
        message = self.broadcast(message)
        if tuple(message["step"]) != tuple(step):
            raise LockStepError(
                f"Rank {self.global_rank} is at (epoch, global_step) {tuple(step)} but rank 0 at {tuple(message['step'])}: "
                "idle ranks fell out of lock-step with the replicas. This is a bug in strategy='pipetransformer'; "
                "please report it with your Trainer arguments."
            )
        return message

    def regroup(self, active_ranks: tuple[int, ...]) -> Any:
        """A new group over ``active_ranks`` (every rank calls this, in the same order); returns the previous one."""
        previous, self.active_group = self.active_group, groups.active_group(active_ranks, self.backend, self.timeout)
        old_twin = self.active_host_group
        self.active_host_group = groups.host_twin(self.active_group, active_ranks, self.backend, self.timeout)
        if old_twin is not previous:  # nothing uses it now: the average by hand was dropped before a regroup
            groups.destroy_group(old_twin)
        return previous

    def release(self, group: Any, was_member: bool) -> None:
        """Free a group no longer used (its communicators would otherwise live as long as the process)."""
        if group is not None and group is not self.active_group and was_member:
            groups.destroy_group(group)

    def place_in_turn(self, apply: Callable[[], None], joining: bool) -> None:
        """``apply`` (this rank's part of a new plan: blocks placed on their stages' GPUs) with the
        ranks that were already active first, then, after a barrier over every rank, the joining ones.

        Why: a joining rank places its whole replica on GPUs that the shrinking pipeline of another
        rank held stages on; placed at once, such a GPU would hold the old stage and the new replica
        together. The ranks already active move their blocks off those GPUs and release the cached
        memory first (``apply`` does), so a GPU's peak is the larger of the two, not their sum.
        Costs one barrier over the gloo control group per transition that rebuilds.
        """
        if not joining:
            apply()
        groups.barrier(self.control_group)
        if joining:
            apply()

    def close(self) -> None:
        """Free this trainer call's groups; every rank calls this at teardown, in the same order.

        Each trainer call (fit, then validate, then test) connects anew: without this every call
        would leave a gloo control group and an NCCL communicator (with its device buffers) alive
        for the rest of the process. WORLD (the control group under gloo) is Lightning's and stays;
        a shadow rank holds no communicator of the active group.
        """
        active, control, twin = self.active_group, self.control_group, self.active_host_group
        self.active_group = self.control_group = self.active_host_group = None
        self.peers = []
        if twin is not active:
            groups.destroy_group(twin)
        groups.destroy_group(active)
        groups.destroy_group(control)

    def send_weights(self, module: nn.Module, joining: tuple[int, ...], via: torch.device) -> None:
        """Rank 0's parameters to ``joining`` and its buffers to every replica (active ranks only)."""
        state_transfer.broadcast_module_state(module, src=0, group=self.active_group, receivers=list(joining), via=via)

    def send_state(self, state: dict[str, Any] | None, joining: tuple[int, ...], via: torch.device) -> dict[str, Any] | None:
        """Rank 0's ``state`` (nested tensors and plain data) to ``joining``; they get it back, the others None."""
        return state_transfer.broadcast_state(state, src=0, group=self.active_group, receivers=list(joining), via=via)


#: What the strategy holds: one of the two, picked at ``setup_environment``.
Replicas = OneProcess | Elastic


@dataclasses.dataclass(frozen=True)
class Ranks:
    """Where this process stands: its ranks, its device, and whether several processes take part."""

    global_rank: int = 0
    local_rank: int = 0
    node_rank: int = 0
    num_processes: int = 1
    root_device: torch.device = torch.device("cpu")
    distributed: bool = False


def stage_devices(plan: Plan | None, ranks: Ranks, replicas: Replicas) -> tuple[torch.device, ...]:
    """The devices this process's pipeline stages run on under ``plan`` (none on a shadow rank)."""
    if plan is None:
        return (ranks.root_device,)
    if ranks.num_processes == 1:
        return (ranks.root_device,) * plan.pipe_len
    if not replicas.is_active(plan):
        return ()
    return tuple(torch.device(d) for d in plan.devices_for(ranks.local_rank))
