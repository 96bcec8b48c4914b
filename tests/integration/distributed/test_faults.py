"""Faults across ranks end every rank within seconds, naming the cause (issues 31 and 32).

Each test launches tests/integration/scripts/faults.py (2 CPU processes, gloo; Lightning's own
subprocess launcher) with a collective timeout far above the test's wall-clock bound: a rank left
waiting in a collective would show as a hang of that length, not as a pass.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import is_alive, kill_session, launch_ranks

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
@pytest.mark.parametrize("stop", ["sigterm", "sigterm-transition"])
def test_sigterm_to_every_rank_stops_all_in_seconds_with_a_checkpoint_that_resumes_equal(tmp_path, stop, uninterrupted):
    # As SLURM and Kubernetes preempt: every rank signalled at once (mid-epoch, or inside the
    # transition while the others wait in its collectives). Lightning 2.6's handler broadcast over
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
    assert saved["epoch"] == 1 and saved["pipetransformer"]["plan"]["active_ranks"] == [0, 1]
    # What the checkpoint holds is the uninterrupted run's state at that step.
    step = saved["global_step"]
    assert (step == 8) == (stop == "sigterm-transition"), step  # inside the transition: before epoch 1's first batch
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
    if stop == "sigterm-transition":
        for key, value in uninterrupted["state"].items():
            torch.testing.assert_close(final["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
