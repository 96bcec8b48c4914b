"""AutoCache under AutoDP: 4 CPU processes (gloo), pipe length 4 -> 2 -> 1, cache on == cache off.

tests/integration/scripts/autocache_autodp.py trains a tiny BERT for 3 epochs with the schedule
{1: 2, 2: 3} and ``frozen_cost=0``: epoch 0 has no frozen block and one replica (K = 4), epoch 1
freezes 2 blocks and runs 2 replicas (K = 2), epoch 2 freezes 3 and runs 4 (K = 1). With the
cache on, epoch 1 fills the boundary-2 store (first sight: misses); at the move to boundary 3
the two replicas advance those entries through block 2 into the shared ``cache_dir`` and every
rank synchronizes; epoch 2 then hits everywhere, also on the two ranks that were idle until then
and never computed the prefix themselves.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import launch_ranks

pytestmark = pytest.mark.distributed  # several processes: deselected by -m "not distributed"

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "autocache_autodp.py"
PLAN = {0: (0, 4, 1), 1: (2, 2, 2), 2: (3, 1, 4)}  # epoch: (frozen blocks, pipe length, replicas)
TRAIN, VAL, WORLD = 32, 16, 4
LAUNCH_TIMEOUT = 240


def launch(out: Path, *args: str) -> str:
    """One 4-process run; no rank outlives it, and it never waits past the timeout."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    proc = launch_ranks(SCRIPT, out, *args, timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-5000:]
    print(f"{' '.join(args)}: {time.monotonic() - start:.1f}s")
    return proc.stdout


def results(out: Path) -> list[dict]:
    return [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD)]


def stat(record: dict, name: str) -> float:
    return record["cache"][f"autocache/{name}"]


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT + 60)
def test_cache_on_equals_cache_off_and_new_replicas_hit_advanced_entries(tmp_path):
    """Both key kinds; validation too."""
    launch(tmp_path / "off", "--cache", "0")
    off = results(tmp_path / "off")
    check_plan_and_replicas_agree(off)
    # Content keys (the default), then the paper's dataset-index keys: the ranks must name a
    # sample alike (one namespace for the run), or a joining replica would miss everything.
    for key in ("content", "index"):
        launch(tmp_path / key, "--cache", "1", "--key", key)
        on = results(tmp_path / key)
        check_plan_and_replicas_agree(on)
        check_cache_on_equals_off_and_shared(on, off, tmp_path / key / "cache")


def check_plan_and_replicas_agree(run: list[dict]) -> None:
    for result in run:
        assert {e: (r["num_frozen"], r["pipe_len"], r["replicas"]) for e, r in result["epochs"].items()} == PLAN
    for result in run[1:]:  # DDP: every replica holds the same weights, bit for bit
        for key, value in run[0]["state"].items():
            torch.testing.assert_close(result["state"][key], value, rtol=0, atol=0, msg=key)


def check_cache_on_equals_off_and_shared(on: list[dict], off: list[dict], cache_dir: Path) -> None:
    for rank in range(WORLD):  # cache on == cache off (observed bit-identical on CPU; allclose is the contract)
        for key, value in off[rank]["state"].items():
            torch.testing.assert_close(on[rank]["state"][key], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {key}")
        # Validation is served from the cache too (train and validation index i are different samples).
        for epoch, record in off[rank]["epochs"].items():
            assert on[rank]["epochs"][epoch]["val_loss"] == pytest.approx(record["val_loss"], rel=1e-5, abs=1e-6)

    # cache_memory is the node's: each of its 4 processes keeps a quarter (the default 4 GiB here).
    assert {r["epochs"][0]["memory_budget"] for r in on} == {4 * 2**30 // WORLD}
    # The cache was really used. Epoch 0: nothing frozen, nothing cached.
    assert all(stat(r["epochs"][0], "enabled") == 0 for r in on)
    # Epoch 1 (boundary 2, 2 replicas): first sight of every sample, so all misses, all stored.
    replicas = [r for r in on if r["epochs"][1]["active"]]
    joined = [r for r in on if not r["epochs"][1]["active"]]  # idle in epoch 1, replicas from epoch 2 on
    assert len(replicas) == 2 and len(joined) == 2
    for r in replicas:
        e1 = r["epochs"][1]
        assert (stat(e1, "boundary"), stat(e1, "hits")) == (2, 0) and stat(e1, "misses") == stat(e1, "stored") > 0
    stored_at_2 = sum(stat(r["epochs"][1], "stored") for r in replicas)
    assert stored_at_2 == TRAIN + VAL  # the samplers split both sets: each sample stored once
    # All ranks name the store alike: the fingerprint is of the weights every replica holds
    # (a joining rank must not fingerprint its stale pre-transition weights).
    for epoch in (1, 2):
        assert len({r["epochs"][epoch]["cache_directory"] for r in on if r["epochs"][epoch]["active"]}) == 1
    # Boundary 2 -> 3: the epoch-1 replicas advanced every entry exactly once between them ...
    assert sum(stat(r["epochs"][2], "advanced") for r in on) == stored_at_2
    assert all(stat(r["epochs"][2], "advanced") > 0 for r in replicas)
    # ... so epoch 2 (boundary 3, 4 replicas) hits on every rank, train and validation, without one miss,
    # and the two new replicas never ran the frozen prefix: they read what the others wrote.
    for r in on:
        e2 = r["epochs"][2]
        assert stat(e2, "boundary") == 3 and stat(e2, "misses") == 0
        assert stat(e2, "hits") == TRAIN / WORLD + VAL / WORLD
    # The ranks that already served boundary 2 skip the embeddings in epoch 2 too (under DDP).
    assert all(stat(r["epochs"][2], "embeddings_skipped") > stat(r["epochs"][1], "embeddings_skipped") for r in replicas)
    for r in joined:
        e2 = r["epochs"][2]
        assert stat(e2, "stored") == 0 and stat(e2, "advanced") == 0 and stat(e2, "disk_hits") == stat(e2, "hits")
    # The old boundary's directory is gone; the new one holds every entry, readable by the user only.
    (directory,) = cache_dir.iterdir()
    assert directory.name == on[0]["epochs"][2]["cache_directory"]
    files = list(directory.glob("*.safetensors"))
    assert len(files) == stored_at_2 and all(f.stat().st_mode & 0o077 == 0 for f in files)


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 60)
def test_a_block_unfrozen_at_an_epoch_start_is_followed_by_every_rank(tmp_path):
    """A callback unfreezes block 2 at epoch 3's start (4 replicas since epoch 2, which joined while it was frozen):
    every rank re-plans together at that epoch's first step (boundary 3 -> 2, K stays 1), the cache re-opens on
    every rank, the replicas receive rank 0's optimizer state for the thawed block, and cache on == cache off with
    every replica identical."""
    launch(tmp_path / "off", "--cache", "0", "--epochs", "5", "--unfreeze-at", "3")
    launch(tmp_path / "on", "--cache", "1", "--epochs", "5", "--unfreeze-at", "3")
    off, on = results(tmp_path / "off"), results(tmp_path / "on")
    for run in (off, on):
        for result in run[1:]:
            for key, value in run[0]["state"].items():
                torch.testing.assert_close(result["state"][key], value, rtol=0, atol=0, msg=key)
    for key, value in off[0]["state"].items():
        torch.testing.assert_close(on[0]["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    for run in (off, on):  # block 2 is frozen in epoch 2 and trains again from epoch 3 on, on every rank
        for result in run:
            epochs = result["epochs"]
            assert epochs[2]["block2_end"] == epochs[2]["block2_start"]
            assert epochs[3]["block2_end"] != epochs[3]["block2_start"]
    # Engaged: the boundary re-opened at 2 on every rank and filled in epoch 3; the schedule freezes block 2 again at
    # epoch 4, where the ranks advance those entries into boundary 3 together and are served.
    assert [stat(r["epochs"][3], "boundary") for r in on] == [2.0] * WORLD
    assert sum(stat(r["epochs"][3], "stored") for r in on) > 0
    assert [stat(r["epochs"][4], "boundary") for r in on] == [3.0] * WORLD
    assert all(stat(r["epochs"][4], "hits") > 0 for r in on)
