"""What a steady-state training step runs across processes (issue 40, item 9): the strategy's step agreement
over the control group, and no per-step collective or host read of Lightning's SIGTERM check.

Lightning 2.6 broadcasts rank 0's ``received_sigterm`` over the world group before every training batch,
on the root device, and reads it back with ``.item()``: under NCCL a collective and a host synchronisation
per step. The strategy's step agreement (``dp/faults.agree_at_step``, gloo) already carries a SIGTERM to
every rank at the same step, so Lightning's is replaced by a local check (``lightning_internals.
replace_sigterm_broadcast``); that a SIGTERM still stops every rank after the same batch, with its
checkpoint, is tests/integration/distributed/test_faults.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.launch import kill_session, launch_ranks

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "step_syncs.py"
LAUNCH_TIMEOUT = 240


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_a_steady_state_step_runs_only_the_strategys_agreement_over_the_control_group(tmp_path):
    proc = launch_ranks(SCRIPT, tmp_path, timeout=LAUNCH_TIMEOUT, cleanup=False)
    try:
        assert proc.returncode == 0, proc.stdout[-5000:]
        for rank in range(2):
            record = json.loads((tmp_path / f"syncs{rank}.json").read_text())
            assert record["steps"] == 2, record
            # One all-reduce per step, the agreement's, over the control group (WORLD under gloo); before, Lightning's
            # broadcast and its .item() (lightning/pytorch/loops/training_epoch_loop.py) came first at every step.
            assert record["seen"] == [["all_reduce", "dp/faults.py", True]] * 2, record["seen"]
    finally:
        kill_session(proc.pid)
