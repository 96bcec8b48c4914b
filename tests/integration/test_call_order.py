"""What AutoFreeze freezes with the first block is what runs before the stack, and tied embeddings keep training.

Each run is compared with a plain Trainer whose callback freezes by hand exactly the modules that
should freeze (the reference), and each comparison has its engagement check beside it (what
changed after the freeze point, what the cache served).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from tests.helpers.block_runs import ForwardRunsPerEpoch
from tests.helpers.compare import assert_same_weights
from tests.helpers.families import STEPS, FamilyModule, family_data
from tests.helpers.trainers import cpu_trainer


class HandFreeze(Callback):
    """The reference: at the start of epoch 1, requires_grad off and eval mode for the named modules."""

    def __init__(self, paths):
        self.paths = paths

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            for path in self.paths:
                module = pl_module.get_submodule(path)
                module.requires_grad_(False).eval()
                for p in module.parameters():
                    p.grad = None


class Snapshot(Callback):
    """A copy of one parameter at the start of epoch 1 (the freeze point)."""

    def __init__(self, name):
        self.name, self.value = name, None

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            self.value = pl_module.get_parameter(self.name).detach().clone()


GPT2_BLOCKS = [f"model.transformer.h.{i}" for i in range(3)]
GPT2_EMBEDDINGS = ["model.transformer.wte", "model.transformer.wpe", "model.transformer.drop"]


def test_tied_embeddings_keep_training_by_default_and_the_cache_stands_aside_saying_how_to_untie():
    reference = FamilyModule("gpt2")
    cpu_trainer("auto", [HandFreeze(GPT2_BLOCKS)], max_epochs=3).fit(reference, family_data("gpt2"))

    alone = FamilyModule("gpt2")
    head = Snapshot("model.lm_head.weight")
    autofreeze = AutoFreeze(schedule={1: 3})
    cpu_trainer("auto", [autofreeze, head], max_epochs=3).fit(alone, family_data("gpt2"))
    assert_same_weights(alone, reference)
    # Engaged: three blocks froze; the tied head (and the embeddings) kept training after the freeze point.
    assert autofreeze.num_frozen == 3 and "tie_word_embeddings=False" in autofreeze.embeddings_kept_training
    assert not (alone.model.lm_head.weight - head.value).abs().max() < 1e-6
    assert alone.model.transformer.wte.weight.requires_grad

    cached = FamilyModule("gpt2")
    runs = ForwardRunsPerEpoch(cached)
    strategy = PipeTransformerStrategy(pipe_len=2, chunks=2, cache=True, cache_memory=10**8)
    with pytest.warns(UserWarning, match=r"tied to the output head.*tie_word_embeddings=False"):
        cpu_trainer(strategy, [AutoFreeze(schedule={1: 3}), runs], max_epochs=3).fit(cached, family_data("gpt2"))
    assert_same_weights(cached, reference)
    stats = strategy.cache_stats
    # The cache stood aside for every batch once blocks froze (nothing served): the frozen blocks still ran every
    # step (backward reaches the embeddings through them), the active one in two micro-batches.
    assert stats["autocache/hits"] == 0 and stats["autocache/batches_bypassed"] == 2 * STEPS
    assert runs.epochs[2] == [STEPS] * 3 + [2 * STEPS]


def test_naming_tied_embeddings_in_pre_freezes_the_head_with_them_and_says_so():
    module = FamilyModule("gpt2")
    head = Snapshot("model.lm_head.weight")
    with pytest.warns(UserWarning, match="tied to a module after the stack.*stops training too, as asked"):
        cpu_trainer("auto", [AutoFreeze(schedule={1: 3}, pre=GPT2_EMBEDDINGS), head], max_epochs=3).fit(module, family_data("gpt2"))
    assert torch.equal(module.model.lm_head.weight, head.value)  # the head did not move after the freeze point
    assert not module.model.lm_head.weight.requires_grad


XLMR_FROZEN = ["model.roberta.embeddings"] + [f"model.roberta.encoder.layer.{i}" for i in range(3)]


@pytest.mark.parametrize("runner", ["plain", "pipeline"])
def test_a_head_registered_before_the_backbone_keeps_training(runner):
    """transformers 5.x XLMRobertaForSequenceClassification registers `classifier` before `roberta`."""
    from tests.helpers.families import FAMILIES

    assert list(FAMILIES["xlm-roberta"].build()._modules) == ["classifier", "roberta"]  # what makes this test meaningful
    reference = FamilyModule("xlm-roberta")
    cpu_trainer("auto", [HandFreeze(XLMR_FROZEN)], max_epochs=3).fit(reference, family_data("xlm-roberta"))
    module = FamilyModule("xlm-roberta")
    head = Snapshot("model.classifier.out_proj.weight")
    autofreeze = AutoFreeze(schedule={1: 3})
    strategy = "auto" if runner == "plain" else PipeTransformerStrategy(pipe_len=2, chunks=2)
    cpu_trainer(strategy, [autofreeze, head], max_epochs=3).fit(module, family_data("xlm-roberta"))
    assert_same_weights(module, reference)
    # Engaged: the embeddings froze, the head moved after the freeze point.
    assert [p for p, _ in autofreeze.stack.pre] == ["model.roberta.embeddings"]
    assert not module.model.roberta.embeddings.word_embeddings.weight.requires_grad
    assert not (module.model.classifier.out_proj.weight - head.value).abs().max() < 1e-6

    # A resumed run freezes the same modules before its first forward (the order travels in the state).
    state = autofreeze.state_dict()
    assert state["pre"] == ["model.roberta.embeddings"]
    fresh, restored = FamilyModule("xlm-roberta"), AutoFreeze(schedule={1: 3})
    restored._module = fresh
    restored.find_stack(fresh)
    restored.load_state_dict(state)
    assert not fresh.model.roberta.embeddings.word_embeddings.weight.requires_grad
    assert fresh.model.classifier.out_proj.weight.requires_grad


def test_a_freeze_before_the_first_forward_freezes_what_runs_before_the_stack_once_it_is_known():
    """An explicit schedule that freezes at epoch 0 decides before any forward: the prefix freezes after the first."""
    module = FamilyModule("xlm-roberta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cpu_trainer("auto", [AutoFreeze(schedule={0: 2})], max_epochs=1).fit(module, family_data("xlm-roberta"))
    assert not module.model.roberta.embeddings.word_embeddings.weight.requires_grad
    assert module.model.classifier.out_proj.weight.requires_grad
    # The embeddings never took a step: equal to their initial values.
    initial = FamilyModule("xlm-roberta")
    assert torch.equal(module.model.roberta.embeddings.word_embeddings.weight, initial.model.roberta.embeddings.word_embeddings.weight)


def test_a_cache_that_nothing_can_ever_engage_is_said_before_training_and_logged():
    class AtTrainStart(Callback):
        def on_train_start(self, trainer, pl_module):
            self.said = sum("nothing in this run can freeze" in str(w.message) for w in caught)

    module, start = FamilyModule("bert"), AtTrainStart()
    strategy = PipeTransformerStrategy(cache=True, cache_memory=10**8)
    with pytest.warns(UserWarning, match="nothing in this run can freeze a block: there is no AutoFreeze") as caught:
        cpu_trainer(strategy, [start], max_epochs=1).fit(module, family_data("bert"))
    assert start.said == 1  # before training, once
    assert sum("nothing in this run can freeze" in str(w.message) for w in caught) == 1
    assert strategy.cache_stats["autocache/can_engage"] == 0.0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        served = PipeTransformerStrategy(cache=True, cache_memory=10**8)
        cpu_trainer(served, [AutoFreeze(schedule={1: 3})], max_epochs=1).fit(FamilyModule("bert"), family_data("bert"))
    assert not [w for w in seen if "nothing in this run can freeze" in str(w.message)]
    assert served.cache_stats["autocache/can_engage"] == 1.0


def funnel():
    import transformers as T

    torch.manual_seed(0)
    return T.FunnelForSequenceClassification(T.FunnelConfig(vocab_size=40, d_model=32, n_head=2, d_head=16, d_inner=64,
                                                            block_sizes=[2, 2], num_labels=3, hidden_dropout=0.0,
                                                            attention_dropout=0.0, activation_dropout=0.0))


class Funnel(FamilyModule):
    def __init__(self):
        super().__init__("bert")
        self.model = funnel()


@pytest.mark.parametrize("asked", [dict(pipe_len=2, chunks=2), dict(cache=True, cache_memory=10**8)])
def test_blocks_the_model_never_calls_are_refused_before_training(asked):
    """Funnel's blocks are nn.ModuleLists of layers: the runner would never see a pass (found after an epoch, before)."""
    from lightning_pipetransformer.stack.discovery import BlockStackError

    class NoStep(Callback):
        def on_train_batch_start(self, *args):
            raise AssertionError("training started")

    with pytest.raises(BlockStackError, match=r"blocks of 'model.funnel.encoder.blocks' are ModuleList containers.*"
                                              r"layers='model.funnel.encoder.blocks.0'"):
        cpu_trainer(PipeTransformerStrategy(**asked), [AutoFreeze(schedule={1: 1}), NoStep()], max_epochs=3).fit(Funnel(), family_data("bert"))


def test_autofreeze_alone_observes_blocks_that_are_containers_through_their_layers():
    module = Funnel()
    autofreeze = AutoFreeze(schedule={1: 1})
    cpu_trainer("auto", [autofreeze], max_epochs=2).fit(module, family_data("bert"))
    assert not autofreeze.stack.provisional
    assert [p for p, _ in autofreeze.stack.pre][0] == "model.funnel.embeddings"
    assert not module.model.funnel.embeddings.word_embeddings.weight.requires_grad
    assert module.model.classifier.linear_out.weight.requires_grad


class Wav2Vec2Head(FamilyModule):
    """Wav2Vec2's classifier called on the base model's last hidden state: Wav2Vec2ForSequenceClassification itself
    asks for every hidden state on each forward (observed, so the cache would stand aside before any lookup)."""

    def forward(self, x, mask):
        model = self.model
        return model.classifier(model.projector(model.wav2vec2(input_values=x).last_hidden_state).mean(dim=1))


def test_spec_augment_is_named_as_the_reason_the_cache_misses_before_training_and_after():
    module = Wav2Vec2Head("wav2vec2")
    config = module.model.config
    config.mask_time_prob, config.mask_time_length = 0.5, 2
    module.model = type(module.model)(config)  # the masked-position embedding exists only with masking on
    strategy = PipeTransformerStrategy(cache=True, cache_memory=10**8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpu_trainer(strategy, [AutoFreeze(schedule={1: 3})], max_epochs=4).fit(module, family_data("wav2vec2"))
    said = [str(w.message) for w in caught if "SpecAugment: mask_time_prob=0.5" in str(w.message)]
    assert len(said) == 2 and said[0].startswith("AutoCache will miss") and "only 0% of" in said[1]
    assert not [w for w in caught if "padded" in str(w.message)]  # not blamed on padding
    assert strategy.cache_stats["autocache/hits"] == 0


def test_a_trainable_parameter_the_frozen_blocks_read_is_named_with_the_override_that_freezes_it():
    """MPNet with a pre= that leaves out the relative attention bias (found automatically otherwise: families matrix)."""
    from lightning_pipetransformer.cache.store import CacheConfigError

    strategy = PipeTransformerStrategy(cache=True, cache_memory=10**8)
    with pytest.raises(CacheConfigError, match=r"computed from model.mpnet.encoder.relative_attention_bias.weight.*"
                                               r"AutoFreeze\(pre=\[<the modules before the stack>, "
                                               r"'model.mpnet.encoder.relative_attention_bias'\]\)"):
        cpu_trainer(strategy, [AutoFreeze(schedule={1: 3}, pre=["model.mpnet.embeddings"])], max_epochs=3).fit(FamilyModule("mpnet"), family_data("mpnet"))


def test_without_autofreeze_the_strategy_reads_the_call_order_itself():
    """Blocks frozen before fit (as PEFT leaves them) and no AutoFreeze: the head registered first is not the prefix."""

    def frozen_before_fit():
        module = FamilyModule("xlm-roberta")
        for path in XLMR_FROZEN[:3]:  # the embeddings and blocks 0-1
            module.get_submodule(path).requires_grad_(False)
        return module

    reference = frozen_before_fit()
    cpu_trainer("auto", max_epochs=3).fit(reference, family_data("xlm-roberta"))
    module = frozen_before_fit()
    runs = ForwardRunsPerEpoch(module)
    strategy = PipeTransformerStrategy(cache=True, cache_memory=10**8)
    fit = cpu_trainer(strategy, [runs], max_epochs=3)
    fit.fit(module, family_data("xlm-roberta"))
    assert_same_weights(module, reference)
    assert [p for p, _ in strategy.stack.pre] == ["model.roberta.embeddings"]
    # Engaged: the first batch computed the prefix (its call order was being read), the rest of epoch 0 stored it,
    # later epochs were served (blocks 0-1 do not run once cached).
    stats = strategy.cache_stats
    assert stats["autocache/hits"] == 5 * 6 and stats["autocache/batches_bypassed"] == 1
    assert runs.epochs[2][:2] == [0, 0] and runs.epochs[2][2:] == [STEPS, STEPS]
    # Validation after fit (a new set-up, a new stack, no AutoFreeze) reads the order from its own first forward,
    # then is served the other batches from the fit's entries (the same samples: the fit's cache goes on).
    fit.validate(module, family_data("xlm-roberta"), verbose=False)
    assert [p for p, _ in strategy.stack.pre] == ["model.roberta.embeddings"] and not strategy.stack.provisional
    stats = strategy.cache_stats_by_stage["validate"]
    assert stats["autocache/batches_bypassed"] == 1 and stats["autocache/hits"] == 2 * 6 and stats["autocache/misses"] == 0


class EmbedsTwice(FamilyModule):
    """BERT whose loss runs its embeddings again after the model (a regulariser on the embedded tokens)."""

    def __init__(self):
        super().__init__("bert")

    def loss(self, batch):
        x = batch[0]
        return super().loss(batch) + 0.01 * self.model.bert.embeddings(input_ids=x).pow(2).mean()


class OptimizerSteps(Callback):
    def __init__(self):
        self.count = 0

    def on_before_optimizer_step(self, *_):
        self.count += 1


@pytest.mark.parametrize("strategy", ["auto", "pipeline"])
def test_with_autofreeze_a_module_run_before_and_after_the_stack_is_refused_before_the_first_optimizer_step(strategy):
    """Freezing it with the prefix would stop its use after the stack from training: AutoFreeze refuses, naming it."""
    from lightning_pipetransformer.stack.discovery import BlockStackError

    steps = OptimizerSteps()
    made = "auto" if strategy == "auto" else PipeTransformerStrategy(pipe_len=2, chunks=2)
    with pytest.raises(BlockStackError, match=r"'model.bert.embeddings' runs both before the block stack.*AutoFreeze\(pre="):
        cpu_trainer(made, [AutoFreeze(schedule={1: 2}), steps], max_epochs=2).fit(EmbedsTwice(), family_data("bert"))
    assert steps.count == 0


@pytest.mark.parametrize("asked", [dict(pipe_len=2, chunks=2), dict(cache=True, cache_memory=10**8)])
def test_without_autofreeze_a_module_run_before_and_after_the_stack_stays_outside_the_prefix(asked, caplog):
    """Nothing freezes the prefix there, so nothing to refuse (was: refused, advising an AutoFreeze the run does not have).
    With the cache, the embeddings and blocks 0-1 are frozen before fit (as PEFT leaves them)."""
    cached = "cache" in asked

    def made():
        module = EmbedsTwice()
        if cached:
            for path in XLMR_FROZEN[:3]:
                module.get_submodule(path.replace("roberta", "bert")).requires_grad_(False)
        return module

    reference = made()
    cpu_trainer("auto", max_epochs=3).fit(reference, family_data("bert"))
    module = made()
    runs = ForwardRunsPerEpoch(module)
    strategy = PipeTransformerStrategy(**asked)
    with caplog.at_level("INFO"):
        cpu_trainer(strategy, [runs], max_epochs=3).fit(module, family_data("bert"))
    assert_same_weights(module, reference)
    assert "model.bert.embeddings run(s) both before the block stack" in caplog.text
    assert "model.bert.embeddings" in [p for p, _ in strategy.stack.post] and not strategy.stack.provisional
    if not cached:  # engaged: two micro-batches per step (after the first step's probe)
        assert runs.epochs == [[1 + 2 * STEPS] * 4] + [[2 * STEPS] * 4] * 2, runs.epochs
        return
    # Engaged: keyed on what reaches block 0, the frozen blocks 0-1 were served in the last epoch (they did not run).
    assert strategy.cache_stats["autocache/hits"] > 0, strategy.cache_stats
    assert runs.epochs[2][:2] == [0, 0] and runs.epochs[2][2:] == [STEPS, STEPS], runs.epochs


def test_without_autofreeze_a_trainable_module_run_before_and_after_the_stack_keeps_the_cache_from_serving(tmp_path):
    """Kept outside the prefix, the module still feeds the frozen blocks: while it trains a cached boundary
    would be stale (index keys do not see it change, in validation neither), so the cache never serves while it
    trains: said once, exact, nothing served."""
    from tests.helpers.lightning_models import Classifier, indexed_text, inputs_and_labels

    class EmbedsInTheLossToo(Classifier):
        def training_step(self, batch, batch_idx):
            x, y = inputs_and_labels(batch)
            loss = torch.nn.functional.cross_entropy(self(x), y)
            return loss + 0.5 * self.model.bert.embeddings(input_ids=x).pow(2).mean()

    def fitted(strategy):
        module = EmbedsInTheLossToo("bert")
        for block in module.model.bert.encoder.layer[:2]:
            block.requires_grad_(False).eval()
        cpu_trainer(strategy, max_epochs=3).fit(module, indexed_text(), indexed_text(seed=5))
        return module

    strategy = PipeTransformerStrategy(cache=True, cache_key="index", cache_dir=str(tmp_path))
    with pytest.warns(UserWarning, match="model.bert.embeddings.*still require.*grad.*nothing to cache"):
        cached = fitted(strategy)
    assert [p for p, _ in strategy.stack.feeds] == ["model.bert.embeddings"]
    assert strategy.cache_stats["autocache/hits"] == 0 and strategy.cache_stats["autocache/batches_bypassed"] > 0
    from tests.helpers.compare import assert_state_close

    assert_state_close(cached.state_dict(), fitted("auto").state_dict(), rtol=1e-4, atol=1e-5)
