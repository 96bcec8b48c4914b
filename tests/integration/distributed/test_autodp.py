"""AutoDP: 4 CPU processes (gloo), pipe length 4 -> 2 -> 1, idle ranks join as replicas.

Each test launches tests/integration/scripts/autodp.py (Lightning re-launches it per rank) with a hard
timeout, and compares what every rank wrote with a one-process reference that trains the same
global batches with the same freeze schedule.

The reference's global batches: Lightning's injected DistributedSampler (shuffle, seed 0) takes
``perm = randperm(N, seed + epoch)`` and gives replica ``r`` of ``R`` the positions ``r, r+R, ...``.
Replica ``r``'s ``i``-th batch of ``b`` is then positions ``{r + R*j : i*b <= j < (i+1)*b}``, and the
union over replicas is the contiguous slice ``perm[i*b*R : (i+1)*b*R]``. DDP averages the replicas'
mean losses' gradients, which is the gradient of the mean over that slice: the reference steps
on ``perm`` in slices of the global batch ``b*R``.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers.launch import is_alive, kill_session, launch_ranks
from tests.helpers.models import TextClassifier, text_dataset
from tests.helpers.train_reference import freeze_by_hand

pytestmark = pytest.mark.distributed  # several processes: deselected by -m "not distributed"

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "autodp.py"
SCHEDULE = {0: 0, 1: 2, 2: 3}
REPLICAS = {0: 1, 1: 2, 2: 4}  # what the planner makes of SCHEDULE with frozen_cost=0 on 4 processes
PIPE_LEN = {0: 4, 1: 2, 2: 1}
NUM_SAMPLES = 32


def launch(out: Path, *args: str, timeout: float = 240, cleanup: bool = True) -> subprocess.CompletedProcess:
    return launch_ranks(SCRIPT, out, *args, timeout=timeout, cleanup=cleanup)


def reference(global_batch: dict[int, int], epochs: int = 3, arch: str = "bert") -> dict[str, torch.Tensor]:
    """One process: the freeze schedule by requires_grad, the global batches of the 4-process run."""
    data = text_dataset(NUM_SAMPLES)
    module = TextClassifier(num_layers=4, arch=arch)
    module.train()
    optimizer = module.configure_optimizers()
    for epoch in range(epochs):
        freeze_by_hand(module, SCHEDULE[epoch])
        perm = torch.randperm(NUM_SAMPLES, generator=torch.Generator().manual_seed(epoch))
        size = global_batch[epoch]
        for start in range(0, NUM_SAMPLES, size):
            index = perm[start : start + size]
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(module(data.tensors[0][index]), data.tensors[1][index]).backward()
            optimizer.step()
    return module.state_dict()


def results(out: Path) -> list[dict]:
    return [torch.load(out / f"rank{rank}.pt") for rank in range(4)]


def assert_replicas_identical_and_match(
    ranks: list[dict], expected: dict[str, torch.Tensor], joined_last: int | None = 1, arch: str = "bert"
) -> None:
    for key, value in expected.items():
        for rank in ranks[1:]:
            torch.testing.assert_close(rank["state"][key], ranks[0]["state"][key], rtol=0, atol=0, msg=key)
        torch.testing.assert_close(ranks[0]["state"][key], value, rtol=1e-4, atol=1e-5, msg=key)
    # Optimizer state reached the new replicas: every trainable parameter's momentum is on every
    # rank and identical. A joining rank is not sent the momentum of parameters AutoFreeze has
    # frozen (they never thaw, so it is never read again): it holds those only if it was a replica
    # before they froze, and then they equal rank 0's. Rank 0 (checkpoints) keeps the full state.
    trainable = ranks[0]["trainable"]
    assert trainable and all(rank["trainable"] == trainable for rank in ranks)
    assert set(ranks[0]["momentum"]) == {name for name, _ in TextClassifier(num_layers=4, arch=arch).named_parameters()}
    for rank in ranks:
        assert set(trainable) <= set(rank["momentum"]) <= set(ranks[0]["momentum"])
        for name, buffer in rank["momentum"].items():
            torch.testing.assert_close(buffer, ranks[0]["momentum"][name], rtol=0, atol=0, msg=name)
    if joined_last is not None:  # it joined after the last freeze: no frozen state was sent to it
        assert set(ranks[joined_last]["momentum"]) == set(trainable)


@pytest.mark.parametrize(
    "policy, batch_size, per_replica, global_batch, arch",
    [
        # global batch fixed at 8: 8, 4, 2 per replica; the plain optimisation.
        ("global", 8, {0: 8, 1: 4, 2: 2}, {0: 8, 1: 8, 2: 8}, "bert"),
        # per-replica batch fixed at 4 (the paper's): global batch 4, 8, 16.
        ("replica", 4, {0: 4, 1: 4, 2: 4}, {0: 4, 1: 8, 2: 16}, "bert"),
        # A decoder (grouped-query attention, rotary embeddings, causal masks passed per block).
        ("global", 8, {0: 8, 1: 4, 2: 2}, {0: 8, 1: 8, 2: 8}, "llama"),
        # Four virtual devices: a block moved under DDP, optimizer state left on a device its
        # parameter left, or a collective on a tensor off the process's device raise, as on GPUs.
        ("global", 8, {0: 8, 1: 4, 2: 2}, {0: 8, 1: 8, 2: 8}, "virtual"),
    ],
)
def test_idle_ranks_join_as_pipeline_shrinks_and_match_reference(tmp_path, policy, batch_size, per_replica, global_batch, arch):
    extra = ("--virtual",) if arch == "virtual" else ("--arch", arch)
    arch = "bert" if arch == "virtual" else arch
    proc = launch(tmp_path, "--policy", policy, "--batch-size", str(batch_size), *extra)
    assert proc.returncode == 0, proc.stdout[-5000:]
    ranks = results(tmp_path)

    for rank, result in enumerate(ranks):
        steps = 0
        for epoch, seen in result["epochs"].items():
            assert (seen["pipe_len"], seen["replicas"], seen["num_frozen"]) == (PIPE_LEN[epoch], REPLICAS[epoch], SCHEDULE[epoch])
            batches = NUM_SAMPLES // global_batch[epoch]
            if rank % PIPE_LEN[epoch] == 0:  # local ranks j*K drive a replica (its first stage is their device)
                assert seen["active"] and seen["batch_sizes"] == [per_replica[epoch]] * batches and not seen["idle_batches"]
            else:  # shadow rank: the same number of batches, none of them loaded
                assert not seen["active"] and not seen["batch_sizes"] and seen["idle_batches"] == batches
            steps += batches
        assert result["global_step"] == steps  # lock-step
    # Engaged: while K > 1 rank 0's pipeline ran every training pass (a bypassed one would run none).
    passes = [ranks[0]["epochs"][e]["pipelined_passes"] for e in sorted(ranks[0]["epochs"])]
    assert passes[0] >= NUM_SAMPLES // global_batch[0] and passes[1] - passes[0] >= NUM_SAMPLES // global_batch[1]
    assert len({r["val_loss"] for r in ranks}) == 1

    assert_replicas_identical_and_match(ranks, reference(global_batch, arch=arch), arch=arch)
    if extra == ("--virtual",):  # validate at K=4 after fit: the weights' sync passed NCCL's device rule, one loss
        assert len({r["validate_k4"] for r in ranks}) == 1


def test_checkpoint_with_idle_ranks_then_resume_equals_uninterrupted(tmp_path):
    # 2 epochs (the checkpoint is written while ranks 1 and 3 are idle, K = 2), then resume to 3.
    (tmp_path / "first").mkdir()
    first = launch(tmp_path / "first", "--mode", "first")
    assert first.returncode == 0, first.stdout[-5000:]
    ckpt = tmp_path / "first" / "ckpt" / "last.ckpt"
    saved = torch.load(ckpt, weights_only=False)
    assert saved["pipetransformer"]["plan"]["active_ranks"] == [0, 2]
    (tmp_path / "resumed").mkdir()
    resumed = launch(tmp_path / "resumed", "--mode", "resume", "--ckpt", str(ckpt))
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    ranks = results(tmp_path / "resumed")
    assert all(r["global_step"] == 12 and r["epochs"][2]["replicas"] == 4 for r in ranks)
    assert_replicas_identical_and_match(ranks, reference({0: 8, 1: 8, 2: 8}))


def test_a_dead_rank_ends_the_run_with_an_error_not_a_hang(tmp_path):
    # Rank 2 (a replica in epoch 1, with idle ranks 1 and 3) dies in the middle of the epoch.
    # The timeout must also cover start-up (the rendezvous) on a loaded 2-core machine.
    timeout = 60.0
    start = time.monotonic()
    proc = launch(tmp_path, "--mode", "kill", "--timeout", str(timeout), timeout=3 * timeout + 60, cleanup=False)
    try:
        assert proc.returncode != 0, proc.stdout[-5000:]
        assert not any((tmp_path / f"rank{r}.pt").exists() for r in range(4))
        # Rank 0 names the rank that died (on one host its process can be checked): in its error when its
        # collective broke, or, left waiting in one that did not, in the line its watch printed before ending it.
        error0 = (tmp_path / "error0").read_text() if (tmp_path / "error0").exists() else ""
        assert "rank 2 (pid" in error0 or "[pipetransformer] rank 0: rank 2 (pid" in proc.stdout, proc.stdout[-5000:]
        # Every other rank ends too (with its own error, or killed by rank 0's launcher), in bounded time.
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(4)]
        deadline = time.monotonic() + timeout
        while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not any(is_alive(pid) for pid in pids), "a rank outlived the timeout after a peer died"
        print(f"dead-rank run ended after {time.monotonic() - start:.0f}s: {error0[:300]}")
    finally:
        kill_session(proc.pid)


def test_sigterm_inside_a_transition_ends_every_rank_promptly_with_a_checkpoint_to_resume_from(tmp_path):
    # SIGTERM to rank 0 right after epoch 1's plan broadcast, while the others wait in the
    # transition's collectives. Lightning's handler broadcasts over the world group at once: it
    # used to pair with nothing and hang every rank until the collective timeout (120 s here).
    timeout = 120.0
    (tmp_path / "stopped").mkdir()
    proc = launch(tmp_path / "stopped", "--mode", "sigterm", "--timeout", str(timeout), timeout=3 * timeout + 60, cleanup=False)
    try:
        pids = [int((tmp_path / "stopped" / f"pid{r}").read_text()) for r in range(4)]
        deadline = time.monotonic() + 30
        while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not any(is_alive(pid) for pid in pids), "a rank outlived the SIGTERM"
    finally:
        kill_session(proc.pid)
    signalled = float((tmp_path / "stopped" / "signalled").read_text())
    assert time.time() - signalled < timeout / 2, proc.stdout[-5000:]  # ended in seconds, not at the timeout
    ckpt = tmp_path / "stopped" / "ckpt" / "on_exception.ckpt"
    assert ckpt.exists(), proc.stdout[-5000:]
    assert not any((tmp_path / "stopped" / f"rank{r}.pt").exists() for r in range(4))  # the fit did not finish
    saved = torch.load(ckpt, weights_only=False)
    assert saved["epoch"] == 1 and saved["pipetransformer"]["plan"]["active_ranks"] == [0, 2]
    # The checkpoint is usable: resuming from it trains to the end, as after a mid-epoch stop.
    (tmp_path / "resumed").mkdir()
    resumed = launch(tmp_path / "resumed", "--mode", "resume", "--ckpt", str(ckpt))
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    ranks = results(tmp_path / "resumed")
    assert all(r["global_step"] == 12 and r["epochs"][2]["replicas"] == 4 for r in ranks)
    assert_replicas_identical_and_match(ranks, reference({0: 8, 1: 8, 2: 8}))


def test_batch_policy_is_checked():
    from lightning_pipetransformer import PipeTransformerStrategy

    with pytest.raises(ValueError, match="batch_policy must be 'replica' or 'global'"):
        PipeTransformerStrategy(batch_policy="per_device")  # type: ignore[arg-type]
