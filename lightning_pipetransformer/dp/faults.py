"""Faults across ranks: signals noted and agreed on at a step, failures raised on every rank or
posted where every rank reads them, a watch that ends a rank left waiting, naming a dead peer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class PeerFailedError(RuntimeError):
    """Another rank failed at the point every rank was at: this one stops too, naming that rank's error."""


class PeerFailedAtEndError(RuntimeError):
    """Another rank failed after the last collective of the fit, while this one finished: this one fails
    too, so that the launcher's exit status (rank 0's) is not a success. Not raised together: the
    failed rank runs its own exception hooks, and this one's skip the barriers it would not join."""


@contextlib.contextmanager
def signals_held(signums: Sequence[int] = (signal.SIGTERM,)) -> Iterator[None]:
    """Hold ``signums`` while every rank is inside the same collectives (a transition), then deliver them.

    The strategy's own handler (:class:`SignalNotice`) only notes a signal; other handlers that
    Lightning composes with it (ones installed before the Trainer ran) may do anything, including
    a collective that would pair with none of the transition's. Held, they run right after the
    transition, and every rank stops at the next step (with a checkpoint if an
    ``OnExceptionCheckpoint`` is among the callbacks). Main thread only (Python's rule for signal
    handlers); elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[tuple[int, Any]] = []
    previous = {signum: signal.getsignal(signum) for signum in signums}
    for signum in signums:
        signal.signal(signum, lambda s, frame: received.append((s, frame)))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum, frame in received:
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), signum)


def peer_processes(group: Any) -> list[tuple[str, int]]:
    """``(host, pid)`` of every rank of ``group``, by rank (collective)."""
    mine = (socket.gethostname(), os.getpid())
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return [tuple(p) for p in everyone]  # type: ignore[misc]


def dead_peers(peers: Sequence[tuple[str, int]], wait: float = 0.0) -> list[int]:
    """The ranks on this host whose process is gone (ranks on other hosts cannot be checked from here).

    A peer's collective breaks as soon as a killed process closes its sockets, before the process
    is gone: with ``wait`` the check is repeated for up to that many seconds until one is found.
    """
    deadline = time.monotonic() + wait
    while True:
        gone = _dead_peers_now(peers)
        if gone or time.monotonic() >= deadline:
            return gone
        time.sleep(0.05)


def _dead_peers_now(peers: Sequence[tuple[str, int]]) -> list[int]:
    host = socket.gethostname()
    gone = []
    for rank, (their_host, pid) in enumerate(peers):
        if their_host != host or pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            gone.append(rank)
            continue
        except PermissionError:
            continue  # alive, someone else's
        if _is_zombie(pid):  # exited, not yet reaped by its parent (rank 0's launcher)
            gone.append(rank)
    return gone


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


class SignalNotice:
    """The SIGTERM handler under several processes: it notes the signal and does nothing else.

    Lightning 2.6's own handler forwards the signal to the launcher's children and broadcasts over
    the world group inside the handler. A handler runs wherever the main thread is, which differs
    per rank: when a scheduler signals every rank at once (SLURM, Kubernetes), rank 0's broadcast
    and the others' meet nothing but another group's collective (or the second broadcast of a
    child signalled twice), and every rank waits until the collective timeout. Noted here, the
    signal is agreed on at the next step, where every rank is (:func:`agree_at_step`), and every
    rank stops after that same batch.
    """

    def __init__(self) -> None:
        self.signum = 0

    def __call__(self, signum: int, frame: Any) -> None:
        if not self.signum:
            self.signum = int(signum)

    def reset(self) -> None:
        self.signum = 0


def exit_for_signal(exception: SystemExit, signum: int, rank: int, step: Any) -> None:
    """Lightning exits with status 0 and no word after ``SIGTERMException``: say which signal stopped ``rank``, and
    exit as the shell does for it (``128 + signum``)."""
    exception.code = 128 + signum
    print(
        f"[pipetransformer] rank {rank}: stopped by {signal.Signals(signum).name} after global step {step}; "
        f"exit status {exception.code}.", file=sys.stderr, flush=True,
    )  # fmt: skip


def agree_at_step(error: BaseException | None, signum: int, group: Any, where: str) -> int:
    """Every rank of ``group`` calls this at the same point of every step: a failure or a signal on any rank reaches all.

    A failure that only one rank reaches (an exception in its step, AutoCache's first-hit check, a
    repeated dataset index) would otherwise leave the others waiting in the next collective (DDP's
    all-reduce, a barrier) until its timeout, half an hour by default: every rank raises now, the
    failed one its own error, the others a :class:`PeerFailedError` that quotes it. A signal noted
    on any rank (:class:`SignalNotice`) is returned on every rank (the largest signal number), for
    all of them to stop after this step. Two integers per step go over ``group`` (gloo, on the CPU);
    only after a failure its text follows.
    """
    flags = torch.tensor([0 if error is None else 1, signum], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if int(flags[0]) == 0:
        return int(flags[1])
    reports: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, None if error is None else f"{type(error).__name__}: {error}", group=group)
    if error is not None:
        raise error
    rank, report = next((r, m) for r, m in enumerate(reports) if m is not None)
    raise PeerFailedError(f"Rank {rank} failed in {where}, so every rank stops here: {report}")


class FaultBoard:
    """Failures posted where every rank reads them without a collective: the rendezvous store.

    A collective cannot carry the news of a failure to a rank that waits in another collective,
    and under NCCL a collective whose peer died never returns. The store (rank 0's TCP store, or
    torchrun's agent's) answers while every process group is stuck. Keys live under a prefix per
    trainer call, so a fit's failures do not leak into the next call's.
    """

    #: Seconds one board call may take: a store that does not answer within it counts as gone (the watch looks twice).
    TIMEOUT = 5.0

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self._store, self.rank, self.world_size = store, rank, world_size

    @classmethod
    def for_default_group(cls, rank: int, world_size: int, call: int) -> FaultBoard:
        """The board of trainer call ``call``, on a connection of its own to the default group's store."""
        return cls.on_own_connection(dist.distributed_c10d._get_default_store(), rank, world_size, call)

    @classmethod
    def on_own_connection(cls, store: Any, rank: int, world_size: int, call: int, timeout: float = TIMEOUT) -> FaultBoard:
        """The board of trainer call ``call`` on ``store``, read and written over a connection of its own.

        A c10d ``TCPStore`` client is one socket, and each call holds it until the server answers: a
        thread blocked in ``wait``/``get`` on it (a new group's rendezvous, an NCCL communicator's
        set-up waiting for a peer that failed) would hold every other caller, the watch included, for
        the whole collective timeout. ``Store.clone()`` opens another connection to the same server,
        with the same key prefixes (torchrun's restart attempt, ``default_pg``), and its own
        ``timeout``, short, so that no board call outlasts the watch's grace.
        """
        return cls(dist.PrefixStore(f"pipetransformer/faults/{call}/", own_connection(store, timeout)), rank, world_size)

    def post(self, text: str) -> None:
        self._store.set(f"fault/{self.rank}", text)
        self._store.add("posted", 1)

    def failures(self) -> dict[int, str]:
        """Every other rank's posted failure, by rank (empty when none posted)."""
        if self._store.add("posted", 0) == 0:
            return {}
        found = {}
        for rank in range(self.world_size):
            if rank != self.rank and self._store.check([f"fault/{rank}"]):
                found[rank] = self._store.get(f"fault/{rank}").decode()
        return found

    def acknowledge(self) -> None:
        self._store.add("seen", 1)

    def wait_seen(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until every other rank read the failure, before this process (maybe the store's host) exits."""
        deadline = time.monotonic() + timeout
        with contextlib.suppress(Exception):
            while self._store.add("seen", 0) < self.world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.05)

    def handled(self) -> None:
        """This rank ran its exception hooks (its checkpoint is written): the launcher's rank need not wait for it much longer."""
        with contextlib.suppress(Exception):
            self._store.add("handled", 1)

    def all_handled(self) -> bool:
        """Whether every rank said :meth:`handled`."""
        try:
            return self._store.add("handled", 0) >= self.world_size
        except Exception:  # noqa: BLE001 - the store is gone: nothing to wait for
            return True

    def finish(self) -> None:
        with contextlib.suppress(Exception):
            self._store.set(f"finished/{self.rank}", "1")  # before the count: whoever counts this rank finds it
            self._store.add("finished", 1)

    def finished(self, rank: int) -> bool:
        """Whether ``rank`` finished its fit (an exit after that, in the interpreter's or NCCL's teardown, is no failure of the fit)."""
        return bool(self._store.check([f"finished/{rank}"]))

    def wait_finished(self, timeout: float, exited: Callable[[], dict[int, str]] = dict) -> dict[int, str]:
        """Rank 0 hosts the store under Lightning's launcher: at a normal end it waits (bounded) for
        every rank to finish, or a slower rank's watch would take the store's end for rank 0's death.

        A rank that failed after its last collective (at the end of training) never finishes: the
        wait ends as soon as a failure is posted, or as soon as ``exited()`` names a rank whose
        process ended without posting (a child SIGKILLed by the OOM killer), and returns the failures
        (by rank), for rank 0 to fail too. Its exit status is the job's under Lightning's launcher.
        """
        deadline = time.monotonic() + timeout
        try:
            while self._store.add("finished", 0) < self.world_size and time.monotonic() < deadline:
                # Read before the board: a child that posted, then exited, is named by its post.
                gone = {rank: how for rank, how in exited().items() if not self.finished(rank)}
                posted = self.failures() if self._store.add("posted", 0) else {}
                if gone or posted:
                    return {**gone, **posted}
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store is gone: the children's exit codes still say who died
            return exited()
        return {}


class PeerWatch(threading.Thread):
    """A thread on every rank that ends it within seconds when another rank failed, naming that rank's error.

    The main thread may wait in a collective that will not return before the timeout (half an hour
    by default): under NCCL a collective with a dead peer never returns, and on any backend one
    whose peer is alive but elsewhere (handling its own exception) waits. Every ``poll`` seconds
    the watch reads the :class:`FaultBoard`, and on the launcher's rank the children's exit codes
    (it takes over from Lightning's child-process observer, which kills every process without a
    word; ``children``: ``Popen`` by global rank, or a sequence for ranks 1, 2, ...). The board is
    read over a connection of its own (:meth:`FaultBoard.on_own_connection`), so a main thread
    blocked in a store rendezvous does not block the watch. A cause found, it waits ``grace`` seconds for the main thread to end by itself (gloo
    notices a closed connection; longer while the main thread is already handling an exception),
    then says why on stderr, ends the launched children and exits the process (status 1). Stopped once the rank handles its own exception or tears down.
    """

    def __init__(
        self, board: FaultBoard, children: Mapping[int, Any] | Sequence[Any] = (), grace: float = 5.0, poll: float = 0.5,
        exit_process: Any = os._exit, unwinding: Any = None, unwind_grace: float = 30.0,
    ) -> None:
        super().__init__(daemon=True, name="pipetransformer-peer-watch")
        self.board, self.grace, self.poll = board, grace, poll
        self.children = dict(children) if isinstance(children, Mapping) else dict(enumerate(children, start=1))
        #: ``unwinding()``: whether the main thread already handles an exception (it then gets ``unwind_grace`` s in all).
        self.unwinding, self.unwind_grace = unwinding or (lambda: False), unwind_grace
        self._stopped = threading.Event()
        self._exit = exit_process
        self.cause: str | None = None

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        while not self._stopped.wait(self.poll):
            cause = self.find_cause()
            if cause is None:
                continue
            self.cause = cause
            if self._stopped.wait(self.grace):
                return  # the main thread ended by itself (and named the cause from the board)
            if self.find_cause() is None:  # a store call that failed once under load: not a peer's failure
                self.cause = None
                continue
            deadline = time.monotonic() + self.unwind_grace - self.grace
            while self.unwinding() and time.monotonic() < deadline:  # its exception hooks run: let them end
                if self._stopped.wait(self.poll):
                    return
            print(
                f"[pipetransformer] rank {self.board.rank}: {cause}. This rank waited for it in a collective that "
                "would not return before the timeout: ending it now.", file=sys.stderr, flush=True,
            )
            end_children(list(self.children.values()), grace=0.0)
            self._exit(1)
            return

    def find_cause(self) -> str | None:
        try:
            failures = self.board.failures()
        except Exception:  # noqa: BLE001 - the store is gone with its host
            return None if self.board.rank == 0 else "rank 0 is gone (the rendezvous store it hosted stopped answering)"
        if failures:
            with contextlib.suppress(Exception):
                self.board.acknowledge()
            rank, text = min(failures.items())
            return f"rank {rank} failed: {text}"
        exited = exited_children(self.children)
        if exited:
            rank, how = min(exited.items())
            return f"rank {rank} {how}"
        return None


def own_connection(store: Any, timeout: float) -> Any:
    """Another connection to ``store``'s server (same keys), whose calls give up after ``timeout`` seconds.

    Where the store cannot be cloned (torch before 2.6; a ``HashStore`` clones as itself) it is ``store``
    itself, shared with the other callers as before.
    """
    try:
        clone = store.clone()
    except (AttributeError, RuntimeError, NotImplementedError):
        return store
    if clone is not store:
        clone.set_timeout(timedelta(seconds=timeout))
    return clone


def exited_children(children: Mapping[int, Any]) -> dict[int, str]:
    """The launched children (``Popen``, by global rank) whose process ended in failure, each with how:
    ``(pid N) exited with status 3``, or ``(pid N) was killed by SIGKILL`` (the OOM killer does that)."""
    found = {}
    for rank, child in children.items():
        code = child.poll()
        if code:
            found[rank] = f"(pid {child.pid}) {exit_status(code)}"
    return found


def exit_status(code: int) -> str:
    """A ``Popen.returncode`` in words: a negative one is the signal that killed the process."""
    if code >= 0:
        return f"exited with status {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def end_children(children: Sequence[Any], grace: float, handled: Any = None, exit_grace: float = 10.0) -> list[int]:
    """Wait up to ``grace`` seconds for launched children (``Popen``) to exit, then SIGKILL the rest; their pids.

    ``handled()``: whether every child has run its exception hooks (what the long grace waits for);
    from then on the children get only ``exit_grace`` more seconds to exit. A child stuck after its
    hooks (in a collective, or in the user's code after the fit) then delays nothing for long.
    """
    deadline = time.monotonic() + grace
    while any(c.poll() is None for c in children) and time.monotonic() < deadline:
        if handled is not None and handled():
            deadline = min(deadline, time.monotonic() + exit_grace)
            handled = None
        time.sleep(0.1)
    killed = []
    for child in children:
        if child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            killed.append(child.pid)
    return killed


def describe(error: BaseException, limit: int = 2000) -> str:
    """``Type: message`` for the board (a long message cut: the failed rank's own log has all of it)."""
    text = f"{type(error).__name__}: {error}".strip()
    return text if len(text) <= limit else text[:limit] + " [...]"
