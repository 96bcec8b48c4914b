"""AutoDP over 2 simulated nodes on localhost: pipelines inside a node, data parallelism across nodes.

Two launches of tests/integration/scripts/autodp_nodes.py with ``NODE_RANK=0`` and ``NODE_RANK=1`` and one
``MASTER_ADDR``/``MASTER_PORT`` (what Lightning's LightningEnvironment reads); each launcher starts
its local rank 1 itself, so the world is 4 processes: global rank = node * 2 + local rank.
``devices=2, num_nodes=2, pipe_len=2``: one pipeline replica per node at the start; the freeze
schedule makes the planner compress K 2 -> 1 and the replicas grow 2 -> 4.

Which ranks are active is not assumed (the layout of the active local ranks is the planner's
business): the script records ``plan.active_ranks``, ``is_active`` and ``plan.replica_index`` and
this test checks them for consistency, then checks every replica's batches against the
reference's data split (see tests/integration/distributed/test_autodp.py's docstring: replica ``r`` of ``R`` gets positions
``r, r+R, ...`` of ``randperm(N, epoch)``), and the final weights against the reference.

Both launcher process groups run in sessions of their own and are killed on timeout and at the
end, so a hang on either "node" fails the test instead of blocking it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import clean_env, is_alive, kill_session
from tests.integration.distributed.test_autodp import NUM_SAMPLES, SCHEDULE, assert_replicas_identical_and_match, reference

pytestmark = pytest.mark.distributed  # several processes: deselected by -m "not distributed"

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "autodp_nodes.py"
NUM_NODES, DEVICES = 2, 2
WORLD = NUM_NODES * DEVICES
PIPE_LEN = {0: 2, 1: 1, 2: 1}  # what the planner makes of SCHEDULE with frozen_cost=0, 2 devices per node
REPLICAS = {0: 2, 1: 4, 2: 4}  # one replica per node, then every process
STRATEGY_TIMEOUT = 120.0  # seconds, every collective (and the start-up rendezvous) of the run
RUN_TIMEOUT = 300.0  # seconds for the whole 2-node run, start-up included, on a loaded 2-core machine


def launch_nodes(out: Path, *args: str, timeout: float = RUN_TIMEOUT) -> list[subprocess.CompletedProcess]:
    """Both "nodes" at once, same master address and port; never waits past ``timeout``.

    Output goes to files (two processes writing to pipes read one after the other could block
    each other). Both sessions are killed at the end whatever happened, so no rank outlives the test.
    """
    env0 = clean_env(NODE_RANK="0")  # a free port, no MASTER_*/RANK/PL_* left from this process
    envs = [env0, {**env0, "NODE_RANK": "1"}]
    logs = [out / f"node{node}.log" for node in range(NUM_NODES)]
    procs: list[subprocess.Popen] = []
    try:
        for node in range(NUM_NODES):
            with open(logs[node], "w") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(SCRIPT), "--out", str(out), "--timeout", str(STRATEGY_TIMEOUT), *args],
                        env=envs[node], stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                    )
                )
        # Wait for the launchers and for the local ranks they started (a launcher may finish
        # before its local rank 1 has written its results).
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            launchers = [p.poll() is None for p in procs]
            if not any(launchers) and not any(is_alive(pid) for pid in _rank_pids(out)):
                break
            time.sleep(0.5)
        hung = [f"launcher {node}" for node, p in enumerate(procs) if p.poll() is None]
        hung += [f"pid {pid}" for pid in _rank_pids(out) if is_alive(pid) and pid not in {p.pid for p in procs}]
    finally:
        for p in procs:
            kill_session(p.pid)
        for p in procs:
            p.wait()
    outputs = [log.read_text() for log in logs]
    if hung:
        pytest.fail(
            f"2-node AutoDP run: {', '.join(hung)} still running after {timeout}s (killed):\n"
            + "\n".join(f"--- node {n} ---\n{o[-3000:]}" for n, o in enumerate(outputs))
        )
    return [subprocess.CompletedProcess(p.args, p.returncode, o, "") for p, o in zip(procs, outputs)]


def _rank_pids(out: Path) -> list[int]:
    """The pids the ranks wrote at start-up (``pid{node}_{local}``), as far as they got."""
    return [int(f.read_text()) for f in sorted(out.glob("pid*_*")) if f.read_text().strip()]


def expected_batches(epoch: int, replica: int, replicas: int, per_replica: int) -> list[list[int]]:
    """The dataset positions of replica ``replica``'s batches: Lightning's DistributedSampler (seed 0)."""
    perm = torch.randperm(NUM_SAMPLES, generator=torch.Generator().manual_seed(epoch)).tolist()
    share = perm[replica::replicas]
    return [share[i : i + per_replica] for i in range(0, len(share), per_replica)]


def check_plan_and_split(ranks: list[dict], per_replica: dict[int, int]) -> None:
    for rank, result in enumerate(ranks):
        node, local = result["env_node_rank"], result["env_local_rank"]
        assert (result["node_rank"], result["local_rank"], result["global_rank"], result["world_size"]) == (
            node, local, rank, WORLD
        ), f"rank file {rank}: Lightning's ranks do not follow NODE_RANK={node}, LOCAL_RANK={local}"

    for epoch in range(3):
        seen = [r["epochs"][epoch] for r in ranks]
        # One plan on every rank (rank 0's, broadcast), and the expected compression.
        for key in ("pipe_len", "replicas", "num_frozen", "partition", "active_ranks"):
            assert len({repr(s[key]) for s in seen}) == 1, f"epoch {epoch}: ranks disagree on {key}: {[s[key] for s in seen]}"
        plan = seen[0]
        assert (plan["pipe_len"], plan["replicas"], plan["num_frozen"]) == (PIPE_LEN[epoch], REPLICAS[epoch], SCHEDULE[epoch]), (
            f"epoch {epoch}: plan {plan}"
        )
        active = plan["active_ranks"]
        replicas = plan["replicas"]
        assert len(active) == replicas and active == sorted(set(active)) and set(active) <= set(range(WORLD))
        assert 0 in active, "global rank 0 (state source, checkpoint writer) must always drive a replica"
        # Pipelines stay inside a node: each node runs G/K replicas, on the same local ranks.
        per_node = [sorted(r % DEVICES for r in active if r // DEVICES == node) for node in range(NUM_NODES)]
        assert all(len(p) == DEVICES // plan["pipe_len"] for p in per_node), f"epoch {epoch}: active local ranks per node {per_node}"
        assert all(p == per_node[0] for p in per_node), f"epoch {epoch}: nodes differ in their active local ranks {per_node}"

        batches = NUM_SAMPLES // (per_replica[epoch] * replicas)
        for rank, s in enumerate(seen):
            assert s["active"] == (rank in active), f"epoch {epoch}, rank {rank}: is_active={s['active']}, active ranks {active}"
            if s["active"]:
                index = active.index(rank)
                assert s["replica_index"] == index
                assert s["sampler"] == {"num_replicas": replicas, "rank": index}
                assert s["ddp_group_size"] == replicas, f"epoch {epoch}, rank {rank}: gradients averaged over {s['ddp_group_size']} ranks"
                assert len(s["stage_devices"]) == plan["pipe_len"]
                # The data split the reference assumes: replica index -> positions index, index+R, ...
                assert s["batches"] == expected_batches(epoch, index, replicas, per_replica[epoch]), (
                    f"epoch {epoch}, rank {rank} (replica {index} of {replicas}): batches {s['batches']}"
                )
                assert not s["idle_batches"]
            else:  # idle: the same number of batches, none of them loaded, no pipeline
                assert not s["batches"] and s["idle_batches"] == batches and not s["stage_devices"]
                assert s["replica_index"] is None and s["ddp_group_size"] is None

    steps = sum(NUM_SAMPLES // (per_replica[e] * REPLICAS[e]) for e in range(3))
    assert [r["global_step"] for r in ranks] == [steps] * WORLD  # lock-step across nodes
    assert len({r["val_loss"] for r in ranks}) == 1


@pytest.mark.timeout(RUN_TIMEOUT + 120)
@pytest.mark.parametrize(
    "policy, batch_size, per_replica, global_batch",
    [
        # global batch fixed at 8: 4 per replica on 2 replicas, then 2 on 4.
        ("global", 8, {0: 4, 1: 2, 2: 2}, {0: 8, 1: 8, 2: 8}),
        # per-replica batch fixed at 4: global batch 8, then 16.
        ("replica", 4, {0: 4, 1: 4, 2: 4}, {0: 8, 1: 16, 2: 16}),
    ],
)
def test_two_nodes_on_localhost_replicas_grow_across_nodes_and_match_reference(tmp_path, policy, batch_size, per_replica, global_batch):
    start = time.monotonic()
    procs = launch_nodes(tmp_path, "--policy", policy, "--batch-size", str(batch_size))
    for node, proc in enumerate(procs):
        assert proc.returncode == 0, f"node {node} exited {proc.returncode}:\n{proc.stdout[-5000:]}"
    print(f"2-node run ({policy}): {time.monotonic() - start:.0f}s")
    # Every rank of both nodes is gone (killed sessions included).
    assert len(_rank_pids(tmp_path)) == WORLD
    assert not any(is_alive(pid) for pid in _rank_pids(tmp_path))

    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    check_plan_and_split(ranks, per_replica)
    # Ranks 1 and 3 join at epoch 1, before block 2 freezes: they hold its momentum too.
    assert_replicas_identical_and_match(ranks, reference(global_batch), joined_last=None)
