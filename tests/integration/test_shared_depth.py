"""ALBERT: one layer group called at every depth (weights shared across depth), issue 45.

With ``num_hidden_groups=1`` there is no stack of distinct blocks: AutoFreeze and the strategy
refuse it before training, naming the shared layer and what the user can do (the refusal was "no
stack found, pass layers=", which cannot work). With a few groups each called several times in a
row, AutoFreeze alone freezes whole groups (checked against freezing by hand) and the pipeline and
the cache refuse it before training. Models are built from configs: nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T
from lightning.pytorch.callbacks import Callback

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from lightning_pipetransformer.stack.discovery import BlockStackError
from tests.helpers.compare import assert_same_weights
from tests.helpers.families import COMMON, LABELS, FamilyModule, family_data
from tests.helpers.trainers import cpu_trainer

SHARED_ONE = (r"ALBERT's encoder 'model.albert.encoder' calls one layer group "
              r"\('model.albert.encoder.albert_layer_groups.0'\) 4 times")
WHAT_TO_DO = (r"weights shared across depth\): there is no stack of distinct blocks to freeze or pipeline"
              r".*freeze by hand.*pipe_len=1, cache=False")


class Albert(FamilyModule):
    """A tiny ALBERT classifier (4 layers, ``groups`` layer groups), no dropout."""

    def __init__(self, groups: int = 1) -> None:
        super().__init__("bert")
        torch.manual_seed(0)
        config = T.AlbertConfig(**COMMON, num_hidden_groups=groups, embedding_size=16, num_labels=LABELS,
                                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0)
        self.model = T.AlbertForSequenceClassification(config)


class NoStep(Callback):
    def on_train_batch_start(self, *args):
        raise AssertionError("training started")


def fit(module, strategy="auto", callbacks=(), epochs=1):
    cpu_trainer(strategy, list(callbacks), max_epochs=epochs).fit(module, family_data("bert"))
    return module


def refused(module, strategy="auto", callbacks=()):
    """Fit, where a refusal must come before the first training batch."""
    fit(module, strategy, [*callbacks, NoStep()], epochs=3)


@pytest.mark.parametrize("layers", [None, "model.albert.encoder.albert_layer_groups"])
def test_autofreeze_refuses_one_shared_layer_before_training(layers):
    with pytest.raises(BlockStackError, match=SHARED_ONE + ".*" + WHAT_TO_DO):
        refused(Albert(), callbacks=[AutoFreeze(schedule={1: 1}, layers=layers)])


@pytest.mark.parametrize("asked", [dict(pipe_len=2), dict(cache=True, cache_memory=10**8)])
@pytest.mark.parametrize("autofreeze", [False, True])
def test_the_strategy_refuses_one_shared_layer_before_training(asked, autofreeze):
    callbacks = [AutoFreeze(schedule={1: 1})] if autofreeze else []
    with pytest.raises(BlockStackError, match=SHARED_ONE + ".*" + WHAT_TO_DO):
        refused(Albert(), PipeTransformerStrategy(**asked), callbacks)


def test_what_the_refusal_suggests_trains_the_model_as_written():
    """PipeTransformerStrategy(pipe_len=1, cache=False) without AutoFreeze: the plain model's weights."""
    plain = fit(Albert(), epochs=2)
    module = fit(Albert(), PipeTransformerStrategy(pipe_len=1, cache=False), epochs=2)
    assert_same_weights(module, plain)
    assert not torch.equal(module.model.classifier.weight, Albert().model.classifier.weight)  # it trained


class FreezeGroupByHand(Callback):
    """At epoch 1: what runs before the groups and group 0 (depths 0 and 1) stop training."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            albert = pl_module.model.albert
            for module in (albert.embeddings, albert.encoder.embedding_hidden_mapping_in, albert.encoder.albert_layer_groups[0]):
                for p in module.parameters():
                    p.requires_grad_(False)
                    p.grad = None


def test_groups_called_several_times_freeze_whole_under_autofreeze_and_are_refused_by_the_pipeline():
    freeze = AutoFreeze(schedule={1: 1})
    module = fit(Albert(groups=2), callbacks=[freeze], epochs=3)
    assert_same_weights(module, fit(Albert(groups=2), callbacks=[FreezeGroupByHand()], epochs=3))
    assert freeze.num_frozen == 1 and freeze.stack.path == "model.albert.encoder.albert_layer_groups"
    group = module.model.albert.encoder.albert_layer_groups
    assert not any(p.requires_grad for p in group[0].parameters()) and all(p.requires_grad for p in group[1].parameters())
    for asked in (dict(pipe_len=2), dict(cache=True, cache_memory=10**8)):
        with pytest.raises(BlockStackError, match=r"calls its 2 layer groups .* 4 times per pass, each several times in a "
                                                  r"row .*weights shared across depth.*Use pipe_len=1 and cache=False"):
            refused(Albert(groups=2), PipeTransformerStrategy(**asked), [AutoFreeze(schedule={1: 1})])
