"""scripts/cached_batch_calls.py, which docs/architecture.md quotes, still runs and still traces a served batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_the_cached_batch_trace_runs_and_names_the_batch_owner():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "cached_batch_calls.py")], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("# one cached training batch (6 rows: 3 hits, 3 misses)")  # engaged: hits and misses
    assert "cache/batch.py:CachedBatch.__init__" in lines  # the one owner of the served batch ran
    assert any(line.startswith("calls between package files: ") for line in lines)
