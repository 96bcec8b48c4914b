"""The coordinator's pieces that need no second process: the stage devices, the pass boundaries,
one process following the model and its freeze points, a step and a signal without a control group.

No Trainer: the engine of tests/unit/test_engine.py, fake caches and a :class:`LoopSide` of recorders.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch
from torch import nn

from lightning_pipetransformer.coordinator import Coordinator, LoopSide, replaced_blocks
from lightning_pipetransformer.dp.faults import SignalNotice
from lightning_pipetransformer.dp.replicas import Elastic, OneProcess, Ranks, stage_devices
from lightning_pipetransformer.plan import Plan
from tests.unit.test_engine import CPU, engine_for, freeze

PLAN = Plan(num_frozen=0, pipe_len=2, chunks=1, partition=(2, 2), devices=(("cuda:0", "cuda:1"), ("cuda:2", "cuda:3")), active_ranks=(0, 2))


def _loop(logged: list, fitting: bool = True) -> LoopSide:
    def never() -> None:
        raise AssertionError("one process never changes replicas")

    return LoopSide(
        position=lambda: (0, 0), fitting=fitting, module=nn.Linear(1, 1), optimizers=lambda: [], loop_state=lambda: ([], None),
        log_metrics=logged.append, drop_gradient_sync=never, sync_gradients=never, restart_metric_order=never,
        rebuild_train_loader=never, stop_after_this_batch=never,
    )  # fmt: skip


def _one_process(cache=None, fitting: bool = True) -> tuple[Coordinator, list, list]:
    _, engine = engine_for(pipe_len=2)
    logged, said = [], []
    coordinator = Coordinator(
        engine, OneProcess(), _loop(logged, fitting), stack=engine.stack, cache=cache, ranks=Ranks(),
        signals=SignalNotice(), self_check=False, announce=said.append,
    )  # fmt: skip
    return coordinator, logged, said


def test_stage_devices_one_process_a_replica_and_a_shadow_rank():
    elastic = Elastic(2, 4, "gloo", None)
    assert stage_devices(None, Ranks(root_device=CPU), OneProcess()) == (CPU,)
    assert stage_devices(PLAN, Ranks(root_device=CPU), OneProcess()) == (CPU, CPU)  # virtual stages
    replica = Ranks(global_rank=2, local_rank=2, num_processes=4, distributed=True)
    assert stage_devices(PLAN, replica, elastic) == (torch.device("cuda:2"), torch.device("cuda:3"))
    shadow = Ranks(global_rank=1, local_rank=1, num_processes=4, distributed=True)
    assert stage_devices(PLAN, shadow, Elastic(1, 4, "gloo", None)) == ()


def test_the_first_plan_of_one_process_is_the_planners_and_applying_it_says_and_logs_it():
    coordinator, logged, said = _one_process()
    freeze(coordinator.engine, 1)
    plan = coordinator.first_plan(autofreeze=None)
    assert plan.num_frozen == 1 and coordinator.engine.plan is None  # proposed, not yet in force
    coordinator.apply(plan)
    assert coordinator.engine.plan.num_frozen == 1
    assert len(said) == 1 and len(logged) == 1  # the plan's text, and its metrics to the loggers while fitting
    quiet, logged, _ = _one_process(fitting=False)
    quiet.apply(quiet.first_plan(None))
    assert logged == []  # validate/test/predict log no plan


def test_one_process_follows_a_freeze_point_and_the_model_before_a_step():
    coordinator, _, said = _one_process()
    coordinator.apply(coordinator.first_plan(None))
    freeze(coordinator.engine, 2)
    coordinator.on_freeze_point(autofreeze=None, epoch_start=False)  # also inside an epoch
    assert coordinator.engine.plan.num_frozen == 2
    for block in coordinator.stack.blocks[:2]:  # a callback unfreezes: the plan follows before the next step
        block.requires_grad_(True)
    coordinator.follow_the_model(batch_idx=3, autofreeze=None)
    assert coordinator.engine.plan.num_frozen == 0 and "the plan follows the model" in said[-2]  # then the new plan
    count = len(said)
    coordinator.follow_the_model(batch_idx=4, autofreeze=None)  # nothing changed: nothing said
    assert len(said) == count


def test_a_replaced_block_is_found():
    coordinator, _, _ = _one_process()
    coordinator.apply(coordinator.first_plan(None))
    assert replaced_blocks(coordinator.stack) == []
    coordinator.stack.container[1] = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    assert replaced_blocks(coordinator.stack) == [1]


def test_a_pass_begins_at_every_stage_change_and_epoch_and_after_validation_only_if_it_saw_a_change():
    calls = []
    cache = SimpleNamespace(changed=None, new_pass=lambda: calls.append("bits"), indices=SimpleNamespace(new_pass=lambda: calls.append("indices")))
    coordinator, _, _ = _one_process(cache)
    coordinator.new_pass("train", 0)
    assert calls == ["bits", "indices"]
    coordinator.new_pass("train", 1)
    assert calls == ["bits", "indices"]  # inside the pass
    coordinator.new_pass("val", 0)
    coordinator.new_pass("train", 5)  # training resumes, the validation saw no change: index probes only
    assert calls == ["bits", "indices", "bits", "indices", "indices"]
    cache.changed = object()
    coordinator.new_pass("val", 0)
    coordinator.new_pass("train", 6)
    assert calls[-2:] == ["bits", "indices"]


def test_without_a_control_group_a_step_just_runs_and_no_signal_is_agreed():
    coordinator, _, _ = _one_process()
    coordinator.signals(15, None)  # noted; one process has nobody to agree with (Lightning's own handler acts)
    assert coordinator.step_together("training_step", lambda: "loss") == "loss"
    coordinator.agree_on_signal("the transition")
    assert coordinator.stopping_signal == 0 and not coordinator.failing_together


def _devices(*names: str) -> tuple[tuple[str, ...], ...]:
    return tuple((name,) for name in names)


def test_the_allocators_cache_is_emptied_only_for_the_devices_blocks_left(monkeypatch):
    """Issue 40, item 7: a plan change that moves no block keeps the allocator's cache; one that moves blocks off a
    device of this process empties it, naming the devices left (here rank 0 of 4, pipe length 2 -> 1, on virtual
    devices). Before, every plan applied on an active rank emptied it."""
    from lightning_pipetransformer import coordinator as coordinator_module
    from lightning_pipetransformer.devices import VirtualDevices

    released: list[tuple[torch.device, ...]] = []
    monkeypatch.setattr(coordinator_module.dev, "release_cached_memory", lambda left: released.append(tuple(left)))
    _, engine = engine_for(pipe_len=2)
    cpu = [torch.device("cpu", i) for i in range(4)]
    ranks = Ranks(global_rank=0, local_rank=0, num_processes=4, root_device=cpu[0], distributed=True)
    coordinator = Coordinator(
        engine, Elastic(0, 4, "gloo", None), _loop([]), stack=engine.stack, cache=None, ranks=ranks,
        signals=SignalNotice(), self_check=False, announce=lambda text: None,
    )  # fmt: skip
    pipelined = Plan(num_frozen=0, pipe_len=2, chunks=1, partition=(2, 2), devices=(("cpu:0", "cpu:1"), ("cpu:2", "cpu:3")), active_ranks=(0, 2))
    with VirtualDevices():
        for block in engine.stack.blocks:
            coordinator_module.dev.place_module(block, cpu[0])  # where model_to_device leaves the blocks
        coordinator.apply(pipelined)
        assert released == [(cpu[0],)]  # blocks 2 and 3 left cpu:0 for cpu:1
        released.clear()
        freeze(engine, 1)
        coordinator.apply(dataclasses.replace(pipelined, num_frozen=1))  # the boundary moves, no block does
        coordinator.apply(dataclasses.replace(pipelined, num_frozen=1))  # the same plan applied again
        assert released == []
        coordinator.apply(Plan(num_frozen=1, pipe_len=1, chunks=1, partition=(4,), devices=_devices(*map(str, cpu)), active_ranks=(0, 1, 2, 3)))
        assert released == [(cpu[1],)]  # K 2 -> 1: blocks 2 and 3 left cpu:1, which rank 1's replica takes over
        assert {coordinator_module.dev.device_of(p) for p in engine.stack.container.parameters()} == {cpu[0]}

