"""The strategy's process-level Lightning surface: which processes take part, and which group each collective uses.

Why a base class of its own: these hooks are the same whatever the plan is (ranks, the launcher,
the world process group, and the rule that data collectives run over the active replicas while
control collectives run over every rank), and :class:`~lightning_pipetransformer.strategy.PipeTransformerStrategy`
then holds only the hooks that plan, install and transition. They ask ``self._replicas``
(:mod:`~lightning_pipetransformer.dp.replicas`) instead of branching on the world size.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_pipetransformer import devices as dev
from lightning_pipetransformer import lightning_internals
from lightning_pipetransformer.dp import faults, groups
from lightning_pipetransformer.dp.replicas import Elastic, OneProcess, Ranks, Replicas, stage_devices
from lightning_pipetransformer.plan import Plan

__all__ = ["ProcessLayout"]

#: Trainer calls set up in this process (the fault board's keys are per call).
_TRAINER_CALLS = itertools.count(1)


class ProcessLayout(ParallelStrategy):
    """One process (rank 0 of 1, no launcher, no process group), or several as under ``DDPStrategy``."""

    def __init__(self, *, pipe_len: int, process_group_backend: str | None, timeout: float, **parallel: Any) -> None:
        super().__init__(**parallel)
        self._pipe_len = pipe_len
        self._num_nodes = 1
        self._process_group_backend: str | None = process_group_backend
        self._timeout = timedelta(seconds=timeout)
        self._replicas: Replicas = OneProcess()  # one process, or several (AutoDP): picked at setup_environment
        self._board: faults.FaultBoard | None = None  # failures every rank reads without a collective
        self._watch: faults.PeerWatch | None = None  # ends this rank when another failed and it waits
        self._handled: tuple[BaseException, bool] | None = None  # the exception in hand, and whether it ended every rank together
        self._posted = False  # this rank posted the exception in hand: the first failure

    @property
    def plan(self) -> Plan | None:
        """The plan in force (the strategy's engine holds it)."""
        return None

    @property
    def is_active(self) -> bool:
        """Whether this process drives a pipeline replica now (False: a shadow rank, idle until K shrinks)."""
        return self._replicas.is_active(self.plan)

    @property
    def control_group(self) -> Any | None:
        """The group of every rank (plan broadcast, barriers, decisions); None with one process."""
        return self._replicas.control_group

    @property
    def ranks(self) -> Ranks:
        """Where this process stands (its ranks, its device), as the parts below the strategy take it."""
        return Ranks(
            global_rank=self.global_rank, local_rank=self.local_rank, node_rank=self.node_rank,
            num_processes=self.num_processes, root_device=self.root_device, distributed=self.is_distributed,
        )  # fmt: skip

    @property
    def stage_devices(self) -> tuple[torch.device, ...]:
        """The devices this process's pipeline stages run on (none on a shadow rank)."""
        return stage_devices(self.plan, self.ranks, self._replicas)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self._replicas.sampler_kwargs(self.plan)

    # ------------------------------------------------------------------ one process, or several
    #
    # Lightning gives the strategy its devices after construction (the accelerator connector sets
    # parallel_devices and num_nodes, then calls _configure_launcher). With one process in all there
    # is nothing to distribute: no launcher (notebooks and `python -i` work), no process group, no
    # re-seeding, and `is_distributed` is False (the batch-size finder works, the user's sampler is
    # kept). With several, it behaves like DDPStrategy, whose set-up it follows.

    @property
    def is_distributed(self) -> bool:
        """Whether more than one process takes part (Lightning's connector reads this)."""
        return self.num_nodes * self.num_processes > 1

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    # One process is rank 0 of 1, whatever the cluster environment says (as under the single-device
    # strategy): a SLURM or torchelastic job of one task must not need more.
    @property
    @override
    def global_rank(self) -> int:
        return super().global_rank if self.is_distributed else 0

    @property
    @override
    def local_rank(self) -> int:
        return super().local_rank if self.is_distributed else 0

    @property
    @override
    def node_rank(self) -> int:
        return super().node_rank if self.is_distributed else 0

    @property
    @override
    def world_size(self) -> int:
        return super().world_size if self.is_distributed else 1

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # Called when the Trainer is built, once the devices are known: refuse a pipe length that
        # cannot tile them now, not in every process after they started.
        pipe_len = self._pipe_len
        if self.num_processes > 1 and self.num_processes % pipe_len:
            divisors = [k for k in range(1, self.num_processes + 1) if self.num_processes % k == 0]
            raise ValueError(
                f"pipe_len={pipe_len} must divide the {self.num_processes} devices per node (each pipeline replica "
                f"spans pipe_len of them, and the freed ones become replicas): use pipe_len in {divisors}, or "
                f"Trainer(devices=...) a multiple of {pipe_len}."
            )
        self._launcher = (
            lightning_internals.SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
            if self.is_distributed else None
        )  # fmt: skip

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        dev.bind_process_device(self.root_device)
        self._replicas = OneProcess()
        if self.is_distributed:  # DDPStrategy.setup_distributed: the seed, the ranks, the world process group
            reset_seed()
            self.set_world_ranks()
            self._process_group_backend = self._get_process_group_backend()
            assert self.cluster_environment is not None
            device_id = self.root_device if self.root_device.type != "cpu" else None
            lightning_internals.init_dist_connection(
                self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
            )
            self._replicas = Elastic(self.global_rank, self.world_size, self._process_group_backend, self._timeout)
            self._start_watch()
            trainer = lightning_internals.attached_trainer(self.lightning_module)
            if trainer is not None:
                PostFailureFirst.install(trainer, self._post_failure)

    @override
    def teardown(self) -> None:
        trainer = lightning_internals.attached_trainer(self.lightning_module)
        if trainer is not None:
            PostFailureFirst.remove(trainer)
        super().teardown()

    # ------------------------------------------------------------------ failures: every rank ends within seconds, naming the cause
    #
    # A rank that fails outside the step's agreement (backward, the optimizer step, a callback, the
    # transition) leaves the others in a collective that, under NCCL, never returns. It posts its
    # error to the rendezvous store; every rank's PeerWatch reads it and ends its own rank within
    # seconds; the launcher's rank ends the children it started. See docs/autodp.md, "Operations".

    def _start_watch(self) -> None:
        self._stop_watch(finished=False)  # a watch of an earlier call on this strategy object ends first
        self._handled = None
        # Per trainer call in this process, whatever strategy object makes it: the default store outlives
        # trainers, and an earlier call's posted failure must not end a later, healthy one. Every rank
        # makes the same calls in the same order, so the numbers agree.
        self._board = faults.FaultBoard.for_default_group(self.global_rank, self.world_size, next(_TRAINER_CALLS))
        children = self._launched_children()
        if children:  # it would SIGKILL every process, rank 0 too, without a word: the watch names the child instead
            lightning_internals.stop_child_process_observer()
        self._watch = faults.PeerWatch(self._board, children, unwinding=self._unwinding)
        self._watch.start()

    def _launched_children(self) -> dict[int, Any]:
        """The processes this rank launched (``Popen``; Lightning's subprocess launcher on a node's
        local rank 0), by global rank: local rank ``i`` of node ``n`` is rank ``n * num_processes + i``."""
        procs = list(getattr(self._launcher, "procs", None) or [])
        return {self.node_rank * self.num_processes + i: proc for i, proc in enumerate(procs, start=1)}

    def _unwinding(self) -> bool:
        """Whether Lightning handles an exception on this rank now (its hooks run; read from the watch's thread)."""
        trainer = lightning_internals.attached_trainer(self.lightning_module)
        return trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED

    def _stop_watch(self, finished: bool) -> None:
        """Stop this rank's watch; at a normal end (``finished``) post that this rank finished, and on
        rank 0 wait (bounded) for the others. A rank that failed after the last collective (at the
        end of training) would otherwise leave rank 0, whose exit status is the job's under
        Lightning's launcher, ending with success and naming nobody: rank 0 raises
        :class:`~lightning_pipetransformer.dp.faults.PeerFailedAtEndError` then (its exception hooks
        name the rank and end the children it launched)."""
        if self._watch is not None:
            self._watch.stop()
        if finished and self._board is not None:
            self._board.finish()
            if self.global_rank == 0:
                children = self._launched_children()
                failed = self._board.wait_finished(timeout=10.0, exited=lambda: _ended_silently(children))
                if failed:
                    rank = min(failed)
                    raise faults.PeerFailedAtEndError(
                        f"rank {rank} failed after the fit's last step on every rank ({failed[rank]}), so the fit "
                        f"fails on rank {self.global_rank} too."
                    )

    def _ended_together(self, exception: BaseException) -> bool:
        """Whether every rank raised at the same point (a signal or a failure they agreed on): the others
        then run the same exception hooks (their barriers meet). The strategy says which."""
        return isinstance(exception, faults.PeerFailedError)

    def _post_failure(self, exception: BaseException) -> bool:
        """Once per exception, on the first hook that sees it (:class:`PostFailureFirst`, before any other
        callback's ``on_exception``): post this rank's error when it is the first failure (not one every
        rank agreed on, not a peer's failure seen as a broken collective), and stop the watch then (the
        others' ends are this failure's consequence). Returns whether every rank ended together.

        A peer's failure leaves the watch running through the callbacks' hooks (a checkpoint that waits
        in a collective for a dead peer still ends); :meth:`_note_failure` stops it."""
        if self._handled is not None and self._handled[0] is exception:
            return self._handled[1]
        together = self._ended_together(exception)
        self._handled, self._posted = (exception, together), False
        # Rank 0's PeerFailedAtEndError names a peer's failure: rank 0 did not fail first, and posts nothing.
        if not together and self._board is not None and not isinstance(exception, faults.PeerFailedAtEndError):
            try:
                if not self._board.failures() and not _broken_collective(exception):
                    self._stop_watch(finished=False)
                    self._board.post(faults.describe(exception))
                    self._posted = True
            except Exception:  # noqa: BLE001 - the store went with rank 0: nothing to post to
                pass
        return together

    def _note_failure(self, exception: BaseException) -> bool:
        """:meth:`_post_failure`, and stop the watch: this rank's own hooks end it from here (the strategy's
        ``on_exception``, or a barrier the others will not join). Returns whether every rank ended together."""
        together = self._post_failure(exception)
        self._stop_watch(finished=False)
        return together

    def _exception_in_hand(self) -> BaseException | None:
        """The exception this rank handles now: Lightning calls the callbacks' ``on_exception`` (checkpoints,
        barriers) inside its ``except`` block, with the trainer's status INTERRUPTED."""
        trainer = lightning_internals.attached_trainer(self.lightning_module)
        if trainer is None or trainer.state.status != TrainerStatus.INTERRUPTED:
            return None
        return sys.exc_info()[1]

    def _name_failed_peers(self, exception: BaseException) -> None:
        """Add to ``exception`` which other rank failed first (posted), or whose process is gone."""
        if self._board is None or not exception.args or not isinstance(exception.args[0], str):
            return
        lines = []
        try:
            posted = self._board.failures()
        except Exception:  # noqa: BLE001 - the store went with its host, rank 0
            posted = {}
        lines += [f"rank {r} failed first: {text}" for r, text in sorted(posted.items())]
        if posted:
            with contextlib.suppress(Exception):
                self._board.acknowledge()
        peers = self._replicas.peers
        # A process just killed is not gone yet when its peer's collective breaks: look for a while.
        # PeerFailedAtEndError names its rank itself (no collective failed).
        look = peers and not isinstance(exception, faults.PeerFailedAtEndError)
        gone = faults.dead_peers(peers, wait=0.0 if posted or not _broken_collective(exception) else 2.0) if look else []
        if gone:
            named = ", ".join(f"rank {r} (pid {peers[r][1]})" for r in gone)
            lines.append(
                f"{named} on this host is gone (it died or was killed): rank {self.global_rank}'s collective failed "
                "because of it. Look at that rank's log for the cause."
            )
        if lines:
            exception.args = (exception.args[0] + "".join(f"\n[pipetransformer] {line}" for line in lines), *exception.args[1:])

    def _end_after_failure(self, exception: BaseException) -> None:
        """After this rank's exception hooks: let the others read a posted failure, then (on the launcher's
        rank) give the children it started a few seconds to end, and end the rest."""
        self._note_failure(exception)
        if self._board is not None:
            self._board.handled()
            if self._posted:
                self._board.wait_seen(timeout=3.0)
        children = list(self._launched_children().values())
        if children:
            # Stopped together (an agreed signal or failure), every child runs its own exception hooks
            # (Lightning's checkpoint): wait for them far longer than for a child that may never return,
            # and, once every rank ran them, 10 s for their teardown and exit.
            handled = self._board.all_handled if self._board is not None else None
            killed = faults.end_children(
                children, grace=25.0 if self._ended_together(exception) else 10.0, handled=handled, exit_grace=10.0
            )
            if killed:
                print(f"[pipetransformer] rank 0: ended the ranks it launched that were still running (pids {killed}).",
                      file=sys.stderr, flush=True)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None and self.is_distributed:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or lightning_internals.default_process_group_backend(self.root_device)

    # ------------------------------------------------------------------ collectives: data on the active group, control on all

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        # Metric syncs (self.log(sync_dist=True)) run where the metric was logged: on the active ranks.
        # A shadow rank logs nothing, and must not join (it would hang the replicas).
        if self.world_size > 1 and isinstance(tensor, Tensor) and group is None:
            if not self.is_active:
                return tensor
            group = self._replicas.active_group
        if isinstance(tensor, Tensor):
            return lightning_internals.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        # In steps and module hooks: on the active ranks only (idle ranks get their input back, as a group of one).
        if group is None and self._replicas.active_group is not None:
            if not self.is_active:
                return tensor.unsqueeze(0)
            group = self._replicas.active_group
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def barrier(self, name: str | None = None) -> None:
        # While this rank handles an exception the others do not share (a checkpoint on exception),
        # they are not coming: waiting would last the collective timeout.
        exception = self._exception_in_hand()
        if exception is not None and not self._note_failure(exception):
            return
        # Every rank, over the gloo control group (no device ids, whatever the data backend).
        if self._replicas.control_group is not None:
            dist.barrier(group=self._replicas.control_group)
        elif lightning_internals.distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        # Callbacks' broadcasts (ModelCheckpoint paths, times) are control messages: all ranks.
        if self._replicas.control_group is not None:
            return groups.broadcast_object(obj, src=src, group=self._replicas.control_group)
        if not lightning_internals.distributed_is_initialized():
            return obj
        return groups.broadcast_object(obj, src=src, group=None)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # Control flow (should_stop, checkpoint decisions) must agree on every rank: over all of them.
        if self._replicas.control_group is None:
            return super().reduce_boolean_decision(decision, all=all)
        votes = torch.tensor(int(decision))
        dist.all_reduce(votes, op=dist.ReduceOp.SUM, group=self._replicas.control_group)
        return bool(votes == self.world_size) if all else bool(votes)


class PostFailureFirst(Callback):
    """Posts this rank's failure before any other callback's ``on_exception`` runs.

    Lightning's ``_interrupt`` runs the callbacks' ``on_exception`` (an ``OnExceptionCheckpoint``
    writing a large checkpoint, a user's hook that waits in a collective) before the strategy's:
    posted from the strategy's hook, a failure reached the others only after them, while they
    waited in a collective for this rank. First in ``trainer.callbacks``, this one posts at once.
    """

    def __init__(self, post: Callable[[BaseException], object]) -> None:
        self._post = post

    @classmethod
    def install(cls, trainer: Any, post: Callable[[BaseException], object]) -> None:
        """Put one first among ``trainer``'s callbacks (an earlier call's copy is replaced)."""
        cls.remove(trainer)
        trainer.callbacks.insert(0, cls(post))

    @classmethod
    def remove(cls, trainer: Any) -> None:
        trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, cls)]

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._post(exception)


def _ended_silently(children: dict[int, Any]) -> dict[int, str]:
    """The launched children whose process ended in failure, said as the cause of a rank that posted nothing."""
    return {
        rank: f"its process {how}, without reporting an error (the OOM killer, or a kill from outside)"
        for rank, how in faults.exited_children(children).items()
    }


def _broken_collective(exception: BaseException) -> bool:
    """Whether ``exception`` is a collective that broke (a peer gone, a timeout), not a failure of this rank's own."""
    text = str(exception)
    return isinstance(exception, dist.DistError) or any(
        mark in text for mark in ("Connection closed by peer", "Connection reset by peer", "timed out", "Timeout", "NCCL", "gloo")
    )
