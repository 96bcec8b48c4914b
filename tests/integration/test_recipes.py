"""The recipes people fine-tune with, beside the family matrix (issue 23).

Each cell trains a tiny model from a config with a recipe (gradient checkpointing in both modes,
with and without ``enable_input_require_grads``; PEFT LoRA on all layers or on the upper ones;
a model built in ``configure_model()`` / ``setup()``; ``torch.compile`` of the whole model or of each block; a
frozen teacher beside its student) through the pipeline (``pipe_len=2, chunks=2``) and through
the cache with a freeze, and checks two things: the weights equal a plain Trainer's within fp32
tolerance, and the part engaged (real block runs per micro-batch; frozen blocks not run once
cached, and never run backward). The refusals and warnings of the issue's last rows are checked
where they are raised: before training.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from lightning_pipetransformer.stack.discovery import BlockStackError
from tests.helpers.block_runs import ForwardBackwardRunsPerEpoch
from tests.helpers.compare import assert_same_weights
from tests.helpers.families import BATCH, FAMILIES, STEPS, FamilyModule, family_data
from tests.helpers.trainers import cpu_trainer

peft = pytest.importorskip("peft")  # a dev dependency: present wherever the suite runs

EPOCHS = 3
LORA_TARGETS = {"llama": ["q_proj", "v_proj"], "bert": ["query", "value"], "gpt2": ["c_attn"]}


def build(family, *, checkpointing=None, input_grads=True, lora=None, seed=0):
    """A FamilyModule with a recipe: ``checkpointing`` None / "reentrant" / "non-reentrant"; ``lora``: None, "all" or "upper"."""
    module = FamilyModule(family, seed=seed)
    if lora is not None:
        layers = {} if lora == "all" else {"layers_to_transform": [2, 3]}
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS[family], lora_dropout=0.0, **layers)
        module.model = peft.get_peft_model(module.model, config)
        # LoRA's B starts at zero: a non-zero start makes every adapter's gradient (and a wrong one) show.
        with torch.no_grad():
            for name, p in module.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(hash(name) % 2**31))
    if checkpointing is not None:
        module.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
        if not input_grads:
            module.model.disable_input_require_grads() if hasattr(module.model, "disable_input_require_grads") else None
    return module


def fit_plain(module, schedule):
    cpu_trainer("auto", [AutoFreeze(schedule=schedule)], max_epochs=EPOCHS).fit(module, family_data(module.family.name))
    return module


def fit_pipeline(module, schedule):
    runs = ForwardBackwardRunsPerEpoch()
    strategy = PipeTransformerStrategy(pipe_len=2, chunks=2)
    cpu_trainer(strategy, [AutoFreeze(schedule=schedule), runs], max_epochs=EPOCHS).fit(module, family_data(module.family.name))
    return runs, strategy


def fit_cached(module, schedule, **kwargs):
    runs = ForwardBackwardRunsPerEpoch()
    strategy = PipeTransformerStrategy(cache=True, cache_memory=10**8, **kwargs)
    cpu_trainer(strategy, [AutoFreeze(schedule=schedule), runs], max_epochs=EPOCHS).fit(module, family_data(module.family.name))
    return runs, strategy


def assert_served(runs, strategy, frozen, chunks=1):
    """Epoch 1 stores every sample at the boundary, epoch 2 is served: frozen blocks run only for the
    one-off check of the first hits (one batch), the active ones every step; no frozen block runs backward."""
    stats = strategy.cache_stats
    assert stats["autocache/hits"] == STEPS * BATCH and stats["autocache/misses"] == STEPS * BATCH, stats
    assert runs.forward[2][:frozen] == [1] * frozen and runs.forward[2][frozen:] == [chunks * STEPS] * (4 - frozen), runs.forward
    assert runs.backward[2][:frozen] == [0] * frozen and runs.backward[1][:frozen] == [0] * frozen, runs.backward


# ---------------------------------------------------------------------------------- gradient checkpointing and PEFT

CHECKPOINTING = [
    ("non-reentrant", True), ("reentrant", True), ("non-reentrant", False),
]


@pytest.mark.parametrize("family", ["llama", "bert"])
@pytest.mark.parametrize("lora", [None, "all"])
@pytest.mark.parametrize("checkpointing, input_grads", CHECKPOINTING)
def test_gradient_checkpointing_through_the_cache(family, lora, checkpointing, input_grads):
    """Was NaN weights (Llama) or a cache standing aside (BERT): the hook that marks the embeddings' output
    as requiring grad made the cache stand aside, and the frozen blocks ran on the skipped embeddings' placeholder."""
    recipe = dict(checkpointing=checkpointing, input_grads=input_grads, lora=lora)
    plain = fit_plain(build(family, **recipe), {1: 3})
    module = build(family, **recipe)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs, strategy = fit_cached(module, {1: 3})
    assert not [w for w in caught if "AutoCache is not used" in str(w.message)], [str(w.message) for w in caught]
    assert_same_weights(module, plain)
    assert_served(runs, strategy, frozen=3)
    if family == "llama":  # its embeddings are skipped on served batches, and the active block still trained
        assert strategy.cache_stats["autocache/embeddings_skipped"] > 0


@pytest.mark.parametrize("family", ["llama", "bert"])
@pytest.mark.parametrize("lora", [None, "all"])
@pytest.mark.parametrize("checkpointing, input_grads", CHECKPOINTING)
def test_gradient_checkpointing_through_the_pipeline(family, lora, checkpointing, input_grads):
    recipe = dict(checkpointing=checkpointing, input_grads=input_grads, lora=lora)
    plain = fit_plain(build(family, **recipe), {1: 2})
    module = build(family, **recipe)
    runs, _ = fit_pipeline(module, {1: 2})
    assert_same_weights(module, plain)
    # Epoch 0: one probe run per block, then 2 micro-batches per step; later 2 per step.
    assert runs.forward == [[1 + 2 * STEPS] * 4] + [[2 * STEPS] * 4] * (EPOCHS - 1), runs.forward
    # The frozen blocks need no graph, even when a hook marked their input as requiring grad.
    assert all(epoch[:2] == [0, 0] for epoch in runs.backward[1:]), runs.backward
    assert all(epoch[2:] == [2 * STEPS] * 2 for epoch in runs.backward), runs.backward


def test_the_frozen_blocks_keep_their_graph_when_a_real_gradient_needs_it():
    """The no-graph rule is about hooks: trainable embeddings still get their gradient through the frozen blocks."""
    plain = build("bert", checkpointing="non-reentrant")
    cpu_trainer("auto", [AutoFreeze(schedule={1: 2}, freeze_embeddings=False)], max_epochs=EPOCHS).fit(plain, family_data("bert"))
    module = build("bert", checkpointing="non-reentrant")
    runs = ForwardBackwardRunsPerEpoch()
    cpu_trainer(PipeTransformerStrategy(pipe_len=2, chunks=2), [AutoFreeze(schedule={1: 2}, freeze_embeddings=False), runs], max_epochs=EPOCHS).fit(
        module, family_data("bert")
    )
    assert_same_weights(module, plain)
    assert runs.backward[2][:2] == [2 * STEPS] * 2, runs.backward
    embeddings = module.model.bert.embeddings.word_embeddings.weight
    assert not torch.equal(embeddings, build("bert").model.bert.embeddings.word_embeddings.weight)


# ---------------------------------------------------------------------------------- adapters on some layers only


class PlanAtStart(Callback):
    def on_train_start(self, trainer, pl_module):
        self.plan = trainer.strategy.plan


def test_lora_on_the_upper_layers_counts_the_lower_blocks_as_frozen_and_caches_them():
    plain = fit_plain(build("llama", lora="upper"), {0: 0})
    module = build("llama", lora="upper")
    start = PlanAtStart()
    runs = ForwardBackwardRunsPerEpoch()
    strategy = PipeTransformerStrategy(pipe_len=2, chunks=2, cache=True, cache_memory=10**8)
    cpu_trainer(strategy, [AutoFreeze(schedule={0: 0}), runs, start], max_epochs=EPOCHS).fit(module, family_data("llama"))
    assert_same_weights(module, plain)
    # Blocks 0-1 have no trainable parameter: frozen for the plan from the start (was: 0 frozen, no cache).
    assert start.plan.num_frozen == 2
    # Epoch 0 stores them, but for its first batch, whose forward shows what runs before the stack (computed as
    # without the cache); epoch 1 stores that batch and checks the first hits once; epoch 2 is served: only
    # blocks 2-3 run and train.
    assert runs.forward[1][:2] == [2, 2] and runs.forward[2][:2] == [0, 0], runs.forward
    assert runs.forward[2][2:] == [2 * STEPS] * 2, runs.forward
    assert strategy.cache_stats["autocache/hits"] == 2 * STEPS * BATCH - BATCH


def test_a_freeze_that_changes_no_parameter_still_moves_the_plan():
    """Block 2 has no adapter: freezing it changes nothing, but the plan must count it."""
    def lora_on(layers):
        module = FamilyModule("llama")
        config = peft.LoraConfig(r=4, target_modules=LORA_TARGETS["llama"], layers_to_transform=layers, lora_dropout=0.0)
        module.model = peft.get_peft_model(module.model, config)
        return module

    plain = lora_on([0, 1, 3])
    cpu_trainer("auto", [AutoFreeze(schedule={1: 2, 2: 3})], max_epochs=EPOCHS).fit(plain, family_data("llama"))
    module = lora_on([0, 1, 3])
    strategy = PipeTransformerStrategy(pipe_len=2, chunks=2)
    cpu_trainer(strategy, [AutoFreeze(schedule={1: 2, 2: 3})], max_epochs=EPOCHS).fit(module, family_data("llama"))
    assert_same_weights(module, plain)
    assert strategy.plan.num_frozen == 3


# ---------------------------------------------------------------------------------- models built in configure_model()


class LazyModule(FamilyModule):
    """The model is built in ``configure_model()`` (or ``setup()``); the stack found, named by ``layers=``, or by the hook."""

    def __init__(self, family, where="configure_model", hook=False):
        pl.LightningModule.__init__(self)
        self.family = FAMILIES[family]
        self.where = where
        self.model = None
        if hook:
            self.configure_block_stack = lambda: "model.model.layers"

    def _build(self):
        if self.model is None:
            torch.manual_seed(0)
            self.model = self.family.build()

    def configure_model(self):
        if self.where == "configure_model":
            self._build()

    def setup(self, stage):
        if self.where == "setup":
            self._build()


@pytest.mark.parametrize("where", ["configure_model", "setup"])
@pytest.mark.parametrize("naming", ["discovery", "layers", "hook"])
def test_a_model_built_in_configure_model_or_setup(where, naming):
    """Was BlockStackError before training: AutoFreeze looked for the stack before the model existed."""
    plain = fit_plain(FamilyModule("llama"), {1: 3})
    module = LazyModule("llama", where, hook=naming == "hook")
    layers = "model.model.layers" if naming == "layers" else None
    runs = ForwardBackwardRunsPerEpoch()
    strategy = PipeTransformerStrategy(pipe_len=2, chunks=2, cache=True, cache_memory=10**8, layers=layers)
    cpu_trainer(strategy, [AutoFreeze(schedule={1: 3}, layers=layers), runs], max_epochs=EPOCHS).fit(module, family_data("llama"))
    assert_same_weights(module, plain)
    assert_served(runs, strategy, frozen=3, chunks=2)


def test_a_lazily_built_model_under_a_plain_trainer():
    plain = fit_plain(FamilyModule("llama"), {1: 3})
    module = LazyModule("llama")
    freeze = AutoFreeze(schedule={1: 3})
    cpu_trainer("auto", [freeze], max_epochs=EPOCHS).fit(module, family_data("llama"))
    assert freeze.stack.path == "model.model.layers"
    assert_same_weights(module, plain)


# ---------------------------------------------------------------------------------- torch.compile of the whole model


@pytest.mark.parametrize(
    "how, backend", [("method", "inductor"), ("wrapped", "eager")],
)
def test_a_compiled_model_through_the_pipeline(how, backend):
    """Was InternalTorchDynamoError at the second step: Dynamo traced the interception."""
    torch._dynamo.reset()
    plain = FamilyModule("llama")
    cpu_trainer("auto", max_epochs=EPOCHS).fit(plain, family_data("llama"))
    module = FamilyModule("llama")
    runs = ForwardBackwardRunsPerEpoch()
    if how == "method":
        module.model.compile(backend=backend)
    else:
        module.model = torch.compile(module.model, backend=backend)
    cpu_trainer(PipeTransformerStrategy(pipe_len=2, chunks=2), [runs], max_epochs=EPOCHS).fit(module, family_data("llama"))
    assert_same_weights(module, plain)
    assert runs.forward == [[1 + 2 * STEPS] * 4] + [[2 * STEPS] * 4] * (EPOCHS - 1), runs.forward


class CountingBackend:
    """A torch.compile backend that runs each graph as traced and counts them: the compiled code ran."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph, example_inputs):
        self.graphs += 1
        return graph.forward


def test_blocks_compiled_by_replacement_through_the_pipeline():
    """Was refused before training as "OptimizedModule containers, which the model never calls": the check
    read the block's class's forward, which torch.compile's wrapper sets on the instance instead."""
    torch._dynamo.reset()
    plain = fit_plain(FamilyModule("llama"), {1: 1})
    module = FamilyModule("llama")
    layers, backend = module.model.model.layers, CountingBackend()
    for i in range(len(layers)):
        layers[i] = torch.compile(layers[i], backend=backend)
    runs, strategy = fit_pipeline(module, {1: 1})
    assert_same_weights(module, plain)
    assert type(layers[0]).__name__ == "OptimizedModule" and strategy.plan.pipe_len == 2
    assert backend.graphs > 0  # the blocks ran compiled
    # Epoch 0: one probe run per block, then 2 micro-batches per step; block 0 frozen from epoch 1 (no backward).
    assert runs.forward == [[1 + 2 * STEPS] * 4] + [[2 * STEPS] * 4] * (EPOCHS - 1), runs.forward
    assert runs.backward == [[2 * STEPS] * 4] + [[0] + [2 * STEPS] * 3] * (EPOCHS - 1), runs.backward


def test_a_compiled_model_through_the_cache():
    torch._dynamo.reset()
    plain = fit_plain(FamilyModule("bert"), {1: 3})
    module = FamilyModule("bert")
    module.model = torch.compile(module.model, backend="eager")
    runs, strategy = fit_cached(module, {1: 3})
    assert_same_weights(module, plain)
    assert_served(runs, strategy, frozen=3)


# ---------------------------------------------------------------------------------- two transformers in one module


class Distillation(pl.LightningModule):
    """A frozen teacher (6 blocks) larger than the student (4 blocks); the loss mixes labels and the teacher's logits."""

    def __init__(self, teacher_trains=False, teacher_layers=6, teacher_width=48):
        super().__init__()
        torch.manual_seed(0)
        self.student = FAMILIES["bert"].build()
        torch.manual_seed(1)
        import transformers as T

        from tests.helpers.families import COMMON, LABELS
        config = T.BertConfig(**{**COMMON, "num_hidden_layers": teacher_layers, "hidden_size": teacher_width,
                                 "intermediate_size": 2 * teacher_width}, num_labels=LABELS,
                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.teacher = T.BertForSequenceClassification(config)
        if not teacher_trains:
            self.teacher.requires_grad_(False).eval()

    def training_step(self, batch, batch_idx):
        x, mask, y = batch
        logits = self.student(input_ids=x, attention_mask=mask).logits
        with torch.no_grad():
            target = self.teacher(input_ids=x, attention_mask=mask).logits.softmax(-1)
        return nn.functional.cross_entropy(logits, y) + nn.functional.cross_entropy(logits, target)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05, momentum=0.9)


def test_distillation_freezes_and_pipelines_the_student_not_the_frozen_teacher():
    plain = Distillation()
    cpu_trainer("auto", [AutoFreeze(schedule={1: 2})], max_epochs=EPOCHS).fit(plain, family_data("bert"))
    module = Distillation()
    freeze = AutoFreeze(schedule={1: 2})
    strategy = PipeTransformerStrategy(pipe_len=2, chunks=2, cache=True, cache_memory=10**8)
    cpu_trainer(strategy, [freeze], max_epochs=EPOCHS).fit(module, family_data("bert"))
    assert freeze.stack.path == "student.bert.encoder.layer"
    assert_same_weights(module, plain)
    assert not any(p.requires_grad for block in module.student.bert.encoder.layer[:2] for p in block.parameters())
    assert strategy.cache_stats["autocache/hits"] == STEPS * BATCH


def test_two_trainable_transformers_of_similar_size_are_refused_with_both_names():
    with pytest.raises(BlockStackError, match="student.bert.encoder.layer.*teacher.bert.encoder.layer|teacher.*student"):
        cpu_trainer(PipeTransformerStrategy(pipe_len=2), [AutoFreeze()], max_epochs=EPOCHS).fit(
            Distillation(teacher_trains=True, teacher_layers=4, teacher_width=32), family_data("bert")
        )


# ---------------------------------------------------------------------------------- refused or warned early


def test_a_pipe_len_that_does_not_divide_the_devices_is_refused_when_the_trainer_is_built():
    with pytest.raises(ValueError, match=r"pipe_len=3 must divide the 4 devices.*\[1, 2, 4\]"):
        pl.Trainer(accelerator="cpu", devices=4, strategy=PipeTransformerStrategy(pipe_len=3), logger=False)


@pytest.mark.parametrize(
    "freeze, words",
    [
        (dict(freeze_interval=20), "freeze_interval=20 .20 optimizer steps. and a run of 9 optimizer steps, no freeze point"),
        (dict(freeze_every_n_epochs=3), "freeze_every_n_epochs=3 and a run of max_epochs=3, no freeze point"),
        (dict(freeze_interval=5, rule="autofreeze"), "only one freeze point fits, and rule='autofreeze' needs two"),
    ],
)
def test_a_run_with_no_freeze_point_warns_before_training(freeze, words):
    module = FamilyModule("bert")
    with pytest.warns(UserWarning, match=words):
        cpu_trainer(PipeTransformerStrategy(), [AutoFreeze(**freeze)], max_epochs=EPOCHS).fit(module, family_data("bert"))


def test_chunks_larger_than_the_batch_warn_once():
    module = FamilyModule("bert")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpu_trainer(PipeTransformerStrategy(pipe_len=2, chunks=8), max_epochs=EPOCHS).fit(module, family_data("bert"))
    capped = [w for w in caught if "chunks=8 but the batches have 6 samples" in str(w.message)]
    assert len(capped) == 1


def test_tied_embeddings_named_in_pre_warn_that_the_head_stops_training():
    """By default tied embeddings keep training (tests/integration/test_call_order.py); named in pre= they freeze, warned."""
    module = FamilyModule("gpt2")
    assert module.model.lm_head.weight is module.model.transformer.wte.weight
    with pytest.warns(UserWarning, match=r"tied to a module after the stack \(model.transformer.wte.weight is model.lm_head.weight\)"):
        cpu_trainer("auto", [AutoFreeze(schedule={1: 2}, pre=["model.transformer.wte"])], max_epochs=2).fit(module, family_data("gpt2"))
    assert not module.model.lm_head.weight.requires_grad


class VariableLengths(torch.utils.data.Dataset):
    def __init__(self, n=18, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.samples = [torch.randint(3, 40, (int(torch.randint(3, 17, (), generator=g)),), generator=g) for _ in range(n)]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def pad_to_longest(samples):
    length = max(len(s) for s in samples)
    x = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros_like(x)
    for i, s in enumerate(samples):
        x[i, : len(s)], mask[i, : len(s)] = s, 1
    return x, mask, torch.zeros(len(samples), dtype=torch.long)


def test_content_keys_that_keep_missing_warn_once_naming_padding():
    data = torch.utils.data.DataLoader(
        VariableLengths(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0), collate_fn=pad_to_longest
    )
    module = FamilyModule("bert")
    strategy = PipeTransformerStrategy(cache=True, cache_memory=10**8)
    with pytest.warns(UserWarning, match="padded to their own longest sequence.*bucket_tokens"):
        cpu_trainer(strategy, [AutoFreeze(schedule={1: 3})], max_epochs=4).fit(module, data)
    assert strategy.cache_stats["autocache/hit_rate"] < 0.8


def test_content_keys_that_hit_do_not_warn():
    module = FamilyModule("bert")
    strategy = PipeTransformerStrategy(cache=True, cache_memory=10**8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpu_trainer(strategy, [AutoFreeze(schedule={1: 3})], max_epochs=4).fit(module, family_data("bert"))
    assert not [w for w in caught if "lookups hit" in str(w.message)]
    assert strategy.cache_stats["autocache/hit_rate"] == 2 / 3  # epoch 1 stores, epochs 2-3 hit


# ---------------------------------------------------------------------------------- encoder-decoder models

BART_PRE = ["model.model.shared", "model.model.encoder.embed_tokens", "model.model.encoder.embed_positions",
            "model.model.encoder.layernorm_embedding"]


class Seq2Seq(pl.LightningModule):
    """A tiny BART or T5 trained to reproduce its input (4 encoder and 4 decoder blocks, dropout 0)."""

    def __init__(self, kind):
        super().__init__()
        import transformers as T

        torch.manual_seed(0)
        if kind == "bart":
            self.model = T.BartForConditionalGeneration(T.BartConfig(
                vocab_size=40, d_model=32, encoder_layers=4, decoder_layers=4, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
            ))
        else:
            self.model = T.T5ForConditionalGeneration(T.T5Config(
                vocab_size=40, d_model=32, d_kv=16, d_ff=64, num_layers=4, num_decoder_layers=4, num_heads=2,
                dropout_rate=0.0, decoder_start_token_id=0,
            ))

    def training_step(self, batch, batch_idx):
        x, mask, _ = batch
        return self.model(input_ids=x, attention_mask=mask, labels=x).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def test_an_encoder_decoder_model_has_two_stacks_and_asks_which():
    with pytest.raises(BlockStackError, match="model.model.decoder.layers.*model.model.encoder.layers"):
        cpu_trainer(PipeTransformerStrategy(pipe_len=2), [AutoFreeze()], max_epochs=EPOCHS).fit(Seq2Seq("bart"), family_data("bert"))


def test_bart_encoder_pipelined_and_cached():
    """BART's layernorm_embedding runs before the encoder's blocks but is registered after them: named in ``pre``."""
    def freeze():
        return AutoFreeze(schedule={1: 3}, layers="model.model.encoder.layers", pre=BART_PRE)

    plain = Seq2Seq("bart")
    cpu_trainer("auto", [freeze()], max_epochs=EPOCHS).fit(plain, family_data("bert"))
    module = Seq2Seq("bart")
    runs = ForwardBackwardRunsPerEpoch()
    strategy = PipeTransformerStrategy(pipe_len=2, chunks=2, cache=True, cache_memory=10**8)
    with pytest.warns(UserWarning, match="tied to a module after the stack"):  # shared embeddings: the head freezes too
        cpu_trainer(strategy, [freeze(), runs], max_epochs=EPOCHS).fit(module, family_data("bert"))
    assert_same_weights(module, plain)
    assert strategy.stack.path == "model.model.encoder.layers"
    assert_served(runs, strategy, frozen=3, chunks=2)


def test_bart_decoder_pipelined():
    plain = Seq2Seq("bart")
    cpu_trainer("auto", max_epochs=EPOCHS).fit(plain, family_data("bert"))
    module = Seq2Seq("bart")
    strategy = PipeTransformerStrategy(pipe_len=2, chunks=2, layers="model.model.decoder.layers")
    cpu_trainer(strategy, max_epochs=EPOCHS).fit(module, family_data("bert"))
    assert_same_weights(module, plain)
    assert strategy.plan.pipe_len == 2


def test_t5_blocks_pass_the_position_bias_on_and_are_refused():
    """T5's first block computes the relative position bias and the loop hands it to the next ones."""
    from lightning_pipetransformer.stack.stack_call import InterceptionError

    with pytest.raises(InterceptionError, match="got an earlier block's output as an extra argument"):
        cpu_trainer(PipeTransformerStrategy(pipe_len=2, layers="model.encoder.block"), max_epochs=EPOCHS).fit(Seq2Seq("t5"), family_data("bert"))


# ---------------------------------------------------------------------------------- combined with the loop's recipes


def test_lora_with_checkpointing_cached_under_bf16_and_accumulation():
    recipe = dict(checkpointing="reentrant", lora="all")
    loop = dict(precision="bf16-mixed", accumulate_grad_batches=2)
    plain = build("llama", **recipe)
    cpu_trainer("auto", [AutoFreeze(schedule={1: 3})], max_epochs=EPOCHS, **loop).fit(plain, family_data("llama"))
    module = build("llama", **recipe)
    runs = ForwardBackwardRunsPerEpoch()
    strategy = PipeTransformerStrategy(cache=True, cache_memory=10**8)
    cpu_trainer(strategy, [AutoFreeze(schedule={1: 3}), runs], max_epochs=EPOCHS, **loop).fit(module, family_data("llama"))
    assert_same_weights(module, plain, rtol=1e-3, atol=1e-4)
    assert_served(runs, strategy, frozen=3)


def test_lora_on_the_upper_layers_resumes_exactly(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(epochs, ckpt=None, checkpoint=False):
        module = build("llama", lora="upper")
        callbacks = [AutoFreeze(schedule={2: 3})]
        if checkpoint:
            callbacks.append(ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0))
        strategy = PipeTransformerStrategy(pipe_len=2, chunks=2, cache=True, cache_memory=10**8, cache_dir=str(tmp_path / "cache"))
        fit = cpu_trainer(strategy, callbacks, max_epochs=epochs, enable_checkpointing=checkpoint)
        fit.fit(module, family_data("llama"), ckpt_path=ckpt)
        return module, strategy

    whole, _ = run(4)
    run(2, checkpoint=True)
    resumed, strategy = run(4, ckpt=str(tmp_path / "last.ckpt"))
    assert_same_weights(resumed, whole)
    assert strategy.plan.num_frozen == 3 and strategy.cache_stats["autocache/hits"] > 0
