"""AutoDP with Trainer options no other multi-process test sets: 4 CPU processes (gloo), K 4 -> 2 -> 1.

tests/integration/scripts/autodp_paths.py trains the tiny BERT of tests/integration/distributed/test_autodp.py (schedule {1: 2, 2: 3},
``frozen_cost=0``: replicas 1 -> 2 -> 4) with gradient accumulation (a last window cut short by
the epoch end), gradient clipping, an LR scheduler stepping every optimizer step, micro-batches,
a dataset that is not a multiple of the batch or of the replicas, ``drop_last`` and bf16-mixed.
Each run is compared with a one-process loop over the same global batches (see
tests/integration/distributed/test_autodp.py's docstring), which here also mimics what Lightning does for each option:

* Lightning's injected DistributedSampler pads the epoch's permutation to a multiple of the
  replicas by repeating its head (``drop_last=False``), so with R replicas the reference steps on
  ``perm + perm[:pad]``; the loader's ``drop_last`` drops a last partial batch per replica, which
  is the global batches' last partial one;
* accumulation divides every loss by ``accumulate_grad_batches`` and steps at the end of each
  window and at the epoch's last batch; clipping is ``clip_grad_norm_`` of the averaged gradient;
  the scheduler steps after every optimizer step.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers.launch import launch_ranks
from tests.helpers.models import TextClassifier, text_dataset
from tests.helpers.train_reference import freeze_by_hand

pytestmark = pytest.mark.distributed  # several processes: deselected by -m "not distributed"

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "autodp_paths.py"
SCHEDULE = {0: 0, 1: 2, 2: 3}
REPLICAS = {0: 1, 1: 2, 2: 4}
PIPE_LEN = {0: 4, 1: 2, 2: 1}
WORLD = 4
GAMMA = 0.9
LAUNCH_TIMEOUT = 240


def launch(out: Path, *args: str) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    proc = launch_ranks(SCRIPT, out, *args, timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-5000:]
    print(f"{' '.join(args)}: {time.monotonic() - start:.1f}s")
    return [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD)]


def epoch_batches(num_samples: int, epoch: int, replicas: int, global_batch: int, drop_last: bool) -> list[torch.Tensor]:
    """The global batches of ``epoch``: Lightning's sampler (seed 0, padded to the replicas), in slices."""
    perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(epoch)).tolist()
    total = -(-num_samples // replicas) * replicas
    perm = (perm + perm[: total - num_samples])  # DistributedSampler(drop_last=False) pads with its head
    batches = [torch.tensor(perm[s : s + global_batch]) for s in range(0, total, global_batch)]
    if drop_last and len(batches[-1]) < global_batch:
        batches = batches[:-1]
    return batches


def reference(
    num_samples: int, global_batch: dict[int, int], drop_last: bool = False, accumulate: int = 1,
    clip: float | None = None, scheduler: bool = False, bf16: bool = False, epochs: int = 3,
    limit: int | None = None, max_steps: int | None = None,
) -> tuple[dict[str, torch.Tensor], int, float]:
    """One process; returns the final state, the optimizer steps and the final LR."""
    data = text_dataset(num_samples)
    module = TextClassifier(num_layers=4)
    module.train()
    optimizer = module.configure_optimizers()
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA) if scheduler else None
    steps = 0
    context = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    for epoch in range(epochs):
        freeze_by_hand(module, SCHEDULE[epoch])
        batches = epoch_batches(num_samples, epoch, REPLICAS[epoch], global_batch[epoch], drop_last)[:limit]
        for i, index in enumerate(batches):
            with context():
                loss = nn.functional.cross_entropy(module(data.tensors[0][index]), data.tensors[1][index])
            (loss / accumulate).backward()
            if (i + 1) % accumulate == 0 or i + 1 == len(batches):
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.grad is not None], clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                steps += 1
                if sched is not None:
                    sched.step()
                if steps == max_steps:
                    return module.state_dict(), steps, optimizer.param_groups[0]["lr"]
    return module.state_dict(), steps, optimizer.param_groups[0]["lr"]


def max_diff(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max(float((state[k].float() - v.float()).abs().max()) for k, v in expected.items() if v.is_floating_point())


def assert_lock_step_and_identical(ranks: list[dict], per_replica: dict[int, list[int]]) -> None:
    for rank, result in enumerate(ranks):
        for epoch, seen in result["epochs"].items():
            assert (seen["pipe_len"], seen["replicas"], seen["num_frozen"]) == (PIPE_LEN[epoch], REPLICAS[epoch], SCHEDULE[epoch])
            batches = len(per_replica[epoch])
            if rank % PIPE_LEN[epoch] == 0:
                assert seen["active"] and seen["batch_sizes"] == per_replica[epoch] and not seen["idle_batches"], (rank, epoch, seen)
            else:
                assert not seen["active"] and not seen["batch_sizes"] and seen["idle_batches"] == batches, (rank, epoch, seen)
        assert result["global_step"] == ranks[0]["global_step"]
        assert result["lr"] == ranks[0]["lr"]
        for key, value in ranks[0]["state"].items():
            torch.testing.assert_close(result["state"][key], value, rtol=0, atol=0, msg=key)
        for key, value in ranks[0]["momentum"].items():
            torch.testing.assert_close(result["momentum"][key], value, rtol=0, atol=0, msg=key)


def test_global_batch_with_accumulation_clipping_step_scheduler_drop_last_and_micro_batches(tmp_path):
    # 36 samples, global batch 8, drop_last: 4 batches per epoch whatever the replicas (8 | 4 x 2 | 2 x 4
    # per replica; the 4 left over are dropped). accumulate 3: steps after batch 3 and at batch 4 (a
    # window cut short by the epoch end). chunks=2: per-replica batches of 2 split into micro-batches of 1.
    ranks = launch(tmp_path, "--policy", "global", "--batch-size", "8", "--num-samples", "36", "--drop-last", "1",
                   "--accumulate", "3", "--clip", "0.05", "--scheduler", "1", "--chunks", "2")
    assert_lock_step_and_identical(ranks, {0: [8] * 4, 1: [4] * 4, 2: [2] * 4})
    expected, steps, lr = reference(36, {0: 8, 1: 8, 2: 8}, drop_last=True, accumulate=3, clip=0.05, scheduler=True)
    assert ranks[0]["global_step"] == steps == 6
    assert ranks[0]["lr"] == pytest.approx(lr) and lr == pytest.approx(0.05 * GAMMA**6)
    for key, value in expected.items():
        torch.testing.assert_close(ranks[0]["state"][key], value, rtol=1e-4, atol=1e-5, msg=key)


def test_replica_batch_bf16_mixed_on_a_dataset_padded_by_the_sampler(tmp_path):
    # 30 samples, 4 per replica: 8 batches (last 2) with one replica, 4 (last 3) with two, and with
    # four the sampler pads to 32 (2 samples twice), 2 batches. bf16-mixed must autocast the
    # replicas as one process does: closer to a bf16 reference than bf16 is to fp32.
    ranks = launch(tmp_path, "--policy", "replica", "--batch-size", "4", "--num-samples", "30", "--precision", "bf16-mixed")
    assert_lock_step_and_identical(ranks, {0: [4] * 7 + [2], 1: [4, 4, 4, 3], 2: [4, 4]})
    global_batch = {0: 4, 1: 8, 2: 16}
    bf16, steps, _ = reference(30, global_batch, bf16=True)
    fp32, _, _ = reference(30, global_batch)
    assert ranks[0]["global_step"] == steps == 14
    gap = max_diff(bf16, fp32)
    assert gap > 1e-4
    assert max_diff(ranks[0]["state"], bf16) < 0.5 * gap, (max_diff(ranks[0]["state"], bf16), gap)


def test_chunks_auto_with_limit_train_batches_and_max_steps(tmp_path):
    # chunks='auto' measures M on each replica's first batch of each new K; 3 of 4 batches per
    # epoch; max_steps=8 stops in epoch 2 after 2 batches, on every rank (idle ones too).
    ranks = launch(tmp_path, "--policy", "global", "--batch-size", "8", "--chunks", "auto", "--limit-train", "3",
                   "--max-steps", "8")
    assert_lock_step_and_identical(ranks, {0: [8] * 3, 1: [4] * 3, 2: [2] * 2})
    expected, steps, _ = reference(32, {0: 8, 1: 8, 2: 8}, limit=3, max_steps=8)
    assert ranks[0]["global_step"] == steps == 8
    for key, value in expected.items():
        torch.testing.assert_close(ranks[0]["state"][key], value, rtol=1e-4, atol=1e-5, msg=key)


def test_resume_from_a_checkpoint_with_three_idle_ranks_then_validate_mid_epoch(tmp_path):
    # last.ckpt after epoch 0 (K = 4: only rank 0 active; accumulation and a per-step scheduler
    # mid-schedule), resumed to epoch 3 with validation twice per epoch across both transitions.
    common = ("--policy", "global", "--batch-size", "8", "--num-samples", "36", "--accumulate", "3", "--scheduler", "1")
    launch(tmp_path / "first", *common, "--epochs", "1", "--save-last", "1")
    ckpt = tmp_path / "first" / "ckpt" / "last.ckpt"
    assert torch.load(ckpt, weights_only=False)["pipetransformer"]["plan"]["active_ranks"] == [0]
    ranks = launch(tmp_path / "resumed", *common, "--epochs", "3", "--val-check-interval", "0.5", "--ckpt", str(ckpt))
    per_replica = {1: [4] * 4 + [2], 2: [2] * 4 + [1]}
    assert all(set(r["epochs"]) == {1, 2} for r in ranks)
    assert_lock_step_and_identical(ranks, per_replica)
    assert all(r["validations"] == 4 for r in ranks)
    expected, steps, lr = reference(36, {0: 8, 1: 8, 2: 8}, accumulate=3, scheduler=True)
    assert ranks[0]["global_step"] == steps == 6 and ranks[0]["lr"] == pytest.approx(lr)
    for key, value in expected.items():
        torch.testing.assert_close(ranks[0]["state"][key], value, rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_paper_rule_every_two_epochs_is_decided_by_rank_zero_alone(tmp_path):
    # Only rank 0 decides under AutoDP; the others freeze what it froze, never more (before: they
    # decided from its half-finished norms, froze 3 blocks to its 2, and the joining replica's DDP
    # all-reduce failed with a size mismatch).
    script = Path(__file__).resolve().parents[1] / "scripts" / "autodp_paper_rule.py"
    proc = launch_ranks(script, tmp_path, timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-5000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    assert [ranks[0]["epochs"][e]["plan_frozen"] for e in range(4)] == [0, 0, 2, 2]
    for result in ranks:
        for epoch, seen in result["epochs"].items():
            assert seen["frozen_blocks"] == seen["plan_frozen"] == ranks[0]["epochs"][epoch]["plan_frozen"], (epoch, seen)
            assert seen["trainable"] == ranks[0]["epochs"][epoch]["trainable"], (epoch, seen)
    replicas = [r for r in ranks if r["epochs"][3]["active"]]
    assert len(replicas) == 2  # K = 2 from epoch 2: ranks 0 and 2 (the joining one trained with rank 0)
    for key, value in ranks[0]["state"].items():
        torch.testing.assert_close(replicas[1]["state"][key], value, rtol=0, atol=0, msg=key)


def test_int_val_check_interval_longer_than_the_shortest_replica_epoch_fails_before_training(tmp_path):
    # batch_policy='replica', 32 samples of batch 4: 8 batches with one replica, 2 with the four
    # the schedule reaches. val_check_interval=3 would be refused by Lightning at the epoch-2
    # transition, after two epochs of training; now every rank raises at setup, before step 1.
    out = tmp_path / "run"
    out.mkdir()
    proc = launch_ranks(SCRIPT, out, "--policy", "replica", "--batch-size", "4", "--val-check-interval", "3",
                        timeout=LAUNCH_TIMEOUT)
    assert proc.returncode != 0
    errors = [(out / f"error{rank}").read_text() for rank in range(WORLD)]
    assert all("val_check_interval=3" in e and "<= 2" in e for e in errors), errors
    assert not list(out.glob("rank*.pt"))
