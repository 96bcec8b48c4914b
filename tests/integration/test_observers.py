"""What observes the blocks sees what the plain loop shows it, or the run is refused before training (issues 30, 36).

Beside the recipes matrix: per-layer outputs (``output_hidden_states`` / ``output_attentions``
passed to ``forward`` or set in the config: transformers records them with hooks on every block
call), a user's forward hook and pre-hook on a block, and MoE router logits, each trained through
the pipeline (``pipe_len=2, chunks=2``) and through the cache with a freeze, on tiny GPT-2, BERT and
Llama (Mixtral for the router). Every cell checks what the model or the hook received, step by
step (lists of the same length, batch and values), and the weights, against a plain Trainer; and
that the part engaged: the passes went to the runner and were seen as observed (each block once
per step on the whole batch), or the cache stood aside with its reason. Layer drop,
``use_weighted_layer_sum`` and AltUp streams are refused before the first step. The first-batch
self-check is shown to catch a runner made to diverge, and to name the difference.
"""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
import transformers as T
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from lightning_pipetransformer.cache.cached_stack import CachedStack
from lightning_pipetransformer.pipe.pipeline import Pipeline
from lightning_pipetransformer.stack.interception import interception_stats
from lightning_pipetransformer.stack.model_flags import check_model_flags
from lightning_pipetransformer.stack.self_check import SelfCheckError
from lightning_pipetransformer.stack.stack_call import InterceptionError
from tests.helpers.block_runs import ForwardBackwardRunsPerEpoch
from tests.helpers.compare import assert_same_weights
from tests.helpers.families import BATCH, FamilyModule, family_data
from tests.helpers.trainers import cpu_trainer

EPOCHS, STEPS = 2, 3  # 3 batches of 6 samples per epoch; 2 blocks of 4 frozen at epoch 1
SCHEDULE = {1: 2}
FLAGS = {"hidden_states": ("output_hidden_states",), "attentions": ("output_attentions",)}


class Observed(FamilyModule):
    """Records, per training step, every per-layer output the model returns and what the hooks on block 1 saw.

    ``how``: ``"forward"`` (flags passed to the model's forward), ``"config"`` (set in its config),
    ``"hook"`` (a forward hook on block 1), ``"pre_hook"`` (a forward pre-hook on block 1).
    The per-layer outputs enter the loss, so that wrong ones change the weights as well.
    """

    def __init__(self, family: str, how: str, untie: bool = False) -> None:
        super().__init__(family, untie=untie)
        self.how = how
        self.seen: list[tuple[str, tuple[torch.Tensor, ...]]] = []
        self.model.set_attn_implementation("eager")  # sdpa returns no attention weights
        if how == "config":
            self.model.config.output_hidden_states = True
            self.model.config.output_attentions = True
        blocks = _blocks(self.model)
        if how == "hook":
            blocks[1].register_forward_hook(lambda m, args, out: self._record("hook", out if isinstance(out, torch.Tensor) else out[0]))
        if how == "pre_hook":
            blocks[1].register_forward_pre_hook(lambda m, args, kwargs: self._record("pre_hook", args[0] if args else kwargs["hidden_states"]), with_kwargs=True)

    def _record(self, what: str, *tensors: torch.Tensor) -> None:
        if self.training:
            self.seen.append((what, tuple(t.detach().clone() for t in tensors)))

    def forward(self, x, mask):
        flags = {"output_hidden_states": True, "output_attentions": True} if self.how == "forward" else {}
        out = self.model(input_ids=x, attention_mask=mask, **flags)
        logits = out.logits
        for name in ("hidden_states", "attentions"):
            layers = getattr(out, name, None)
            if layers:
                self._record(name, *layers)
                logits = logits + 0.1 * sum(t.float().mean() for t in layers)
        return logits


def _blocks(model: nn.Module) -> nn.ModuleList:
    for path in ("transformer.h", "bert.encoder.layer", "model.layers"):
        found = model
        try:
            for part in path.split("."):
                found = getattr(found, part)
        except AttributeError:
            continue
        return found
    raise AssertionError(f"no blocks in {type(model).__name__}")


class Interception(Callback):
    """The interception's counts at the end of training (the strategy removes it at teardown)."""

    def on_train_end(self, trainer, pl_module):
        self.stats = copy.copy(interception_stats(trainer.strategy.stack.container))


def fit(module, strategy, callbacks=()):
    cpu_trainer(strategy, [AutoFreeze(schedule=SCHEDULE), *callbacks], max_epochs=EPOCHS).fit(module, family_data(module.family.name))
    return module


def assert_same_seen(got, want):
    """The same records, in the same order: same kinds, same number of layers, same batch, same values."""
    assert [(k, len(t)) for k, t in got] == [(k, len(t)) for k, t in want], ([(k, len(t)) for k, t in got][:6], [(k, len(t)) for k, t in want][:6])
    for step, ((kind, a), (_, b)) in enumerate(zip(got, want)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert x.shape == y.shape, (step, kind, i, x.shape, y.shape)
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=f"step {step} {kind}[{i}]")


def expected_kinds(how):
    return {"hook": {"hook"}, "pre_hook": {"pre_hook"}}.get(how, {"hidden_states", "attentions"})


@pytest.fixture(scope="module")
def plain_runs():
    """The plain Trainer's records and weights, once per (family, how)."""
    cache = {}

    def get(family, how, untie=False):
        if (family, how, untie) not in cache:
            cache[family, how, untie] = fit(Observed(family, how, untie), "auto")
        return cache[family, how, untie]

    return get


@pytest.mark.parametrize("how", ["forward", "config", "hook", "pre_hook"])
@pytest.mark.parametrize("family", ["gpt2", "bert", "llama"])
def test_observers_see_the_plain_loop_through_the_pipeline(family, how, plain_runs):
    plain = plain_runs(family, how)
    assert {k for k, _ in plain.seen} == expected_kinds(how)
    # 4 blocks: the input and 4 outputs; 4 attention maps
    assert all(len(t) == {"hidden_states": 5, "attentions": 4}.get(k, 1) for k, t in plain.seen), [(k, len(t)) for k, t in plain.seen]
    module = Observed(family, how)
    runs, seen = ForwardBackwardRunsPerEpoch(), Interception()
    strategy = PipeTransformerStrategy(pipe_len=2, chunks=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(module, strategy, [runs, seen])
    assert_same_seen(module.seen, plain.seen)
    assert_same_weights(module, plain)
    # Engaged: every training pass went to the two-stage pipeline, and was run as one micro-batch
    # because it was observed (the first step's probe, silenced for observers, is the extra run).
    stats = seen.stats
    assert stats.deferred == stats.observed == EPOCHS * STEPS, stats
    assert runs.forward == [[1 + STEPS] * 4] + [[STEPS] * 4] * (EPOCHS - 1), runs.forward
    assert any("observes the blocks" in str(w.message) for w in caught)


@pytest.mark.parametrize("how", ["forward", "config", "hook", "pre_hook"])
@pytest.mark.parametrize("family", ["gpt2", "bert", "llama"])
def test_observers_see_the_plain_loop_through_the_cache(family, how, plain_runs):
    # Untied (GPT-2): tied input embeddings keep training by default and the cache would stand aside for that.
    plain = plain_runs(family, how, untie=True)
    module = Observed(family, how, untie=True)
    runs = ForwardBackwardRunsPerEpoch()
    strategy = PipeTransformerStrategy(cache=True, cache_memory=10**8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(module, strategy, [runs])
    assert_same_seen(module.seen, plain.seen)
    assert_same_weights(module, plain)
    # The cache was installed once blocks froze, and stood aside on every observed batch, saying why:
    # the frozen blocks ran for every step (a served row would have skipped them and their records).
    stats = strategy.cache_stats
    assert stats["autocache/boundary"] == 2 and stats["autocache/batches_bypassed"] == STEPS and stats["autocache/hits"] == 0, stats
    # Epoch 0 ran the model's own loop (nothing frozen, nothing to cache); epoch 1's first pass through the
    # cached stack is the probe, silenced for the observers (they saw no extra call: the records are equal).
    assert runs.forward == [[STEPS] * 4, [1 + STEPS] * 4], runs.forward
    assert any("AutoCache is not used" in str(w.message) and "observes the blocks" in str(w.message) for w in caught)


def test_a_global_module_hook_sees_each_block_once_per_step_with_the_whole_batch():
    def fit_recording(strategy):
        module = FamilyModule("bert")
        block_type = type(module.model.bert.encoder.layer[0])
        seen = []
        hook = register_module_forward_hook(lambda m, a, out: seen.append(out.detach().clone()) if isinstance(m, block_type) else None)
        try:
            fit(module, strategy)
        finally:
            hook.remove()
        return module, seen

    plain, want = fit_recording("auto")
    module, got = fit_recording(PipeTransformerStrategy(pipe_len=2, chunks=2))
    assert len(want) == 4 * EPOCHS * STEPS and [t.shape for t in got] == [t.shape for t in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert_same_weights(module, plain)


def test_recorders_that_do_not_record_keep_the_micro_batches():
    """Transformers installs its recorders on the first forward that asks for per-layer outputs and keeps
    them: in a forward that does not ask, they are not observers, and the pipeline keeps its M."""
    module = FamilyModule("gpt2")
    module.model(input_ids=torch.randint(3, 40, (2, 5)), output_hidden_states=True)  # a look before training
    runs, seen = ForwardBackwardRunsPerEpoch(), Interception()
    fit(module, PipeTransformerStrategy(pipe_len=2, chunks=2), [runs, seen])
    assert seen.stats.observed == 0 and seen.stats.last_block_runs == 2 * seen.stats.deferred == 2 * EPOCHS * STEPS, seen.stats
    assert runs.forward[1] == [2 * STEPS] * 4, runs.forward


# ---------------------------------------------------------------------------------- router logits (MoE)


class Router(FamilyModule):
    """Tiny Mixtral with its load-balancing loss (``output_router_logits=True``) in the loss; records it per step."""

    def __init__(self) -> None:
        pl_init = super(FamilyModule, self).__init__
        pl_init()
        torch.manual_seed(0)
        self.family = types.SimpleNamespace(name="llama", task="lm")  # same data as the Llama family
        config = T.MixtralConfig(
            vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
            output_router_logits=True, router_aux_loss_coef=0.5, attention_dropout=0.0,
        )  # fmt: skip
        self.model = T.MixtralForCausalLM(config)
        self.aux: list[torch.Tensor] = []

    def loss(self, batch):
        x, mask, _ = batch
        out = self.model(input_ids=x, attention_mask=mask, labels=x)
        if self.training:
            self.aux.append(out.aux_loss.detach().clone())
        return out.loss  # cross-entropy + 0.5 * the router's load-balancing loss


@pytest.mark.parametrize("strategy", ["pipeline", "cache"])
def test_router_logits_enter_the_loss_as_in_the_plain_loop(strategy):
    """Was: the cache left the frozen layers' logits out, the probe added its own, and an attention mask crashed."""
    plain = Router()
    cpu_trainer("auto", [AutoFreeze(schedule=SCHEDULE)], max_epochs=EPOCHS).fit(plain, family_data("llama"))
    module = Router()
    made = PipeTransformerStrategy(pipe_len=2, chunks=2) if strategy == "pipeline" else PipeTransformerStrategy(cache=True, cache_memory=10**8)
    seen = Interception()
    cpu_trainer(made, [AutoFreeze(schedule=SCHEDULE), seen], max_epochs=EPOCHS).fit(module, family_data("llama"))
    assert len(module.aux) == len(plain.aux) == EPOCHS * STEPS
    torch.testing.assert_close(torch.stack(module.aux), torch.stack(plain.aux), rtol=1e-4, atol=1e-5)
    assert_same_weights(module, plain)
    stats = seen.stats
    if strategy == "pipeline":
        assert stats.deferred == stats.observed == EPOCHS * STEPS, stats
    else:
        assert made.cache_stats["autocache/batches_bypassed"] == STEPS, made.cache_stats


# ---------------------------------------------------------------------------------- refused before training


class Steps(Callback):
    def __init__(self):
        self.count = 0

    def on_train_batch_start(self, *_):
        self.count += 1


class KeepsLayers(FamilyModule):
    def forward(self, x, mask):
        out = self.model(input_ids=x, attention_mask=mask, output_hidden_states=True)
        return out.logits + 0.1 * sum(h.mean() for h in out.hidden_states)


def test_per_layer_outputs_a_model_collects_in_its_own_loop_are_refused_in_the_first_step():
    """BLOOM gathers hidden states in its loop (no recorder hooks): they are placeholders, and using one raises
    before the first optimizer step (was: the first step trained with the probe's outputs, without their gradient)."""
    steps = OptimizerSteps()
    with pytest.raises(InterceptionError, match=r"output of block 0 \(mean\).*output_hidden_states=True"):
        cpu_trainer(PipeTransformerStrategy(pipe_len=2, chunks=2), [steps], max_epochs=1).fit(KeepsLayers("bloom"), family_data("bloom"))
    assert steps.count == 0


def test_layer_drop_is_refused_before_training_with_the_fix():
    module = FamilyModule("opt")
    module.model.config.layerdrop = 0.1
    steps = Steps()
    with pytest.raises(ValueError, match=r"layerdrop=0.1.*skip blocks at random.*config.layerdrop=0"):
        cpu_trainer(PipeTransformerStrategy(pipe_len=2, chunks=2), [steps], max_epochs=3).fit(module, family_data("opt"))
    assert steps.count == 0


def test_altup_streams_are_refused_before_training():
    """Gemma3n's hidden state is [altup streams, batch, ...]: was split as if the streams were samples."""
    config = T.Gemma3nTextConfig(
        vocab_size=40, vocab_size_per_layer_input=40, hidden_size=32, hidden_size_per_layer_input=8, intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
        laurel_rank=4, num_kv_shared_layers=0, activation_sparsity_pattern=[0.0] * 4, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )  # fmt: skip
    module = FamilyModule("llama")  # its data: token ids below 40
    module.model = T.Gemma3nForCausalLM(config)
    steps = Steps()
    with pytest.raises(ValueError, match=r"altup_num_inputs=4.*first dimension is not the batch"):
        cpu_trainer(PipeTransformerStrategy(pipe_len=2, chunks=2), [steps], max_epochs=3).fit(module, family_data("llama"))
    assert steps.count == 0


def test_weighted_layer_sum_and_altup_are_refused_by_name():
    config = T.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8), conv_kernel=(3, 3),
        conv_stride=(2, 2), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, use_weighted_layer_sum=True, layerdrop=0.0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="use_weighted_layer_sum=True"):
        check_model_flags(T.Wav2Vec2ForSequenceClassification(config), fitting=True)
    config.use_weighted_layer_sum, config.layerdrop = False, 0.1
    with pytest.raises(ValueError, match="layerdrop=0.1"):
        check_model_flags(T.Wav2Vec2ForSequenceClassification(config), fitting=True)
    check_model_flags(T.Wav2Vec2ForSequenceClassification(config), fitting=False)  # layer drop is off outside training
    gemma3n = nn.Module()
    gemma3n.config = types.SimpleNamespace(altup_num_inputs=4)
    with pytest.raises(ValueError, match="altup_num_inputs=4.*first dimension is not the batch"):
        check_model_flags(gemma3n, fitting=True)


# ---------------------------------------------------------------------------------- the first-batch self-check


class OptimizerSteps(Callback):
    def __init__(self):
        self.count = 0

    def on_before_optimizer_step(self, *_):
        self.count += 1


def _fit_diverging(monkeypatch, runner_cls, wrong, strategy, module=None):
    original = runner_cls.run

    def run(self, call):
        return wrong(original(self, call), call)

    monkeypatch.setattr(runner_cls, "run", run)
    steps = OptimizerSteps()
    module = module or FamilyModule("bert")
    cpu_trainer(strategy, [AutoFreeze(schedule={0: 2}), steps], max_epochs=1).fit(module, family_data("bert"))
    return steps


def test_the_self_check_refuses_a_pipeline_that_returns_other_values(monkeypatch):
    wrong = lambda out, call: out + 1e-2 * out.detach().abs().max()  # noqa: E731
    with pytest.raises(SelfCheckError, match=r"self-check: the pipeline \(ReturnTo\).*hidden state differs by up to") as raised:
        _fit_diverging(monkeypatch, Pipeline, wrong, PipeTransformerStrategy(pipe_len=2, chunks=2))
    assert "self_check=False" in str(raised.value)


def test_the_self_check_stops_before_the_first_optimizer_step(monkeypatch):
    steps = OptimizerSteps()
    monkeypatch.setattr(Pipeline, "run", _shifted(Pipeline.run))
    with pytest.raises(SelfCheckError):
        cpu_trainer(PipeTransformerStrategy(pipe_len=2, chunks=2), [steps], max_epochs=1).fit(FamilyModule("bert"), family_data("bert"))
    assert steps.count == 0
    module = FamilyModule("bert")
    cpu_trainer(PipeTransformerStrategy(pipe_len=2, chunks=2, self_check=False), [steps], max_epochs=1).fit(module, family_data("bert"))
    assert steps.count == STEPS  # without the check the wrong runner trains: the check is what refused it


def _shifted(run):
    def shifted(self, call):
        return run(self, call) * 1.01

    return shifted


def test_the_self_check_refuses_a_cache_that_returns_other_shapes(monkeypatch):
    wrong = lambda out, call: out[:, :-1]  # noqa: E731
    with pytest.raises(SelfCheckError, match=r"the activation cache \(CachedStack\).*has shape \(6, 9, 32\).*\(6, 10, 32\)"):
        _fit_diverging(monkeypatch, CachedStack, wrong, PipeTransformerStrategy(cache=True, cache_memory=10**8))


def test_the_self_check_names_a_hook_that_fires_per_micro_batch(monkeypatch):
    """A runner that ignores the observers (micro-batches despite a hook) is caught by the hooks' firing counts."""
    import dataclasses

    module = FamilyModule("bert")
    calls = []
    module.model.bert.encoder.layer[2].register_forward_hook(lambda m, a, out: calls.append(out.shape[0]))
    original = Pipeline.run
    monkeypatch.setattr(Pipeline, "run", lambda self, call: original(self, dataclasses.replace(call, observed=())))
    with pytest.raises(SelfCheckError, match=r"forward hook .*<lambda> on block 2 fired 2 time\(s\) where the plain loop fires it 1"):
        cpu_trainer(PipeTransformerStrategy(pipe_len=2, chunks=2), max_epochs=1).fit(module, family_data("bert"))


def test_the_self_check_passes_through_the_cache_and_costs_one_plain_pass():
    """Engaged on the real runners: one extra (plain, gradient-free) run of each block at the check, then none."""
    module = FamilyModule("bert")
    runs = ForwardBackwardRunsPerEpoch()
    strategy = PipeTransformerStrategy(cache=True, cache_memory=10**8)
    cpu_trainer(strategy, [AutoFreeze(schedule={0: 2}), runs], max_epochs=1).fit(module, family_data("bert"))
    plain = FamilyModule("bert")
    cpu_trainer("auto", [AutoFreeze(schedule={0: 2})], max_epochs=1).fit(plain, family_data("bert"))
    assert_same_weights(module, plain)
    # The probe (1) and the check's plain run (hooks silenced: not counted) on step 0, then one run per step.
    assert runs.forward == [[1 + STEPS] * 4], runs.forward
    # Step 0's forward reads which modules run before the stack (AutoFreeze's call-order watch): its frozen
    # prefix runs without the cache, so the cache looks up the other steps' rows only.
    assert strategy.cache_stats["autocache/misses"] == (STEPS - 1) * BATCH


class Steered(FamilyModule):
    """BERT with a user's hook on block 1 that changes what the block gets (pre-hook) or gives (forward hook)."""

    def __init__(self, kind: str) -> None:
        super().__init__("bert")
        scale = torch.linspace(0.5, 2.0, 32)  # per feature: the next LayerNorm does not undo it
        block = self.model.bert.encoder.layer[1]
        if kind == "hook":
            block.register_forward_hook(lambda m, args, out: out * scale if isinstance(out, torch.Tensor) else (out[0] * scale, *out[1:]))
        else:
            block.register_forward_pre_hook(lambda m, args, kwargs: ((args[0] * scale, *args[1:]), kwargs), with_kwargs=True)


@pytest.mark.parametrize("kind", ["hook", "pre_hook"])
@pytest.mark.parametrize("strategy", ["pipeline", "cache"])
def test_a_users_hook_that_changes_a_blocks_input_or_output_trains_as_in_the_plain_loop(strategy, kind):
    """Was: the first-batch self-check refused these exact runs (its plain run silences hooks, so lacked the change)."""
    plain = fit(Steered(kind), "auto")
    module = Steered(kind)
    made = PipeTransformerStrategy(pipe_len=2, chunks=2) if strategy == "pipeline" else PipeTransformerStrategy(cache=True, cache_memory=10**8)
    seen = Interception()
    fit(module, made, [seen])
    assert_same_weights(module, plain)
    # Engaged: every pass went to the runner as an observed pass (one micro-batch; the cache standing aside once frozen).
    assert seen.stats.deferred == seen.stats.observed == (EPOCHS * STEPS if strategy == "pipeline" else STEPS), seen.stats
    if strategy == "cache":
        assert made.cache_stats["autocache/batches_bypassed"] == STEPS, made.cache_stats


class EmbeddingsObserved(FamilyModule):
    """BERT with a user's forward hook on its embeddings, recording their output in training."""

    def __init__(self) -> None:
        super().__init__("bert")
        self.seen: list[torch.Tensor] = []
        self.model.bert.embeddings.register_forward_hook(lambda m, args, out: self.seen.append(out.detach().clone()) if self.training else None)


def test_a_hook_on_the_embeddings_sees_their_output_while_the_cache_serves_the_blocks():
    """Was: on cached batches the skipped embeddings showed the hook a NaN placeholder, silently."""
    def fit3(module, strategy):  # epoch 1 stores, epoch 2 is served
        cpu_trainer(strategy, [AutoFreeze(schedule=SCHEDULE)], max_epochs=3).fit(module, family_data("bert"))
        return module

    plain = fit3(EmbeddingsObserved(), "auto")
    module = EmbeddingsObserved()
    strategy = PipeTransformerStrategy(cache=True, cache_memory=10**8)
    with pytest.warns(UserWarning, match=r"AutoCache runs BertEmbeddings for every batch.*forward hook .*<lambda> on BertEmbeddings"):
        fit3(module, strategy)
    assert len(module.seen) == len(plain.seen) == 3 * STEPS
    for got, want in zip(module.seen, plain.seen):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert_same_weights(module, plain)
    # Engaged: the frozen blocks were served (hits), only the embeddings ran (none skipped).
    stats = strategy.cache_stats
    assert stats["autocache/hits"] > 0 and stats.get("autocache/embeddings_skipped", 0) == 0, stats
