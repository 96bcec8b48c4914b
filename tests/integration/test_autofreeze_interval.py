"""Freeze points inside epochs (``AutoFreeze(freeze_interval=...)``), the original AutoFreeze rule,
a mid-epoch freeze under the pipeline strategy with the cache, and exact resume between points."""

from __future__ import annotations

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from lightning_pipetransformer.freeze.rules import autofreeze_num_frozen, geometric_num_frozen
from tests.helpers.compare import assert_state_close
from tests.helpers.lightning_models import Classifier, data_for
from tests.helpers.models import ResumableLoader, TextClassifier, loader, text_dataset
from tests.helpers.train_reference import freeze_by_hand
from tests.helpers.trainers import cpu_trainer


def reference_by_steps(frozen_at_step, steps_epochs: int, data, batch_size=4) -> dict:
    """A plain loop that freezes by hand before the optimizer step ``s`` as ``frozen_at_step(s)`` says."""
    module = TextClassifier(num_layers=4)
    module.train()
    optimizer = module.configure_optimizers()
    step = 0
    for _ in range(steps_epochs):
        for ids, labels in loader(data, batch_size):
            freeze_by_hand(module, frozen_at_step(step))
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(module(ids), labels).backward()
            optimizer.step()
            step += 1
    return module.state_dict()


@pytest.mark.parametrize("interval, every", [(3, 3), (0.5, 4)])  # 8 batches per epoch: a half is 4 steps
def test_freeze_points_inside_epochs_equal_a_plain_loop(interval, every):
    data = text_dataset(32)
    module = TextClassifier(num_layers=4)
    freeze = AutoFreeze(rule="schedule", alpha=1 / 3, freeze_interval=interval)
    cpu_trainer(callbacks=[freeze], max_epochs=2).fit(module, loader(data, 4))

    def frozen_at(step):  # the geometric plan of the official code, one step per point
        return min(3, geometric_num_frozen(4, 1 / 3, step // every))

    assert freeze.step_history == [(s, frozen_at(s)) for s in range(every, 16, every) if frozen_at(s) > frozen_at(s - every)]
    assert any(s % 8 for s, _ in freeze.step_history)  # at least one freeze inside an epoch
    assert_state_close(module.state_dict(), reference_by_steps(frozen_at, 2, data))


class _Stream(IterableDataset):
    """The same samples in the same order, from a loader without a length (a stream)."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __iter__(self):
        return iter(self.data)


def test_an_int_freeze_interval_works_on_a_loader_without_a_length(recwarn):
    # Optimizer steps need no epoch length: a stream trains and freezes as the plain loop does
    # (before, AutoFreeze refused it at train start, asking for the int it had been given).
    data = text_dataset(32)
    module = TextClassifier(num_layers=4)
    freeze = AutoFreeze(rule="schedule", alpha=1 / 3, freeze_interval=3)
    cpu_trainer(callbacks=[freeze], max_epochs=2).fit(module, DataLoader(_Stream(data), batch_size=4))

    def frozen_at(step):
        return min(3, geometric_num_frozen(4, 1 / 3, step // 3))

    assert freeze.step_history and freeze.step_history == [(s, frozen_at(s)) for s in range(3, 16, 3) if frozen_at(s) > frozen_at(s - 3)]
    assert_state_close(module.state_dict(), reference_by_steps(frozen_at, 2, data))
    # The run's length is unknown (Lightning says -1 steps): no warning that nothing will be frozen.
    assert not [w for w in recwarn if "nothing will be frozen" in str(w.message)]


def test_the_original_autofreeze_rule():
    # Blocks 0 and 1 changed little (ratios 0.05, 0.1), blocks 2 and 3 a lot: the median of the
    # active ratios is 0.3, the first block reaching it is 2, so blocks 0-1 freeze.
    assert autofreeze_num_frozen(0, [10, 10, 10, 10], [9.5, 9, 5, 15]) == 2
    # Already frozen blocks (norm 0) do not count: block 2 barely changed, block 3 did: 3 frozen.
    assert autofreeze_num_frozen(2, [0, 0, 10, 10], [0, 0, 9.9, 5]) == 3
    # The result never goes back.
    assert autofreeze_num_frozen(2, [0, 0, 10, 10], [0, 0, 5, 9.9]) == 2
    assert autofreeze_num_frozen(1, [10, 10, 10, 10], [10, 10, 10, 10]) == 1
    with pytest.raises(ValueError):
        autofreeze_num_frozen(0, [1.0], [1.0, 2.0])


def test_the_original_autofreeze_rule_in_training_freezes_from_its_second_interval():
    data = text_dataset(32)
    module = TextClassifier(num_layers=4)
    freeze = AutoFreeze(rule="autofreeze", freeze_interval=2)
    cpu_trainer(callbacks=[freeze], max_epochs=2).fit(module, loader(data, 4))
    # The first point only records the norms; every freeze comes at a later point, inside epochs.
    assert freeze.step_history and all(step >= 4 for step, _ in freeze.step_history)
    assert [f for _, f in freeze.step_history] == sorted({f for _, f in freeze.step_history})


@pytest.mark.parametrize("strategy", [
    lambda: PipeTransformerStrategy(pipe_len=2, chunks=2),
    lambda: PipeTransformerStrategy(cache=True, cache_memory=10**8),
    lambda: PipeTransformerStrategy(pipe_len=2, chunks=2, cache=True, cache_memory=10**8),
])
def test_a_freeze_inside_an_epoch_under_the_pipeline_and_the_cache_equals_plain_training(strategy):
    # 3 batches per epoch, a point every 2 steps: freezes at steps 2 and 4 (inside epochs 0 and 1).
    def run(each):
        module = Classifier("bert")
        freeze = AutoFreeze(rule="schedule", alpha=0.5, freeze_interval=2)
        trainer = cpu_trainer(each, [freeze], max_epochs=3)
        trainer.fit(module, data_for("bert"))
        return module, freeze, trainer

    reference, ref_freeze, _ = run("auto")
    module, freeze, trainer = run(strategy())
    assert freeze.step_history == ref_freeze.step_history == [(2, 2), (4, 3)]
    assert_state_close(module.state_dict(), reference.state_dict(), rtol=1e-4, atol=1e-5)
    assert trainer.strategy.plan.num_frozen == 3
    stats = trainer.strategy.cache_stats
    if stats is not None:  # served: the samples seen after the last freeze hit in the last epoch
        assert stats["autocache/hits"] > 0 and stats["autocache/boundary"] == 3


@pytest.mark.parametrize(
    "rule, strategy",
    [
        ("paper", lambda d: "auto"),
        ("autofreeze", lambda d: "auto"),
        ("schedule", lambda d: "auto"),
        ("paper", lambda d: PipeTransformerStrategy(pipe_len=2, chunks=2, cache=True, cache_dir=str(d), cache_memory=10**8)),
    ],
)
def test_resume_from_a_checkpoint_between_two_freeze_points_is_exact(tmp_path, rule, strategy):
    # Points every 3 steps, 8 steps per epoch; the checkpoint of step 5 is between the points of
    # steps 3 and 6, in the middle of epoch 0, with part of an interval's gradient statistics.
    def run(directory, ckpt_path=None, max_steps=-1):
        module = TextClassifier(num_layers=4)
        freeze = AutoFreeze(rule=rule, alpha=0.5, freeze_interval=3)
        ckpt = ModelCheckpoint(dirpath=directory, every_n_train_steps=5, save_top_k=-1, filename="{step}")
        trainer = cpu_trainer(
            strategy(directory / "cache"), [freeze, ckpt], max_epochs=2, max_steps=max_steps, enable_checkpointing=True,
        )
        trainer.fit(module, ResumableLoader(text_dataset(32), batch_size=4), ckpt_path=ckpt_path)
        return module, freeze

    full, full_freeze = run(tmp_path / "a")
    run(tmp_path / "b", max_steps=5)
    resumed, resumed_freeze = run(tmp_path / "c", ckpt_path=tmp_path / "b" / "step=5.ckpt")
    assert resumed_freeze.step_history == full_freeze.step_history
    assert full_freeze.num_frozen > 0
    assert_state_close(resumed.state_dict(), full.state_dict())


@pytest.mark.parametrize("bad, words", [(0, ">= 1"), (1.5, r"\(0, 1\]"), (-0.5, r"\(0, 1\]"), ("2", "an int"), (True, "an int")])
def test_bad_freeze_interval_is_refused(bad, words):
    with pytest.raises(ValueError, match=words):
        AutoFreeze(freeze_interval=bad)


def test_freeze_interval_excludes_a_per_epoch_plan():
    with pytest.raises(ValueError, match="one of them"):
        AutoFreeze(freeze_interval=2, schedule={1: 1})
    with pytest.raises(ValueError, match="not both"):
        AutoFreeze(freeze_interval=2, freeze_every_n_epochs=2)
    with pytest.raises(ValueError, match="percentile"):
        AutoFreeze(rule="autofreeze", percentile=100)
