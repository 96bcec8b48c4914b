"""A cache verdict one replica alone reaches ends every rank within seconds, naming the cause (issue 24).

The first-hit check (``StaleCacheError``) and the repeated-index refusal run per rank; raised on
one replica only, they used to leave the other waiting in DDP's all-reduce until the collective
timeout (600 s here). The ranks now agree on the verdict over the control group before raising.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers.launch import kill_session, launch_ranks

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cache_verdicts.py"
COLLECTIVE_TIMEOUT = 600  # what a rank left waiting would wait for
LAUNCH_TIMEOUT = 150  # start-up, one epoch and the failure, on a loaded 2-core machine: far below it


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize(
    "fault, cause",
    [("stale", "StaleCacheError: AutoCache returned an activation that differs"), ("index", "cache_key='index': batch 0 of the train0 loader holds dataset index")],
)
def test_one_ranks_verdict_ends_both_ranks_naming_it(tmp_path, fault, cause):
    start = time.monotonic()
    proc = launch_ranks(SCRIPT, tmp_path, "--fault", fault, "--timeout", str(COLLECTIVE_TIMEOUT), timeout=LAUNCH_TIMEOUT, cleanup=False)
    try:
        assert proc.returncode != 0, proc.stdout[-5000:]
        errors = {rank: (tmp_path / f"error{rank}").read_text() for rank in range(2) if (tmp_path / f"error{rank}").exists()}
        assert set(errors) == {0, 1}, proc.stdout[-5000:]
        assert cause in errors[1]  # the rank that reached it raises it
        assert "PeerFailedError: Rank 1 failed in" in errors[0] and cause in errors[0]  # the other names it
        print(f"{fault}: both ranks ended after {time.monotonic() - start:.0f}s")
    finally:
        kill_session(proc.pid)
