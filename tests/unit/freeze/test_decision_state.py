"""AutoDP's agree message carries AutoFreeze's decisions, not its gradient sums (rank 0 alone reads them)."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import torch

from lightning_pipetransformer.coordinator import Coordinator
from lightning_pipetransformer.dp.replicas import Elastic, Ranks
from lightning_pipetransformer.plan import Plan
from tests.unit.freeze.test_non_finite_steps import callback_on, one_step


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def test_decision_state_leaves_the_gradient_sums_out_and_loads():
    freeze, blocks = callback_on("autofreeze")
    one_step(freeze, blocks, 1.0)
    full = freeze.state_dict()
    sums = _tensor_bytes(full["grad_sums"])
    assert sums > 10_000  # a copy of the blocks' size
    decisions = freeze.decision_state()
    assert "grad_sums" not in decisions and _tensor_bytes(decisions) == 0
    assert {k: v for k, v in full.items() if k != "grad_sums"} == decisions
    other, _ = callback_on("autofreeze")
    other.load_state_dict(decisions)
    assert other.num_frozen == freeze.num_frozen and other.freeze_rule.statistics.sums is None


def test_the_agree_message_ships_no_gradient_sums(monkeypatch):
    freeze, blocks = callback_on("autofreeze")
    one_step(freeze, blocks, 1.0)
    plan = Plan(num_frozen=0, pipe_len=1, chunks=1, partition=(4,), devices=(("cpu",),), active_ranks=(0, 1))
    sent = []
    replicas = Elastic(0, 2, "gloo", timedelta(seconds=5))
    monkeypatch.setattr(replicas, "agree", lambda message, step: sent.append(message) or message)
    engine = SimpleNamespace(propose=lambda frozen: plan, planner=SimpleNamespace(state_dict=lambda: {"planner": 1}))
    loop = SimpleNamespace(position=lambda: (1, 4))
    coordinator = Coordinator(engine, replicas, loop, stack=None, cache=None, ranks=Ranks(), signals=None, self_check=False, announce=print)
    monkeypatch.setattr(coordinator, "_target_frozen", lambda autofreeze: 0)
    assert coordinator.agree(freeze) == plan
    assert sent and "grad_sums" not in sent[0]["autofreeze"] and _tensor_bytes(sent[0]) == 0
