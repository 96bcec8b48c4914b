"""Faults across ranks end every rank within seconds, naming the cause (issues 31 and 32).

Each test launches tests/integration/scripts/faults.py (2 CPU processes, gloo; Lightning's own
subprocess launcher) with a collective timeout far above the test's wall-clock bound: a rank left
waiting in a collective would show as a hang of that length, not as a pass.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import clean_env, is_alive, kill_session, launch_ranks

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "faults.py"
COLLECTIVE_TIMEOUT = 300  # what a rank left waiting would wait for
BOUND = 30  # seconds from the signal or fault to every rank gone: far below it
LAUNCH_TIMEOUT = 150  # start-up and two epochs on a loaded 2-core machine


def pids(out: Path, world: int) -> list[int]:
    return [int((out / f"pid{rank}").read_text()) for rank in range(world)]


def wait_gone(out: Path, world: int, bound: float) -> float:
    """Seconds until every rank's process is gone (fails past ``bound``)."""
    start = time.monotonic()
    while any(is_alive(pid) for pid in pids(out, world)) and time.monotonic() - start < bound:
        time.sleep(0.2)
    assert not any(is_alive(pid) for pid in pids(out, world)), f"a rank outlived {bound}s"
    return time.monotonic() - start


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("uninterrupted")
    proc = launch_ranks(SCRIPT, out, "--timeout", str(COLLECTIVE_TIMEOUT), timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return torch.load(out / "rank0.pt")


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("stop", ["sigterm", "sigterm-transition", "sigterm-validation"])
def test_sigterm_to_every_rank_stops_all_in_seconds_with_a_checkpoint_that_resumes_equal(tmp_path, stop, uninterrupted):
    # As SLURM and Kubernetes preempt: every rank signalled at once (mid-epoch, inside the
    # transition while the others wait in its collectives, or in validation). Lightning 2.6's handler broadcast over
    # the world group inside the handler and every rank hung until the collective timeout.
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    proc = launch_ranks(SCRIPT, stopped, "--stop", stop, "--timeout", str(COLLECTIVE_TIMEOUT), timeout=LAUNCH_TIMEOUT, cleanup=False)
    try:
        signalled = float((stopped / "signalled").read_text())
        wait_gone(stopped, 2, BOUND)
        assert time.time() - signalled < BOUND, proc.stdout[-5000:]
    finally:
        kill_session(proc.pid)
    # The exit says it was a signal, on every rank.
    assert proc.returncode == 128 + 15, proc.stdout[-5000:]
    for rank in range(2):
        assert f"[pipetransformer] rank {rank}: stopped by SIGTERM" in proc.stdout, proc.stdout[-5000:]
        assert (stopped / f"error{rank}").read_text().split(" ", 1)[1].startswith("SIGTERMException")
    assert "timeout" not in proc.stdout.lower() and not (stopped / "rank0.pt").exists()
    ckpt = stopped / "ckpt" / "on_exception.ckpt"
    saved = torch.load(ckpt, weights_only=False)
    # In validation, Lightning stops at the end of epoch 1 (after its epoch-end hooks): the checkpoint counts it done.
    assert saved["epoch"] == (2 if stop == "sigterm-validation" else 1)
    assert saved["pipetransformer"]["plan"]["active_ranks"] == [0, 1]
    # What the checkpoint holds is the uninterrupted run's state at that step.
    step = saved["global_step"]
    assert (step == 8) == (stop == "sigterm-transition"), step  # inside the transition: before epoch 1's first batch
    assert (step == 12) == (stop == "sigterm-validation"), step  # in validation: after epoch 1's last batch
    for key, value in uninterrupted["states"][step].items():
        torch.testing.assert_close(saved["state_dict"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    # Resumed from it, the run ends as the uninterrupted one (mid-epoch, only as far as Lightning can
    # resume a loader without state: it warns, and the epoch's batches start over).
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    proc = launch_ranks(SCRIPT, resumed, "--ckpt", str(ckpt), "--timeout", str(COLLECTIVE_TIMEOUT), timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-5000:]
    final = torch.load(resumed / "rank0.pt")
    assert final["global_step"] == uninterrupted["global_step"]
    if stop != "sigterm":  # stopped at an epoch's edge: no batch of an epoch is repeated on resume
        for key, value in uninterrupted["state"].items():
            torch.testing.assert_close(final["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.timeout(LAUNCH_TIMEOUT + 2 * BOUND + 30)
@pytest.mark.parametrize(
    "fault_rank, where, epoch, hold",
    [
        (1, "step", 1, True),  # training_step, the cache off: raised together at the step's agreement
        (0, "backward", 1, True),  # rank 1 waits in DDP's all-reduce for a rank 0 that never comes (NCCL's rule)
        (1, "optimizer", 1, True),  # after the all-reduce: rank 0 waits in the next step's collectives
        (0, "transition", 1, True),  # rank 1 waits for the weights rank 0 never sends
        (1, "callback", 0, False),  # a callback on the idle rank: rank 0's gloo error alone named nobody
        (0, "callback", 1, True),  # a callback on the launcher's rank while rank 1 is a replica
        (1, "validation", 1, False),
        (0, "kill", 1, False),  # rank 0 SIGKILLed: its death was not named (the check raced the process's exit)
        (1, "teardown", 2, True),  # at the end of training: rank 0 (the job's exit status) ended with success, naming nobody
    ],
)
def test_a_fault_on_one_rank_ends_every_rank_in_seconds_naming_it(tmp_path, fault_rank, where, epoch, hold):
    stdout, gone_after = run_fault(tmp_path, fault_rank, where, epoch, hold)
    assert_named(tmp_path, stdout, fault_rank, where)
    print(f"{where} on rank {fault_rank}: every rank's fit ended {gone_after:.1f}s after the fault")


@pytest.mark.timeout(LAUNCH_TIMEOUT + 2 * BOUND + 30)
def test_a_rank_blocked_in_a_store_rendezvous_is_ended_in_seconds_naming_the_failed_rank(tmp_path):
    # Rank 1's main thread makes a new group, whose store rendezvous waits for rank 0, which failed in a
    # callback (an NCCL communicator's set-up waits the same way). Before, the watch read the board on the
    # same store connection, held by that wait: rank 1 went on waiting, and rank 0 SIGKILLed it, unnamed.
    stdout, gone_after = run_fault(tmp_path, 0, "callback", 1, True, "--peer-waits", "store")
    assert "[pipetransformer] rank 1: rank 0 failed: InjectedFault" in stdout, stdout[-5000:]  # its watch ended it
    assert_named(tmp_path, stdout, 0, "callback")


@pytest.mark.timeout(LAUNCH_TIMEOUT + 2 * BOUND + 30)
def test_a_failure_reaches_the_others_before_the_failed_ranks_slow_exception_hooks(tmp_path):
    # Rank 0's callbacks' on_exception take 20 s (a large checkpoint); rank 1 waits in a collective for it.
    # Before, Lightning ran them before the strategy's on_exception, which posted the failure: rank 1
    # waited through them (and, under NCCL, a checkpoint's collective waited for a rank never coming).
    stdout, _ = run_fault(tmp_path, 0, "callback", 1, True, "--slow-on-exception", "20", others_within=12)
    assert_named(tmp_path, stdout, 0, "callback")


@pytest.mark.timeout(LAUNCH_TIMEOUT + 2 * BOUND + 30)
def test_a_child_killed_at_the_end_of_fit_without_posting_fails_the_job_naming_it(tmp_path):
    # Rank 1 SIGKILLed in on_train_end (the OOM killer posts nothing). Before, rank 0 waited 10 s for it
    # to finish, then ended the job with success.
    stdout, _ = run_fault(tmp_path, 1, "kill-at-end", 2, False)
    error = (tmp_path / "error0").read_text()
    assert "PeerFailedAtEndError" in error and "rank 1 failed after the fit's last step" in error, error
    assert f"(pid {pids(tmp_path, 2)[1]}) was killed by SIGKILL" in error, error


def run_fault(tmp_path: Path, fault_rank: int, where: str, epoch: int, hold: bool, *extra: str,
              others_within: float = BOUND) -> tuple[str, float]:
    """Launch faults.py with a fault; check every other rank is gone within ``others_within`` s of it, the failed
    rank's fit ends within BOUND, and (where rank 0 is not the one that failed) the job fails. Returns the
    output and the seconds from the fault to the failed rank's fit's end."""
    # --hold: the failed rank's process stays (its sockets open) after its fit ended, as a dead NCCL
    # peer does for a collective (it never returns): nothing but the strategy can end the others.
    args = ["--stop", "fault", "--fault-rank", str(fault_rank), "--fault-where", where, "--fault-epoch", str(epoch), *extra]
    args += ["--hold"] if hold else []
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), *args, "--timeout", str(COLLECTIVE_TIMEOUT)], env=clean_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    killed = where.startswith("kill")
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while not (tmp_path / "faulted").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert (tmp_path / "faulted").exists(), "".join(output)[-5000:]
        faulted = float((tmp_path / "faulted").read_text())
        # Every rank ends within seconds (the held one's fit ends: its error is written).
        others = [r for r in range(2) if r != fault_rank]
        start = time.monotonic()
        while any(is_alive(pids(tmp_path, 2)[r]) for r in others) and time.monotonic() - start < BOUND:
            time.sleep(0.2)
        assert not any(is_alive(pids(tmp_path, 2)[r]) for r in others), f"a rank outlived {BOUND}s: " + "".join(output)[-5000:]
        others_gone = time.time() - faulted
        assert others_gone < others_within, f"the others outlived the fault by {others_gone:.1f}s: " + "".join(output)[-5000:]
        while not killed and not (tmp_path / f"error{fault_rank}").exists() and time.monotonic() - start < BOUND:
            time.sleep(0.2)
        gone_after = time.time() - faulted
        assert gone_after < BOUND
        if fault_rank != 0:  # rank 0's exit status is the job's under Lightning's launcher: not a success
            assert proc.wait(timeout=BOUND) != 0, "".join(output)[-5000:]
        assert killed or "InjectedFault" in (tmp_path / f"error{fault_rank}").read_text()
    finally:
        kill_session(proc.pid)
        reader.join(timeout=10)
    return "".join(output), gone_after


def assert_named(tmp_path: Path, stdout: str, fault_rank: int, where: str) -> None:
    """The others name the failed rank: in their error (the step's agreement, a broken collective) or, ended by
    their watch while they waited, on stderr."""
    for rank in (r for r in range(2) if r != fault_rank):
        error = (tmp_path / f"error{rank}").read_text() if (tmp_path / f"error{rank}").exists() else ""
        if where == "kill":  # named by its pid, or as the host of the store that stopped answering
            named = f"rank {fault_rank} (pid {pids(tmp_path, 2)[fault_rank]}) on this host is gone" in error
            assert named or f"[pipetransformer] rank {rank}: rank {fault_rank} is gone" in stdout, (error, stdout[-5000:])
            continue
        named = f"Rank {fault_rank} failed in" in error or f"rank {fault_rank} failed first: InjectedFault" in error
        named = named or f"[pipetransformer] rank {rank}: rank {fault_rank} failed: InjectedFault" in stdout
        assert named and "injected fault" in error + stdout, (error, stdout[-5000:])


@pytest.fixture(scope="module")
def cache_off(tmp_path_factory) -> dict:
    """The run with the disk-failure tests' freezes, without the cache."""
    out = tmp_path_factory.mktemp("cache_off")
    proc = launch_ranks(SCRIPT, out, "--timeout", str(COLLECTIVE_TIMEOUT), "--disk-fail-rank", "-1", timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return torch.load(out / "rank0.pt")


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("failing_ranks", ["1", "all"])
def test_a_cache_disk_failing_on_one_rank_or_all_stops_disk_writes_never_training(tmp_path, failing_ranks, cache_off):
    # The cache directory turns read-only (on rank 1, or on every rank) between the two freezes: the
    # next boundary's directory cannot be made there. Before: CacheConfigError on that rank at the freeze.
    proc = launch_ranks(SCRIPT, tmp_path, "--cache", "--disk-fail-rank", failing_ranks, "--timeout", str(COLLECTIVE_TIMEOUT),
                        timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-5000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    failing = [1] if failing_ranks == "1" else [0, 1]
    for rank, result in enumerate(ranks):
        stats = result["cache_stats"]
        warned = [w for w in result["warnings"] if "AutoCache stopped writing" in w]
        if rank in failing:
            assert result["refused"] >= 1  # the fault was injected
            assert stats["autocache/disk_failures"] == 1  # counted in the metrics
            assert len(warned) == 1 and f"[rank {rank}]" in warned[0] and "Read-only file system" in warned[0]  # once, with the cause
        else:
            assert stats["autocache/disk_failures"] == 0 and not warned
        assert stats["autocache/boundary"] == 2
        assert result["global_step"] == cache_off["global_step"]
    # Rank 0 (the one replica at boundary 1) advances its entries in memory and serves them; rank 1 (a
    # shadow rank then) holds none: it reads rank 0's files at the new boundary when rank 0 can write
    # them, and otherwise runs the blocks (unwritten, counted).
    assert ranks[0]["cache_stats"]["autocache/memory_hits"] > 0
    if failing_ranks == "1":
        assert ranks[1]["cache_stats"]["autocache/hits"] > 0
    else:
        assert ranks[1]["cache_stats"]["autocache/misses"] == ranks[1]["cache_stats"]["autocache/unwritten"] > 0
    for key, value in cache_off["state"].items():
        torch.testing.assert_close(ranks[0]["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
        torch.testing.assert_close(ranks[1]["state"][key], ranks[0]["state"][key], rtol=0, atol=0, msg=key)


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("stop", ["sigterm", "sigterm-transition"])
def test_sigterm_to_four_ranks_then_resume_on_two(tmp_path, stop):
    # Four processes (epoch 1: two replicas, two shadow ranks), every rank signalled at once in the
    # middle of epoch 1 or inside its transition (rank 0 about to send the joining replica its
    # weights); the checkpoint then resumes on another world size.
    stopped = tmp_path / "four"
    stopped.mkdir()
    proc = launch_ranks(SCRIPT, stopped, "--devices", "4", "--stop", stop, "--timeout", str(COLLECTIVE_TIMEOUT),
                        timeout=2 * LAUNCH_TIMEOUT, cleanup=False)
    try:
        signalled = float((stopped / "signalled").read_text())
        wait_gone(stopped, 4, BOUND)
        assert time.time() - signalled < BOUND, proc.stdout[-5000:]
    finally:
        kill_session(proc.pid)
    assert proc.returncode == 143, proc.stdout[-5000:]
    for rank in range(4):
        assert f"[pipetransformer] rank {rank}: stopped by SIGTERM" in proc.stdout, proc.stdout[-5000:]
    saved = torch.load(stopped / "ckpt" / "on_exception.ckpt", weights_only=False)
    assert saved["epoch"] == 1 and saved["pipetransformer"]["plan"]["active_ranks"] == [0, 2]
    assert (saved["global_step"] == 8) == (stop == "sigterm-transition"), saved["global_step"]  # before epoch 1's first batch
    resumed = tmp_path / "two"
    resumed.mkdir()
    proc = launch_ranks(SCRIPT, resumed, "--ckpt", str(stopped / "ckpt" / "on_exception.ckpt"), "--timeout", str(COLLECTIVE_TIMEOUT),
                        timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-5000:]
    ranks = [torch.load(resumed / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["global_step"] == ranks[1]["global_step"] > saved["global_step"]
    for key, value in ranks[0]["state"].items():
        torch.testing.assert_close(ranks[1]["state"][key], value, rtol=0, atol=0, msg=key)


@pytest.mark.timeout(LAUNCH_TIMEOUT + 2 * BOUND + 30)
def test_sigterm_to_every_worker_under_torchrun_stops_all_in_seconds_with_a_checkpoint(tmp_path, uninterrupted):
    # torchrun starts the ranks (no Lightning launcher, no children of rank 0; the store is the
    # agent's); the scheduler signals every worker at once, and the agent then signals those left.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
               "--out", str(tmp_path), "--stop", "sigterm", "--timeout", str(COLLECTIVE_TIMEOUT)]
    proc = subprocess.Popen(command, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=LAUNCH_TIMEOUT + BOUND)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        stdout, _ = proc.communicate()
        pytest.fail(f"torchrun hung:\n{stdout[-5000:]}")
    finally:
        kill_session(proc.pid)
    signalled = float((tmp_path / "signalled").read_text())
    assert time.time() - signalled < BOUND, stdout[-5000:]  # every worker and the agent gone, not at the timeout
    assert proc.returncode != 0, stdout[-5000:]
    for rank in range(2):
        assert f"[pipetransformer] rank {rank}: stopped by SIGTERM" in stdout, stdout[-5000:]
        assert (tmp_path / f"error{rank}").read_text().split(" ", 1)[1].startswith("SIGTERMException")
    assert "timeout" not in stdout.lower() and not (tmp_path / "rank0.pt").exists()
    saved = torch.load(tmp_path / "ckpt" / "on_exception.ckpt", weights_only=False)
    assert saved["epoch"] == 1 and saved["pipetransformer"]["plan"]["active_ranks"] == [0, 1]
    for key, value in uninterrupted["states"][saved["global_step"]].items():
        torch.testing.assert_close(saved["state_dict"][key], value, rtol=1e-5, atol=1e-6, msg=key)
