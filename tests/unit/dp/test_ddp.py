"""dp/ddp.py: which way gradients meet for a plan (a wrapper, by hand, or not at all), without processes."""

from __future__ import annotations

import torch
from torch import nn

from lightning_pipetransformer.dp import ddp
from lightning_pipetransformer.dp.ddp import GradientSync, ddp_device_ids

CPU = torch.device("cpu")


def wrap(sync: GradientSync, module: nn.Module, **overrides):
    kwargs = dict(
        group="active", host_group="host", world_size=4, active=True, pipe_len=1, num_replicas=4, root_device=CPU, stage_devices=(CPU,), init_sync=True,
    )
    kwargs.update(overrides)
    return sync.wrap(module, **kwargs)


def test_one_process_and_shadow_ranks_average_nothing():
    module, sync = nn.Linear(2, 2), GradientSync()
    assert wrap(sync, module, world_size=1) is module and not sync.by_hand and sync.gradient_group(module) is None
    assert wrap(sync, module, active=False) is module and not sync.by_hand


def test_a_replica_of_several_stages_is_averaged_by_hand_over_the_active_group(monkeypatch):
    module, sync = nn.Linear(2, 2), GradientSync()
    assert wrap(sync, module, pipe_len=2, num_replicas=2) is module
    assert sync.by_hand and sync.group == "active" and sync.gradient_group(module) == "active"
    calls = []
    monkeypatch.setattr(
        ddp.averaging, "average_gradients", lambda params, group, device, host: calls.append((len(params), group, device, host))
    )
    module.bias.requires_grad_(False)
    sync.average(module.parameters(), CPU)
    assert calls == [(1, "active", CPU, "host")]  # the frozen bias is not averaged; which are used: over the gloo twin
    assert wrap(sync, module, pipe_len=2, num_replicas=1) is module and not sync.by_hand  # the only replica


def test_a_one_stage_replica_is_wrapped_in_ddp_with_the_group_and_init_sync(monkeypatch):
    made = []

    class FakeDDP(nn.Module):
        def __init__(self, module, device_ids, process_group, init_sync, **kwargs):
            super().__init__()
            made.append((device_ids, process_group, init_sync, kwargs))
            self.module, self.process_group = module, process_group

    device_rules = []
    monkeypatch.setattr(ddp, "DistributedDataParallel", FakeDDP)
    monkeypatch.setattr(ddp.dev, "before_wrap", lambda params, device: device_rules.append(("before_wrap", len(params), device)))
    monkeypatch.setattr(ddp.dev, "after_unwrap", lambda: device_rules.append(("after_unwrap",)))
    module, sync = nn.Linear(2, 2), GradientSync({"gradient_as_bucket_view": True})
    module.bias.requires_grad_(False)
    wrapped = wrap(sync, module, init_sync=False)
    assert isinstance(wrapped, FakeDDP) and made == [(None, "active", False, {"gradient_as_bucket_view": True})]
    assert not sync.by_hand and sync.gradient_group(wrapped) == "active"
    assert sync.unwrap(wrapped, module) is module
    assert sync.unwrap(module, module) is module  # not wrapped: nothing to tell the device rules
    # The device rules see the trainable parameters before DDP binds to them, and the unwrap once.
    assert device_rules == [("before_wrap", 1, CPU), ("after_unwrap",)]


def test_ddp_device_ids_follow_the_replica_devices():
    assert ddp_device_ids(CPU, (CPU,)) is None
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert ddp_device_ids(cuda0, (cuda0,)) == [0]
    assert ddp_device_ids(cuda0, (cuda0, cuda1)) is None  # a multi-device module
