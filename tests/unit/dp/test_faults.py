"""dp/faults.py without processes: the board, the watch, the dead-peer check, the signal notice."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_pipetransformer.dp import faults


def boards(world: int = 2) -> list[faults.FaultBoard]:
    store = dist.HashStore()
    return [faults.FaultBoard(dist.PrefixStore("call1/", store), rank, world) for rank in range(world)]


def test_a_posted_failure_is_read_by_the_others_only():
    rank0, rank1 = boards()
    assert rank0.failures() == {} and rank1.failures() == {}
    rank1.post("InjectedFault: boom")
    assert rank0.failures() == {1: "InjectedFault: boom"}
    assert rank1.failures() == {}  # its own is not a peer's


def test_the_watch_ends_a_waiting_rank_after_the_grace_naming_the_failure(capfd):
    rank0, rank1 = boards()
    exits: list[int] = []
    watch = faults.PeerWatch(rank0, grace=0.3, poll=0.05, exit_process=exits.append)
    watch.start()
    time.sleep(0.2)
    assert not exits  # nothing failed: the watch stays quiet
    start = time.monotonic()
    rank1.post("InjectedFault: boom")
    watch.join(timeout=5)
    assert exits == [1] and 0.3 <= time.monotonic() - start < 3
    assert "rank 0: rank 1 failed: InjectedFault: boom" in capfd.readouterr().err
    rank1.wait_seen(timeout=1)  # the failed rank learns its failure was read


def test_a_stopped_watch_never_ends_the_rank():
    rank0, rank1 = boards()
    exits: list[int] = []
    watch = faults.PeerWatch(rank0, grace=0.3, poll=0.05, exit_process=exits.append)
    watch.start()
    rank1.post("InjectedFault: boom")
    time.sleep(0.1)
    watch.stop()  # the main thread ended by itself within the grace (it handles the exception)
    watch.join(timeout=5)
    assert not exits and watch.cause == "rank 1 failed: InjectedFault: boom"


def test_the_watch_names_a_launched_child_that_died():
    (rank0,) = boards(world=1)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    child.wait()
    watch = faults.PeerWatch(rank0, children=[child])
    assert watch.find_cause() == f"rank 1 (pid {child.pid}) exited with status 3"


def test_a_store_gone_names_rank_0():
    class Gone:
        def add(self, *a):
            raise RuntimeError("Connection reset by peer")

    assert "rank 0 is gone" in faults.PeerWatch(faults.FaultBoard(Gone(), 1, 2)).find_cause()
    assert faults.PeerWatch(faults.FaultBoard(Gone(), 0, 2)).find_cause() is None  # rank 0 hosts it


def test_dead_peers_waits_for_a_process_that_is_still_exiting():
    # A killed peer's sockets close before its process is gone: the check ran too early for rank 0.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    peers = [(socket.gethostname(), child.pid)]
    assert faults.dead_peers(peers) == []
    start = time.monotonic()
    assert faults.dead_peers(peers, wait=10.0) == [0]
    assert time.monotonic() - start < 5
    child.wait()


def test_the_signal_notice_only_notes():
    notice = faults.SignalNotice()
    notice(signal.SIGTERM, None)
    notice(signal.SIGINT, None)  # the first one counts
    assert notice.signum == signal.SIGTERM
    notice.reset()
    assert notice.signum == 0


@pytest.mark.timeout(60)
def test_end_children_kills_what_outlives_the_grace():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert faults.end_children([child], grace=0.2) == [child.pid]
    assert child.wait(timeout=10) == -signal.SIGKILL


def test_the_watch_gives_a_rank_that_handles_its_exception_longer():
    rank0, rank1 = boards()
    exits: list[int] = []
    watch = faults.PeerWatch(rank0, grace=0.1, poll=0.05, exit_process=exits.append, unwinding=lambda: True, unwind_grace=1.0)
    start = time.monotonic()
    watch.start()
    rank1.post("InjectedFault: boom")
    watch.join(timeout=10)
    assert exits == [1] and time.monotonic() - start >= 1.0  # its exception hooks ran for the unwind grace


def test_one_failed_store_call_under_load_does_not_end_a_healthy_rank():
    """A TCPStore call that times out once reads as "rank 0 is gone"; the watch looks again after the grace."""

    class Flaky:
        def __init__(self):
            self.calls = 0

        def add(self, *a):
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("Socket Timeout")
            return 0

    exits: list[int] = []
    watch = faults.PeerWatch(faults.FaultBoard(Flaky(), 1, 2), grace=0.2, poll=0.05, exit_process=exits.append)
    watch.start()
    time.sleep(1.0)
    watch.stop()
    watch.join(timeout=5)
    assert not exits and watch.cause is None


def test_each_trainer_call_in_a_process_gets_a_board_of_its_own():
    """An earlier call's posted failure (the default store outlives trainers) must not end a later call."""
    from lightning_pipetransformer import processes

    first, second = next(processes._TRAINER_CALLS), next(processes._TRAINER_CALLS)
    store = dist.HashStore()
    earlier = faults.FaultBoard(dist.PrefixStore(f"pipetransformer/faults/{first}/", store), 1, 2)
    earlier.post("InjectedFault: from an earlier fit")
    later = faults.FaultBoard(dist.PrefixStore(f"pipetransformer/faults/{second}/", store), 0, 2)
    assert first != second and later.failures() == {}


def test_rank_0_stops_waiting_for_the_others_to_finish_once_one_failed():
    """A rank that failed after the last collective never finishes: rank 0 learns it at once, not after the wait's bound."""
    rank0, rank1, rank2 = boards(world=3)
    rank2.finish()
    rank0.finish()
    start = time.monotonic()
    assert rank0.wait_finished(timeout=0.3) == {}  # rank 1 neither finished nor failed: the bound ends the wait
    assert time.monotonic() - start >= 0.3
    rank1.post("InjectedFault: at the end")
    start = time.monotonic()
    assert rank0.wait_finished(timeout=30.0) == {1: "InjectedFault: at the end"}
    assert time.monotonic() - start < 5


@pytest.mark.timeout(60)
def test_end_children_waits_only_briefly_once_every_rank_ran_its_exception_hooks():
    """A child stuck after its hooks (a held process, user code after the fit) must not hold the launcher for the whole grace."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    rank0, rank1 = boards()
    start = time.monotonic()
    assert faults.end_children([child], grace=0.5, handled=rank0.all_handled, exit_grace=0.1) == [child.pid]
    assert time.monotonic() - start >= 0.5  # nobody said handled: the whole grace
    child.wait(timeout=10)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    rank0.handled()
    rank1.handled()
    start = time.monotonic()
    assert faults.end_children([child], grace=30.0, handled=rank0.all_handled, exit_grace=0.2) == [child.pid]
    assert time.monotonic() - start < 5
    assert child.wait(timeout=10) == -signal.SIGKILL


@pytest.fixture
def tcp_store():
    """A TCPStore server (as rank 0 hosts one under Lightning's launcher) and a factory of client connections."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    return lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))


@pytest.mark.timeout(60)
def test_the_watch_reads_the_board_while_another_thread_holds_a_store_wait(tcp_store, capfd):
    """A TCPStore client is one socket: a rendezvous blocked on it (a new group, an NCCL communicator's set-up
    waiting for the failed rank) held the watch's reads for the whole timeout, and the rank was never ended."""
    process_store = tcp_store()  # this rank's default store
    rank0 = faults.FaultBoard.on_own_connection(process_store, 0, 2, call=1)
    rank1 = faults.FaultBoard.on_own_connection(tcp_store(), 1, 2, call=1)
    held = threading.Event()

    def rendezvous() -> None:
        held.set()
        with contextlib.suppress(Exception):  # DistStoreError at the end of the wait
            process_store.wait(["a key no rank sets"], timedelta(seconds=8))

    waiter = threading.Thread(target=rendezvous, daemon=True)
    waiter.start()
    held.wait(timeout=5)
    time.sleep(0.2)  # inside the wait
    exits: list[int] = []
    watch = faults.PeerWatch(rank0, grace=0.2, poll=0.05, exit_process=exits.append)
    watch.start()
    start = time.monotonic()
    rank1.post("InjectedFault: boom")
    watch.join(timeout=10)
    assert exits == [1] and time.monotonic() - start < 5, exits
    assert "rank 0: rank 1 failed: InjectedFault: boom" in capfd.readouterr().err
    waiter.join(timeout=30)


def test_a_board_on_its_own_connection_shares_the_keys_of_the_store_it_came_from(tcp_store):
    """Clones keep the store's prefixes (torchrun's restart attempt, ``default_pg``): every rank reads one board."""
    store = dist.PrefixStore("/worker/attempt_0/default_pg", tcp_store())
    mine = faults.FaultBoard.on_own_connection(store, 1, 2, call=3)
    shared = faults.FaultBoard(dist.PrefixStore("pipetransformer/faults/3/", dist.PrefixStore("/worker/attempt_0/default_pg", tcp_store())), 0, 2)
    mine.post("InjectedFault: boom")
    assert shared.failures() == {1: "InjectedFault: boom"}


@pytest.mark.timeout(60)
def test_rank_0_at_the_end_names_a_child_killed_without_posting():
    """The OOM killer's SIGKILL posts nothing: rank 0 waited out its bound and ended the job with success."""
    rank0, _ = boards()
    rank0.finish()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child.kill()
    child.wait(timeout=10)
    start = time.monotonic()
    found = rank0.wait_finished(timeout=30.0, exited=lambda: faults.exited_children({1: child}))
    assert found == {1: f"(pid {child.pid}) was killed by SIGKILL"} and time.monotonic() - start < 5


@pytest.mark.timeout(60)
def test_a_child_that_finished_its_fit_and_then_exited_non_zero_fails_nothing():
    """An exit after ``finish()`` (the interpreter's or NCCL's teardown) is no failure of the fit: the wait ends
    at the count, with no rank named."""
    rank0, rank1, _ = boards(world=3)
    rank1.finish()
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])  # rank 1's process, after its finish
    child.wait(timeout=10)
    rank0.finish()  # rank 2 is still finishing: rank 0 waits, and sees rank 1's exit meanwhile
    assert rank0.wait_finished(timeout=0.5, exited=lambda: faults.exited_children({1: child})) == {}


def test_exit_status_names_the_signal():
    assert faults.exit_status(3) == "exited with status 3"
    assert faults.exit_status(-signal.SIGKILL) == "was killed by SIGKILL"
    assert faults.exit_status(-200) == "was killed by signal 200"


def test_the_failure_hook_goes_first_among_callbacks_once():
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    from lightning_pipetransformer.processes import PostFailureFirst

    class Trainer:
        callbacks: list = [OnExceptionCheckpoint(dirpath=".")]

    seen: list[BaseException] = []
    PostFailureFirst.install(Trainer, seen.append)
    PostFailureFirst.install(Trainer, seen.append)  # a second trainer call replaces the first's
    assert [type(c) for c in Trainer.callbacks] == [PostFailureFirst, OnExceptionCheckpoint]
    error = RuntimeError("boom")
    Trainer.callbacks[0].on_exception(Trainer, None, error)
    assert seen == [error]
    PostFailureFirst.remove(Trainer)
    assert [type(c) for c in Trainer.callbacks] == [OnExceptionCheckpoint]
