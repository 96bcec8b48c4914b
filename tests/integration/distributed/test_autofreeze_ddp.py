"""AutoFreeze under DDPStrategy, 2 CPU processes with gloo, against a 1-process run of the same global batches."""

from pathlib import Path

import pytest
import torch

from tests.helpers.launch import run_script
from tests.helpers.models import text_dataset
from tests.helpers.train_reference import train_reference

pytestmark = pytest.mark.distributed  # several processes: deselected by -m "not distributed"

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ddp_autofreeze.py"


def test_ddp_two_processes_match_single_process_and_skip_frozen_allreduce(tmp_path):
    proc = run_script([str(SCRIPT), "--out", str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rank0 = torch.load(tmp_path / "rank0.pt")
    rank1 = torch.load(tmp_path / "rank1.pt")

    # Frozen parameters left DDP's buckets: each epoch all-reduces exactly the trainable ones.
    steps_per_epoch = 4
    for epoch, trainable in rank0["trainable"].items():
        assert rank0["all_reduced"][epoch] == steps_per_epoch * trainable, (epoch, rank0["all_reduced"])
    assert rank0["trainable"][2] < rank0["trainable"][0]

    schedule = lambda e: {0: 0, 1: 1}.get(e, 3)
    expected = train_reference(text_dataset(32), schedule, epochs=3, batch_size=8)
    for key, value in expected.items():
        torch.testing.assert_close(rank0["state"][key], value, rtol=1e-4, atol=1e-5, msg=key)
        torch.testing.assert_close(rank1["state"][key], rank0["state"][key], rtol=0, atol=0, msg=key)
