"""dp/replicas.py with fake groups: data in, data out, no strategy, no trainer, no processes."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from torch import nn

from lightning_pipetransformer.dp import replicas as replicas_module
from lightning_pipetransformer.dp.replicas import Elastic, LockStepError, OneProcess
from lightning_pipetransformer.plan import Plan


def plan(active: tuple[int, ...], k: int = 2) -> Plan:
    return Plan(
        num_frozen=2, pipe_len=k, chunks=1, partition=(2,) * k,
        devices=tuple(tuple(f"cpu:{j * k + s}" for s in range(k)) for j in range(4 // k)), active_ranks=active,
    )


class FakeGroups:
    """Records every collective the replicas ask for; rank 0's broadcasts come from ``sent``."""

    def __init__(self, sent: object = None) -> None:
        self.calls: list[tuple] = []
        self.sent = sent
        self.made = 0

    def control_group(self, backend, timeout):
        self.calls.append(("control_group", backend, timeout))
        return "control"

    def active_group(self, ranks, backend, timeout):
        self.made += 1
        self.calls.append(("active_group", tuple(ranks), backend))
        return f"active{self.made}"

    def host_twin(self, group, ranks, backend, timeout):
        self.calls.append(("host_twin", group, tuple(ranks), backend))
        return group if backend == "gloo" else f"host{self.made}"

    def broadcast_object(self, obj, src, group):
        self.calls.append(("broadcast", src, group))
        return obj if self.sent is None else self.sent

    def destroy_group(self, group):
        self.calls.append(("destroy", group))

    def barrier(self, group):
        self.calls.append(("barrier", group))


@pytest.fixture
def fake(monkeypatch):
    groups = FakeGroups()
    for name in ("control_group", "active_group", "host_twin", "broadcast_object", "destroy_group", "barrier"):
        monkeypatch.setattr(replicas_module.groups, name, getattr(groups, name))
    monkeypatch.setattr(replicas_module.faults, "peer_processes", lambda group: [("host", 1), ("host", 2)])
    return groups


def test_one_process_keeps_one_pipeline_and_everything_runs_here():
    one = OneProcess()
    local = one.localize(plan((0, 2)))
    assert local.active_ranks == (0,) and local.devices == (("cpu:0", "cpu:1"),)
    assert one.is_active(local) and one.decides_here and one.control_group is None
    assert one.sampler_kwargs(local) == {"num_replicas": 1, "rank": 0}


def test_elastic_connects_over_the_control_group_and_rank_zero_decides(fake):
    rank0 = Elastic(0, 4, "gloo", timedelta(seconds=5))
    rank0.connect()
    assert rank0.control_group == "control" and rank0.peers == [("host", 1), ("host", 2)]
    assert fake.calls[0] == ("control_group", "gloo", timedelta(seconds=5))
    assert rank0.decides_here and not Elastic(1, 4, "gloo", timedelta(seconds=5)).decides_here


def test_agree_adds_the_step_on_rank_zero_and_checks_lock_step_elsewhere(fake):
    rank0 = Elastic(0, 4, "gloo", timedelta(seconds=5))
    rank0.control_group = "control"
    message = rank0.agree({"plan": plan((0,)).to_dict()}, (3, 120))
    assert message["step"] == [3, 120] and fake.calls[-1] == ("broadcast", 0, "control")
    fake.sent = message  # what rank 0 broadcast reaches rank 1
    rank1 = Elastic(1, 4, "gloo", timedelta(seconds=5))
    assert rank1.agree(None, (3, 120))["plan"] == message["plan"]
    with pytest.raises(LockStepError, match=r"Rank 1 is at \(epoch, global_step\) \(3, 119\) but rank 0 at \(3, 120\)"):
        rank1.agree(None, (3, 119))


def test_the_sampler_splits_over_active_replicas_and_a_shadow_rank_asks_for_a_replica_share():
    p = plan((0, 2))
    assert Elastic(2, 4, "gloo", timedelta(seconds=5)).sampler_kwargs(p) == {"num_replicas": 2, "rank": 1}
    shadow = Elastic(1, 4, "gloo", timedelta(seconds=5))
    assert not shadow.is_active(p) and shadow.sampler_kwargs(p) == {"num_replicas": 2, "rank": 0}
    assert shadow.sampler_kwargs(None) == {"num_replicas": 4, "rank": 1}


def test_regroup_returns_the_old_group_and_release_frees_it_only_for_its_members(fake):
    elastic = Elastic(0, 4, "nccl", timedelta(seconds=5))
    assert elastic.regroup((0,)) is None and elastic.active_group == "active1"
    old = elastic.regroup((0, 2))
    assert old == "active1" and elastic.active_group == "active2"
    assert ("active_group", (0, 2), "nccl") in fake.calls
    # The gloo twin of each active group, for the host's flags; the old one freed at once (nothing averages then).
    assert ("host_twin", "active2", (0, 2), "nccl") in fake.calls and elastic.active_host_group == "host2"
    assert ("destroy", "host1") in fake.calls
    gloo = Elastic(0, 4, "gloo", timedelta(seconds=5))
    gloo.regroup((0, 2))
    assert gloo.active_host_group == gloo.active_group  # gloo already: the group itself, nothing freed
    assert ("destroy", gloo.active_group) not in fake.calls
    elastic.release(old, was_member=False)
    assert ("destroy", "active1") not in fake.calls  # a non-member holds no communicator to free
    elastic.release(elastic.active_group, was_member=True)
    assert ("destroy", "active2") not in fake.calls  # the group in force is never freed
    elastic.release(old, was_member=True)
    assert ("destroy", "active1") in fake.calls


def test_joining_ranks_place_their_replica_after_the_active_ranks_released_the_gpus(fake):
    """The order of events on each rank: a rank already active applies the plan (moves its blocks
    off the GPUs it leaves, frees their cache) before the barrier; a joining rank only after it."""
    for joining in (False, True):
        fake.calls.clear()
        elastic = Elastic(2 if joining else 0, 4, "nccl", timedelta(seconds=5))
        elastic.control_group = "control"
        elastic.place_in_turn(lambda: fake.calls.append(("apply",)), joining=joining)
        expected = [("barrier", "control"), ("apply",)] if joining else [("apply",), ("barrier", "control")]
        assert fake.calls == expected


def test_close_frees_the_calls_groups_so_the_next_trainer_call_starts_clean(fake):
    for rank, active in ((0, (0, 2)), (1, (0, 2))):  # a replica, and a shadow rank (not in the active group)
        fake.calls.clear()
        elastic = Elastic(rank, 4, "nccl", timedelta(seconds=5))
        elastic.connect()
        elastic.regroup(active)
        elastic.close()
        made = [c for c in fake.calls if c[0] in ("control_group", "active_group")]
        destroyed = [c[1] for c in fake.calls if c[0] == "destroy"]
        # every group it made, the active group's twin and the active group first
        assert len(made) == 2 and destroyed == [f"host{fake.made}", f"active{fake.made}", "control"]
        assert elastic.control_group is None and elastic.active_group is None and elastic.active_host_group is None
        assert elastic.peers == []


def test_sending_goes_over_the_active_group_to_the_joining_ranks_only(monkeypatch):
    seen = []
    monkeypatch.setattr(
        replicas_module.state_transfer, "broadcast_module_state",
        lambda module, src, group, receivers, via: seen.append(("weights", src, group, receivers, via)),
    )  # fmt: skip
    monkeypatch.setattr(
        replicas_module.state_transfer, "broadcast_state",
        lambda state, src, group, receivers, via: seen.append(("state", src, group, receivers, via)) or state,
    )  # fmt: skip
    elastic = Elastic(0, 4, "gloo", timedelta(seconds=5))
    elastic.active_group = "active"
    elastic.send_weights(nn.Linear(2, 2), (2,), torch.device("cpu"))
    assert elastic.send_state({"optimizers": []}, (2,), torch.device("cpu")) == {"optimizers": []}
    assert seen == [("weights", 0, "active", [2], torch.device("cpu")), ("state", 0, "active", [2], torch.device("cpu"))]
