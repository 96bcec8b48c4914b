"""AutoFreeze under a single-device Trainer: equivalence with a plain loop, resume, bad input."""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_pipetransformer import AutoFreeze
from lightning_pipetransformer.stack.discovery import BlockStackError
from tests.helpers.compare import assert_state_close
from tests.helpers.models import TextClassifier, loader, text_dataset
from tests.helpers.train_reference import train_reference
from tests.helpers.trainers import cpu_trainer


class Snapshots(Callback):
    """Parameters at the start of every epoch and at the end of fit."""

    def __init__(self):
        self.at_epoch_start: list[dict[str, torch.Tensor]] = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.at_epoch_start.append({k: v.detach().clone() for k, v in pl_module.named_parameters()})

    def on_fit_end(self, trainer, pl_module):
        self.at_epoch_start.append({k: v.detach().clone() for k, v in pl_module.named_parameters()})


SCHEDULE = {1: 1, 2: 3}


def test_matches_plain_loop_and_frozen_blocks_stop_changing():
    data = text_dataset(32)
    module = TextClassifier(num_layers=4)
    snapshots = Snapshots()
    freeze = AutoFreeze(schedule=SCHEDULE)
    # Snapshots runs after AutoFreeze at epoch start: it sees the freeze of that epoch.
    cpu_trainer(callbacks=[freeze, snapshots], max_epochs=3).fit(module, loader(data))
    assert freeze.num_frozen == 3 and freeze.history == [(1, 1), (2, 3)]

    expected = train_reference(data, lambda e: max([v for k, v in SCHEDULE.items() if k <= e], default=0), 3, 8)
    assert_state_close(module.state_dict(), expected)

    # Over epoch e (snapshot e -> e+1): frozen parameters identical, active ones moved.
    layer = "model.bert.encoder.layer.{}.output.dense.weight"
    for epoch, frozen in enumerate([0, 1, 3]):
        before, after = snapshots.at_epoch_start[epoch], snapshots.at_epoch_start[epoch + 1]
        for index in range(4):
            moved = not torch.equal(before[layer.format(index)], after[layer.format(index)])
            assert moved == (index >= frozen), (epoch, index)
        emb = "model.bert.embeddings.word_embeddings.weight"
        assert (not torch.equal(before[emb], after[emb])) == (frozen == 0)


def test_freeze_changes_the_result():
    """The equivalence test above can fail: a different schedule gives different weights."""
    data = text_dataset(32)
    module = TextClassifier(num_layers=4)
    cpu_trainer(callbacks=[AutoFreeze(schedule={1: 2})], max_epochs=3).fit(module, loader(data))
    other = train_reference(data, lambda e: 1 if e >= 1 else 0, 3, 8)
    with pytest.raises(AssertionError):
        assert_state_close(module.state_dict(), other)


def test_geometric_rule_by_epoch_and_logging(tmp_path, caplog):
    module = TextClassifier(num_layers=4)
    freeze = AutoFreeze(alpha=0.5, rule="schedule", min_active=1)
    from lightning.pytorch.loggers import CSVLogger

    trainer = cpu_trainer(callbacks=[freeze], max_epochs=4, logger=CSVLogger(tmp_path))
    with caplog.at_level(logging.INFO):
        trainer.fit(module, loader(text_dataset(16)))
    # L=4, alpha=1/2: 4(1-0.5^T) = 0, 2, 3, 3.5 -> 0, 2, 3, 4 capped at 3 by min_active=1.
    assert freeze.history == [(1, 2), (2, 3)]
    # One line per freeze, naming the blocks as a reader counts them (one block is "block 2", not "blocks 2..2").
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AutoFreeze: epoch")]
    assert said == ["AutoFreeze: epoch 1: froze blocks 0..1 (2/4 frozen, embeddings too).",
                    "AutoFreeze: epoch 2: froze block 2 (3/4 frozen, embeddings too)."], said  # fmt: skip
    metrics = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    logged = [float(line.split(",")[0]) for line in metrics.splitlines()[1:] if line and line.split(",")[0]]
    assert logged == [0.0, 2.0, 3.0, 3.0]


def test_paper_rule_uses_gradient_norms():
    module = TextClassifier(num_layers=4)
    freeze = AutoFreeze(alpha=0.75)  # geometric bound from 0 is 3: the norms decide below that
    seen = []

    class Spy(Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            seen.append(freeze.freeze_rule.statistics.mean())

    cpu_trainer(callbacks=[Spy(), freeze], max_epochs=2).fit(module, loader(text_dataset(16)))
    norms = seen[1]
    assert norms is not None and len(norms) == 4 and all(n > 0 for n in norms)
    expected = min(3, min(range(4), key=lambda i: norms[i]) + 1)
    assert freeze.num_frozen == expected


def test_resume_equals_uninterrupted(tmp_path):
    data, val = text_dataset(32), text_dataset(16, seed=1)

    def run(ckpt_dir, max_epochs, ckpt_path=None):
        module = TextClassifier(num_layers=4)
        freeze = AutoFreeze(alpha=0.5)  # the paper rule: its gradient sums must survive the checkpoint
        ckpt = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
        trainer = cpu_trainer(callbacks=[freeze, ckpt], max_epochs=max_epochs, enable_checkpointing=True)
        trainer.fit(module, loader(data), loader(val), ckpt_path=ckpt_path)
        return module, freeze

    full, full_freeze = run(tmp_path / "a", 4)
    run(tmp_path / "b", 2)
    resumed, resumed_freeze = run(tmp_path / "c", 4, ckpt_path=tmp_path / "b" / "epoch=1.ckpt")
    assert full_freeze.num_frozen > 0
    assert resumed_freeze.history == full_freeze.history
    assert_state_close(resumed.state_dict(), full.state_dict())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(alpha=1.0), "alpha"),
        (dict(rule="greedy"), "rule"),
        (dict(freeze_every_n_epochs=0), "freeze_every_n_epochs"),
        (dict(min_active=-1), "min_active"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AutoFreeze(**kwargs)


class Spy(Callback):
    steps = 0

    def on_train_batch_start(self, *args):
        Spy.steps += 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(schedule={1: 2, 2: 1}), "decreases"),
        (dict(schedule={1: 4}), "outside"),  # 4 blocks, min_active=1
        (dict(min_active=5), "min_active"),
        (dict(layers="model.nope"), "does not name"),
    ],
)
def test_bad_setup_fails_before_training(kwargs, match):
    Spy.steps = 0
    with pytest.raises((ValueError, BlockStackError), match=match):
        cpu_trainer(callbacks=[AutoFreeze(**kwargs), Spy()], max_epochs=3).fit(TextClassifier(num_layers=4), loader(text_dataset(16)))
    assert Spy.steps == 0


def test_min_active_zero_needs_something_outside_the_stack():
    module = TextClassifier(num_layers=4)
    for p in module.model.classifier.parameters():
        p.requires_grad_(False)
    for p in module.model.bert.pooler.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="nothing to train"):
        cpu_trainer(callbacks=[AutoFreeze(min_active=0)], max_epochs=3).fit(module, loader(text_dataset(16)))


def test_manual_optimization_is_refused():
    class Manual(TextClassifier):
        def __init__(self):
            super().__init__(num_layers=2)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = super().training_step(batch, batch_idx)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    with pytest.raises(ValueError, match="automatic optimization"):
        cpu_trainer(callbacks=[AutoFreeze()], max_epochs=3).fit(Manual(), loader(text_dataset(16)))


def test_user_train_call_does_not_unfreeze_dropout_mode():
    class TrainsEverything(TextClassifier):
        def on_validation_model_train(self):
            self.train()

    module = TrainsEverything(num_layers=3)
    modes = []

    class Mode(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            modes.append(pl_module.model.bert.encoder.layer[0].training)

    cpu_trainer(callbacks=[AutoFreeze(schedule={1: 1}), Mode()], max_epochs=2, limit_train_batches=2).fit(
        module, loader(text_dataset(16)), loader(text_dataset(8))
    )
    assert modes == [True, True, False, False]


def test_a_block_other_code_unfreezes_counts_as_active_again():
    """A callback unfreezes a block AutoFreeze froze: AutoFreeze stops keeping it in eval mode and counts it active
    (so that its rule watches it, and a replica taking its state does not freeze it back); its next point may freeze
    it again (the schedule does, here)."""
    from tests.helpers.lightning_models import Classifier, data_for

    class Unfreeze(Callback):
        def __init__(self) -> None:
            self.seen: list[tuple[int, int, bool]] = []

        def on_train_epoch_start(self, trainer, pl_module):
            block = pl_module.model.bert.encoder.layer[2]
            if trainer.current_epoch == 3:
                block.requires_grad_(True).train()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 0:
                block = pl_module.model.bert.encoder.layer[2]
                self.seen.append((trainer.current_epoch, freeze.num_frozen, block.training))

    freeze, watch = AutoFreeze(schedule={1: 1, 2: 3}), Unfreeze()
    cpu_trainer("auto", [freeze, watch], max_epochs=5).fit(Classifier("bert"), data_for("bert"))
    assert watch.seen == [(0, 0, True), (1, 1, True), (2, 3, False), (3, 2, True), (4, 3, False)]
