"""Smooth freezing through Lightning: ``AutoFreeze(anneal=...)``.

The reference is a plain loop that never freezes: the blocks of each annealing interval sit in
their own SGD parameter group, at the learning rate times the curve, and at zero from the freeze
point on. AutoFreeze's run, which freezes them there, must equal it: the annealing is a scaled
learning rate, and once it reached zero the freeze changes nothing. Then: which interval each rule
anneals (``"schedule"`` before its points, ``"paper"`` and ``"autofreeze"`` after their decisions,
freezing one interval later), exact resume from a checkpoint inside an annealing interval,
gradient accumulation, the pipeline strategy with the cache, and the cases where it cannot engage.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from lightning_pipetransformer.stack.declared import block_stack_of
from tests.helpers.compare import assert_state_close
from tests.helpers.lightning_models import Classifier, data_for
from tests.helpers.models import ResumableLoader, TextClassifier, loader, text_dataset
from tests.helpers.trainers import cpu_trainer

LR = 0.05  # TextClassifier's SGD (momentum 0.9, weight decay 0.01)


def curve_of(name: str):
    return {"linear": lambda t: 1 - t, "cosine": lambda t: 0.5 * (1 + math.cos(math.pi * t))}[name]


def unit(module: TextClassifier, source: int, target: int) -> list[nn.Parameter]:
    """By hand: the embeddings (with block 0) and blocks source..target-1 of the tiny BERT."""
    bert = module.model.bert
    params = list(bert.embeddings.parameters()) if source == 0 else []
    for i in range(source, target):
        params += list(bert.encoder.layer[i].parameters())
    return params


def reference(plans, curve: str, epochs: int, batch_size=4, n=32) -> dict:
    """A loop that never freezes: plan (source, target, start, end) runs its blocks at lr * curve over
    steps start..end-1 and at lr 0 from end on."""
    module = TextClassifier(num_layers=4)
    module.train()
    f = curve_of(curve)
    groups, taken = [], set()
    for source, target, start, end in plans:
        params = unit(module, source, target)
        taken |= {id(p) for p in params}
        groups.append({"params": params, "plan": (start, end)})
    groups.append({"params": [p for p in module.parameters() if id(p) not in taken], "plan": None})
    optimizer = torch.optim.SGD(groups, lr=LR, momentum=0.9, weight_decay=0.01)
    step = 0
    for _ in range(epochs):
        for ids, labels in loader(text_dataset(n), batch_size):
            for g in optimizer.param_groups:
                if g["plan"] is not None:
                    start, end = g["plan"]
                    g["lr"] = LR * (1.0 if step < start else 0.0 if step >= end else f((step - start) / (end - start)))
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(module(ids), labels).backward()
            optimizer.step()
            step += 1
    return module.state_dict()


def fit(freeze: AutoFreeze, epochs=2, batch_size=4, **trainer_kwargs) -> TextClassifier:
    module = TextClassifier(num_layers=4)
    cpu_trainer(callbacks=[freeze], max_epochs=epochs, **trainer_kwargs).fit(module, loader(text_dataset(32), batch_size))
    return module


def plans_from(freeze: AutoFreeze, interval: int) -> list[tuple[int, int, int, int]]:
    """(source, target, start, end) of each freeze event: its blocks annealed over the interval before it."""
    out, previous = [], 0
    for step, frozen in freeze.step_history:
        out.append((previous, frozen, step - interval, step))
        previous = frozen
    return out


@pytest.mark.parametrize("curve", ["cosine", "linear"])
def test_schedule_rule_anneals_before_its_points_and_equals_a_scaled_lr_that_never_freezes(curve):
    # L=4, alpha=1/2, a point every 4 of 16 steps: F = 2 at step 4, 3 at step 8 (capped by min_active).
    freeze = AutoFreeze(rule="schedule", alpha=0.5, freeze_interval=4, anneal=curve)
    module = fit(freeze)
    plain = AutoFreeze(rule="schedule", alpha=0.5, freeze_interval=4)
    fit(plain)
    assert freeze.step_history == plain.step_history == [(4, 2), (8, 3)]  # the same freezes as without
    assert_state_close(module.state_dict(), reference([(0, 2, 0, 4), (2, 3, 4, 8)], curve, epochs=2))


@pytest.mark.parametrize(
    "kwargs, plans",
    [
        ({"rule": "schedule", "alpha": 0.5}, [(0, 2, 0, 8), (2, 3, 8, 16)]),  # epochs of 8 steps
        ({"schedule": {1: 1, 2: 3}}, [(0, 1, 0, 8), (1, 3, 8, 16)]),
    ],
    ids=["schedule-rule", "explicit"],
)
def test_epoch_level_plans_anneal_over_the_epoch_before_each_freeze(kwargs, plans):
    freeze = AutoFreeze(anneal="cosine", **kwargs)
    module = fit(freeze, epochs=3)
    assert [f for _, f in freeze.history] == [p[1] for p in plans]
    assert_state_close(module.state_dict(), reference(plans, "cosine", epochs=3))


@pytest.mark.parametrize("rule, first_decision", [("paper", 4), ("autofreeze", 8)])
def test_gradient_rules_decide_as_without_and_freeze_one_interval_later(rule, first_decision):
    # The first decision sees the same training as without anneal (nothing anneals before it), so
    # it picks the same blocks; they anneal over the next interval and freeze at the point after.
    plain = AutoFreeze(rule=rule, alpha=0.5, freeze_interval=4)
    fit(plain)
    freeze = AutoFreeze(rule=rule, alpha=0.5, freeze_interval=4, anneal="cosine")
    module = fit(freeze)
    assert plain.step_history[0][0] == first_decision
    assert freeze.step_history[0] == (first_decision + 4, plain.step_history[0][1])
    assert_state_close(module.state_dict(), reference(plans_from(freeze, 4), "cosine", epochs=2))


def test_a_factor_of_one_is_autofreeze_without_anneal():
    freeze = AutoFreeze(rule="schedule", alpha=0.5, freeze_interval=4, anneal=lambda t: 1.0)
    module = fit(freeze)
    plain = AutoFreeze(rule="schedule", alpha=0.5, freeze_interval=4)
    expected = fit(plain)
    assert freeze.step_history == plain.step_history
    assert_state_close(module.state_dict(), expected.state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize(
    "rule, interval, at, strategy",
    [
        ("schedule", 4, 6, lambda d: "auto"),  # inside the interval 4..7 annealing block 2
        ("paper", 4, 6, lambda d: "auto"),  # the decision of step 4 anneals 4..7
        ("autofreeze", 3, 10, lambda d: "auto"),  # its first freeze decision (step 9 here) anneals 9..11
        ("schedule", None, 5, lambda d: "auto"),  # epoch level: epoch 0 (steps 0..7) anneals blocks 0-1
        ("paper", 4, 6, lambda d: PipeTransformerStrategy(pipe_len=2, chunks=2, cache=True, cache_dir=str(d), cache_memory=10**8)),
    ],
)
def test_resume_from_a_checkpoint_inside_an_annealing_interval_is_exact(tmp_path, rule, interval, at, strategy):
    def run(directory, ckpt_path=None, max_steps=-1):
        module = TextClassifier(num_layers=4)
        extra = {"freeze_interval": interval} if interval is not None else {}
        freeze = AutoFreeze(rule=rule, alpha=0.5, anneal="cosine", **extra)
        ckpt = ModelCheckpoint(dirpath=directory, every_n_train_steps=at, save_top_k=-1, filename="{step}")
        trainer = cpu_trainer(
            strategy(directory / "cache"), [freeze, ckpt], max_epochs=2, max_steps=max_steps, enable_checkpointing=True,
        )  # fmt: skip
        trainer.fit(module, ResumableLoader(text_dataset(32), batch_size=4), ckpt_path=ckpt_path)
        return module, freeze

    full, full_freeze = run(tmp_path / "a")
    _, stopped = run(tmp_path / "b", max_steps=at)
    plan = stopped._anneal.plan
    assert plan is not None and plan.start < at < plan.end  # the checkpoint is inside an annealing interval
    resumed, resumed_freeze = run(tmp_path / "c", ckpt_path=tmp_path / "b" / f"step={at}.ckpt")
    assert resumed_freeze.step_history == full_freeze.step_history and full_freeze.num_frozen > 0
    assert_state_close(resumed.state_dict(), full.state_dict())


def test_gradient_accumulation_anneals_by_optimizer_steps():
    # Batches of 4 accumulated 2 at a time = batches of 8 (mean losses): the same optimizer steps,
    # so the same factors at the same steps; a factor per batch would differ.
    accumulated = AutoFreeze(rule="schedule", alpha=0.5, freeze_interval=2, anneal="linear")
    a = fit(accumulated, batch_size=4, accumulate_grad_batches=2)
    whole = AutoFreeze(rule="schedule", alpha=0.5, freeze_interval=2, anneal="linear")
    b = fit(whole, batch_size=8)
    assert accumulated.step_history == whole.step_history == [(2, 2), (4, 3)]
    assert_state_close(a.state_dict(), b.state_dict(), rtol=1e-4, atol=1e-5)
    assert_state_close(b.state_dict(), reference([(0, 2, 0, 2), (2, 3, 2, 4)], "linear", epochs=2, batch_size=8), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("strategy", [
    lambda: PipeTransformerStrategy(pipe_len=2, chunks=2),
    lambda: PipeTransformerStrategy(pipe_len=2, chunks=2, cache=True, cache_memory=10**8),
])  # fmt: skip
def test_under_the_pipeline_and_the_cache_it_equals_plain_training(strategy):
    # 3 batches per epoch, a point every 2 steps; the blocks sit on two (virtual) devices.
    def run(each):
        module = Classifier("bert")
        freeze = AutoFreeze(rule="schedule", alpha=0.5, freeze_interval=2, anneal="cosine")
        cpu_trainer(each, [freeze], max_epochs=3).fit(module, data_for("bert"))
        return module, freeze

    expected, ref_freeze = run("auto")
    module, freeze = run(strategy())
    assert freeze.step_history == ref_freeze.step_history == [(2, 2), (4, 3)]
    assert_state_close(module.state_dict(), expected.state_dict(), rtol=1e-4, atol=1e-5)
    plain, _ = run_plain()
    assert not torch.allclose(plain.model.bert.encoder.layer[0].output.dense.weight, module.model.bert.encoder.layer[0].output.dense.weight)


def run_plain():
    module = Classifier("bert")
    freeze = AutoFreeze(rule="schedule", alpha=0.5, freeze_interval=2)
    cpu_trainer(callbacks=[freeze], max_epochs=3).fit(module, data_for("bert"))
    return module, freeze


def test_an_interval_of_one_step_cannot_anneal_and_says_so():
    freeze = AutoFreeze(rule="schedule", alpha=0.5, freeze_interval=1, anneal="cosine")
    with pytest.warns(UserWarning, match="needs at least 2"):
        module = fit(freeze, epochs=1)
    plain = AutoFreeze(rule="schedule", alpha=0.5, freeze_interval=1)
    expected = fit(plain, epochs=1)
    assert freeze.step_history == plain.step_history
    assert_state_close(module.state_dict(), expected.state_dict(), rtol=0, atol=0)


def test_several_processes_under_the_pipeline_strategy_turn_it_off_with_the_reason():
    freeze = AutoFreeze(rule="schedule", freeze_interval=4, anneal="cosine")
    freeze.stack = block_stack_of(TextClassifier(num_layers=4))
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(on_freeze_point=lambda *a: None, autofreeze_decides_here=True), world_size=2)
    with pytest.warns(UserWarning, match="AutoDP applies freezes at epoch starts"):
        freeze._setup_anneal(trainer)  # type: ignore[arg-type]
    assert freeze._anneal.annealer is None
    single = types.SimpleNamespace(strategy=types.SimpleNamespace(on_freeze_point=lambda *a: None, autofreeze_decides_here=True), world_size=1)
    freeze._setup_anneal(single)  # type: ignore[arg-type]
    assert freeze._anneal.annealer is not None


@pytest.mark.parametrize("bad", ["exp", 1, lambda t: -1.0])
def test_bad_anneal_is_refused_at_construction(bad):
    with pytest.raises(ValueError, match="anneal"):
        AutoFreeze(anneal=bad)


def test_a_run_with_room_for_one_decision_warns_that_its_lagged_freeze_will_not_come():
    # 16 steps, a point every 10: the paper rule decides at step 10 and would freeze at step 20.
    freeze = AutoFreeze(rule="paper", alpha=0.5, freeze_interval=10, anneal="cosine")
    with pytest.warns(UserWarning, match="with anneal .each freeze one point after its decision. needs two"):
        fit(freeze)
    assert freeze.num_frozen == 0 and freeze._anneal.plan is not None
