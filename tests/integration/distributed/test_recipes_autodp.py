"""A fine-tuning recipe under AutoDP: PEFT LoRA + reentrant gradient checkpointing, 2 processes, cache on == off.

The rank that joins at the freeze must get the adapters' weights and state, the cache must serve
the frozen prefix on both ranks although the embeddings' output is marked as requiring grad, and
the result must be the run without the cache (tests/integration/scripts/recipes_autodp.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.launch import launch_ranks

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "recipes_autodp.py"
LAUNCH_TIMEOUT = 240


def run(out: Path, cache: int) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    proc = launch_ranks(SCRIPT, out, "--cache", str(cache), timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 60)
def test_lora_with_checkpointing_cached_under_autodp_equals_cache_off(tmp_path):
    off = run(tmp_path / "off", 0)
    on = run(tmp_path / "on", 1)
    for result in (*off, *on):
        assert {e: (r["num_frozen"], r["pipe_len"], r["replicas"]) for e, r in result["epochs"].items()} == {
            0: (0, 2, 1), 1: (3, 1, 2), 2: (3, 1, 2)
        }
    for rank in range(2):
        for key, value in off[rank]["state"].items():
            assert torch.isfinite(on[rank]["state"][key]).all(), key
            torch.testing.assert_close(on[rank]["state"][key], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {key}")
        # Epoch 1 stores this rank's half of the samples; epoch 2 (reshuffled by the distributed sampler) is
        # served from this rank's memory and the other rank's files in the shared directory.
        stats = on[rank]["epochs"][2]["cache"]
        assert stats["autocache/hits"] == 12 and stats["autocache/misses"] == 12, stats
        assert stats["autocache/disk_hits"] > 0
    for key, value in on[0]["state"].items():  # the replicas agree
        torch.testing.assert_close(on[1]["state"][key], value, rtol=0, atol=0, msg=key)
