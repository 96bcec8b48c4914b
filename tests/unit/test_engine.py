"""The engine, the one owner of the plan: propose, apply (which runner is installed), chunks measured, state.

No Trainer and no processes: a small stack of linear blocks, the planner made as the strategy makes it.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_pipetransformer.config import PipeTransformerConfig
from lightning_pipetransformer.dp.replicas import OneProcess
from lightning_pipetransformer.engine import Engine, make_planner
from lightning_pipetransformer.plan import Plan
from lightning_pipetransformer.stack.discovery import find_block_stack
from lightning_pipetransformer.stack.interception import installed_pipeline

CPU = torch.device("cpu")


class Model(nn.Module):
    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(blocks))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def engine_for(pipe_len: int, chunks: int | str = 1) -> tuple[Model, Engine]:
    model = Model()
    stack = find_block_stack(model, "layers")
    config = PipeTransformerConfig(pipe_len=pipe_len, chunks=chunks)
    planner = make_planner(stack, config, num_processes=1, num_nodes=1, root_device=CPU, parallel_devices=[CPU])
    return model, Engine(stack, planner, config.chunks)


def freeze(engine: Engine, num_frozen: int) -> None:
    """What AutoFreeze does before the plan moves (the pipeline refuses a declared-frozen block that trains)."""
    for block in engine.stack.blocks[:num_frozen]:
        block.requires_grad_(False).eval()


def local(plan: Plan) -> Plan:
    """The plan as one process runs it (what the strategy hands the engine)."""
    return OneProcess().localize(plan)


def test_propose_does_not_change_the_plan_in_force_and_apply_does():
    model, engine = engine_for(pipe_len=2, chunks=2)
    x = torch.randn(3, 4)
    reference = model(x)  # nothing installed yet: the model's own loop
    proposed = engine.propose(0)
    assert engine.plan is None and proposed.pipe_len == 2 and proposed.chunks == 2
    applied = engine.apply(local(proposed), active=True, devices=(CPU, CPU))
    assert engine.plan == applied and installed_pipeline(engine.stack.container) is not None
    torch.testing.assert_close(model(x), reference)
    from lightning_pipetransformer.stack.interception import interception_stats

    stats = interception_stats(engine.stack.container)
    assert stats.deferred == 1 and stats.last_block_runs == 2  # one pass through the runner, in M=2 micro-batches


def test_a_plan_of_one_stage_and_one_micro_batch_installs_nothing_and_a_shadow_rank_runs_no_model_work():
    _, engine = engine_for(pipe_len=1)
    freeze(engine, 1)
    engine.apply(local(engine.propose(1)), active=True, devices=(CPU,))
    assert installed_pipeline(engine.stack.container) is None and engine.plan.num_frozen == 1
    _, shadow = engine_for(pipe_len=2, chunks=2)
    shadow.apply(local(shadow.propose(0)), active=False, devices=())
    assert installed_pipeline(shadow.stack.container) is None and shadow.plan is not None


def test_auto_chunks_are_measured_once_per_pipe_length_then_used_and_checkpointed():
    _, engine = engine_for(pipe_len=2, chunks="auto")
    first = engine.apply(local(engine.propose(0)), active=True, devices=(CPU, CPU))
    assert first.chunks == 1 and engine.auto_chunks == {}
    told = []
    engine.announce = told.append
    engine.chunks_measured(2, 3)
    assert engine.plan.chunks == 3 and engine.auto_chunks == {2: 3} and "M=3" in told[0]
    freeze(engine, 1)
    again = engine.apply(local(engine.propose(1)), active=True, devices=(CPU, CPU))
    assert again.pipe_len == 2 and again.chunks == 3  # measured once per pipe length, then reused
    state = engine.state_dict()
    assert state["auto_chunks"] == {"2": 3} and Plan.from_dict(state["plan"]) == engine.plan
    _, restored = engine_for(pipe_len=2, chunks="auto")
    restored.load_state_dict(state)
    assert restored.auto_chunks == {2: 3}


def test_most_replicas_leaves_the_planner_alone():
    _, engine = engine_for(pipe_len=2)
    before = engine.planner.state_dict()
    assert engine.most_replicas(3) >= 1
    assert engine.planner.state_dict() == before


def test_a_pipe_longer_than_the_stack_is_refused_with_what_to_use():
    import pytest

    model = Model(blocks=2)
    stack = find_block_stack(model, "layers")
    with pytest.raises(ValueError, match="use pipe_len <= 2"):
        make_planner(stack, PipeTransformerConfig(pipe_len=3), num_processes=1, num_nodes=1, root_device=CPU, parallel_devices=[CPU])


class FakeCache:
    """Records how the engine opens a boundary; never serves (so the pipeline runner is installed)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def serves(self, num_frozen: int) -> bool:
        return False

    def defer_boundary(self, stack, num_frozen, include_pre, device) -> None:
        self.calls.append(("defer", num_frozen, include_pre))

    def move_boundary(self, stack, num_frozen, include_pre, device, shard, lazy) -> None:
        self.calls.append(("move", num_frozen, include_pre, shard, lazy))


def test_the_cache_boundary_opens_now_and_lazily_with_one_process_and_is_deferred_with_several():
    for defer, expected in ((False, [("move", 1, False, (0, 1), True)]), (True, [("defer", 1, False)])):
        _, engine = engine_for(pipe_len=1)
        engine.cache, engine.include_pre = FakeCache(), False
        freeze(engine, 1)
        engine.apply(local(engine.propose(1)), active=True, devices=(CPU,), defer_boundary=defer)
        assert engine.cache.calls == expected
        assert installed_pipeline(engine.stack.container) is None  # nothing cached at this boundary: the model's loop


def test_the_strategy_syncs_each_cache_boundary_once_on_every_rank():
    from types import SimpleNamespace

    from lightning_pipetransformer.coordinator import Coordinator
    from lightning_pipetransformer.dp.replicas import Ranks

    synced = []
    cache = SimpleNamespace(sync_boundary=lambda group, node: synced.append((group, node)))
    replicas = SimpleNamespace(control_group="control", is_active=lambda plan: True)
    _, engine = engine_for(pipe_len=1)
    engine.apply(local(engine.propose(0)), active=True, devices=(CPU,))
    coordinator = Coordinator(engine, replicas, None, stack=engine.stack, cache=cache, ranks=Ranks(), signals=None, self_check=False, announce=print)
    coordinator.sync_cache_boundary()
    coordinator.sync_cache_boundary()  # the same boundary: nothing to do
    assert synced == [("control", 0)]
    freeze(engine, 2)
    engine.apply(local(engine.propose(2)), active=True, devices=(CPU,))
    coordinator.sync_cache_boundary()
    assert synced == [("control", 0), ("control", 0)]
    coordinator.replicas = SimpleNamespace(control_group=None, is_active=lambda plan: True)
    freeze(engine, 3)
    engine.apply(local(engine.propose(3)), active=True, devices=(CPU,))
    coordinator.sync_cache_boundary()  # one process: nothing to sync over
    assert len(synced) == 2
