"""strategy="pipetransformer" with one process: equivalence with a plain Trainer, plans, resume, errors."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from lightning_pipetransformer.stack.discovery import BlockStackError
from lightning_pipetransformer.stack.observers import sees_block_runs
from tests.helpers.compare import assert_state_close
from tests.helpers.lightning_models import Classifier, data_for, indexed_text
from tests.helpers.trainers import cpu_trainer

SCHEDULE = {1: 1, 2: 3}


def fit(kind, strategy, schedule=SCHEDULE, max_epochs=3, **kwargs):
    module = Classifier(kind)
    trainer = cpu_trainer(strategy, [AutoFreeze(schedule=schedule)], max_epochs=max_epochs, **kwargs)
    trainer.fit(module, data_for(kind))
    return module, trainer


_reference: dict[str, dict] = {}


def reference(kind):
    if kind not in _reference:
        module, _ = fit(kind, "auto")
        _reference[kind] = module.state_dict()
    return _reference[kind]


@pytest.mark.parametrize(
    "kind, pipe_len, chunks",
    [("bert", 1, 1), ("bert", 2, 3), ("bert", 4, 2), ("bert", 4, 8), ("vit", 2, 2), ("timm", 3, 2), ("torch", 2, 3)],
)
def test_matches_plain_trainer(kind, pipe_len, chunks):
    module, trainer = fit(kind, PipeTransformerStrategy(pipe_len=pipe_len, chunks=chunks))
    assert_state_close(module.state_dict(), reference(kind))
    # After fit the module is the user's plain module again.
    assert type(trainer.strategy.stack.container).__name__ in ("ModuleList", "Sequential")


def test_pipeline_really_runs_during_fit(tmp_path):
    module = Classifier("bert")
    blocks = list(module.model.bert.encoder.layer)
    runs = []
    for block in blocks:
        block.register_forward_pre_hook(sees_block_runs(lambda m, args: runs.append(args[0].shape[0])))
    trainer = cpu_trainer(PipeTransformerStrategy(pipe_len=2, chunks=2), max_epochs=1, logger=CSVLogger(tmp_path))
    trainer.fit(module, data_for("bert"))
    # 3 steps of 8 samples: each block runs on the first batch once without a graph (learning what the
    # blocks return), then on 2 micro-batches of 4 per step. A bypassed pipeline would run each on 8, once.
    assert runs == [8] * len(blocks) + [4] * (2 * 3 * len(blocks))
    header, *rows = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    logged = [dict(zip(header.split(","), r.split(","))) for r in rows]
    engaged = [(float(r["pipetransformer/engaged"]), float(r["pipetransformer/microbatches"])) for r in logged if r.get("pipetransformer/engaged")]
    assert engaged == [(1.0, 2.0)]  # reported at the end of the one epoch: every pass pipelined, 2 micro-batches each


def test_plan_shrinks_as_blocks_freeze_and_is_logged(tmp_path):
    plans = []

    class Record(Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            plans.append(trainer.strategy.plan)

    module = Classifier("bert", num_layers=4)
    trainer = cpu_trainer(
        PipeTransformerStrategy(pipe_len=4, chunks=2), [AutoFreeze(schedule={1: 2, 2: 3}), Record()], max_epochs=3, logger=CSVLogger(tmp_path),
    )
    trainer.fit(module, data_for("bert"))
    # 4 equal blocks, budget 1 block: F=2 -> [1/6, 1/6, 1, 1] cannot fit 2 stages of <= 1;
    # F=3 -> [1/6, 1/6, 1/6, 1] fits (3, 1) with stage costs (0.5, 1).
    assert [(p.num_frozen, p.pipe_len, p.partition) for p in plans] == [(0, 4, (1, 1, 1, 1)), (2, 4, (1, 1, 1, 1)), (3, 2, (3, 1))]
    assert plans[-1].active_ranks == (0,) and plans[-1].chunks == 2
    header, *rows = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    column = header.split(",").index("pipetransformer/pipe_len")
    assert [float(r.split(",")[column]) for r in rows if r.split(",")[column]] == [4.0, 4.0, 2.0]


def test_resume_equals_uninterrupted(tmp_path):
    def run(directory, max_epochs, ckpt_path=None):
        module = Classifier("bert")
        freeze = AutoFreeze(alpha=0.5, rule="schedule")
        ckpt = ModelCheckpoint(dirpath=directory, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
        trainer = cpu_trainer(
            PipeTransformerStrategy(pipe_len=4, chunks=2), [freeze, ckpt], max_epochs=max_epochs, enable_checkpointing=True,
        )
        trainer.fit(module, data_for("bert"), data_for("bert", n=8, seed=1), ckpt_path=ckpt_path)
        return module, trainer

    full, full_trainer = run(tmp_path / "a", 4)
    run(tmp_path / "b", 2)
    resumed, resumed_trainer = run(tmp_path / "c", 4, ckpt_path=tmp_path / "b" / "epoch=1.ckpt")
    assert resumed_trainer.strategy.plan == full_trainer.strategy.plan
    assert full_trainer.strategy.plan.pipe_len < 4
    assert_state_close(resumed.state_dict(), full.state_dict())


def test_checkpoints_cross_load_with_a_plain_trainer(tmp_path):
    module, trainer = fit("bert", PipeTransformerStrategy(pipe_len=2, chunks=2), max_epochs=1)
    trainer.save_checkpoint(tmp_path / "pipe.ckpt")
    plain = Classifier("bert", seed=1)
    cpu_trainer("auto", max_epochs=1).validate(plain, data_for("bert"), ckpt_path=tmp_path / "pipe.ckpt")
    assert_state_close(plain.state_dict(), module.state_dict(), rtol=0, atol=0)

    # And the other way round: a plain checkpoint resumes under the pipeline strategy.
    module, trainer = fit("bert", "auto", max_epochs=1)
    trainer.save_checkpoint(tmp_path / "plain.ckpt")
    piped = Classifier("bert", seed=1)
    cpu_trainer(PipeTransformerStrategy(pipe_len=4, chunks=2), max_epochs=2).fit(
        piped, data_for("bert"), ckpt_path=tmp_path / "plain.ckpt"
    )
    uninterrupted, _ = fit("bert", "auto", schedule={}, max_epochs=2)
    assert_state_close(piped.state_dict(), uninterrupted.state_dict())


def test_validate_test_predict_run_through_the_pipeline():
    module, trainer = fit("bert", "auto", max_epochs=1)
    plain = trainer.predict(module, data_for("bert"))
    strategy = PipeTransformerStrategy(pipe_len=4, chunks=3)
    t = cpu_trainer(strategy, max_epochs=3)
    piped = t.predict(module, data_for("bert"))
    for a, b in zip(plain, piped):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert t.strategy.plan.pipe_len == 4
    assert t.validate(module, data_for("bert"))[0]["val_loss"] == pytest.approx(
        cpu_trainer("auto", max_epochs=3).validate(module, data_for("bert"))[0]["val_loss"], rel=1e-5
    )


def test_gradient_accumulation_and_bf16():
    for kwargs, tol in [(dict(accumulate_grad_batches=2), 1e-6), (dict(precision="bf16-mixed"), 1e-2)]:
        piped, _ = fit("bert", PipeTransformerStrategy(pipe_len=2, chunks=1), max_epochs=2, **kwargs)
        plain, _ = fit("bert", "auto", max_epochs=2, **kwargs)
        assert_state_close(piped.state_dict(), plain.state_dict(), rtol=tol, atol=tol)


def test_registered_name():
    trainer = cpu_trainer("pipetransformer", max_epochs=3)
    assert isinstance(trainer.strategy, PipeTransformerStrategy) and trainer.strategy.config.pipe_len == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(pipe_len=0), "pipe_len"), (dict(chunks=0), "chunks"), (dict(frozen_cost=2), "frozen_cost"), (dict(timeout=0), "timeout")],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipeTransformerStrategy(**kwargs)


class Steps(Callback):
    count = 0

    def on_train_batch_start(self, *args):
        Steps.count += 1


def test_more_stages_than_blocks_fails_before_training():
    Steps.count = 0
    with pytest.raises(ValueError, match="pipe_len <= 4"):
        cpu_trainer(PipeTransformerStrategy(pipe_len=5), [Steps()], max_epochs=3).fit(Classifier("bert"), data_for("bert"))
    assert Steps.count == 0


def test_no_block_stack_fails_before_training():
    class Flat(Classifier):
        def __init__(self):
            super().__init__("bert")
            self.model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Flatten(), torch.nn.Linear(64, 3))

        def forward(self, x):
            return self.model(x)

    Steps.count = 0
    with pytest.raises(BlockStackError, match="layers="):
        cpu_trainer(PipeTransformerStrategy(pipe_len=2), [Steps()], max_epochs=3).fit(Flat(), data_for("bert"))
    assert Steps.count == 0


def test_auto_chunks_measures_once_per_pipe_len_and_keeps_results_exact():
    module, trainer = fit("bert", PipeTransformerStrategy(pipe_len=4, chunks="auto"), schedule={1: 3})
    strategy = trainer.strategy
    # Pipe length 4 then 2 (3 of 4 blocks frozen): one measurement each, M within K..6K and <= batch 8.
    assert sorted(strategy.engine.auto_chunks) == [2, 4]
    assert 4 <= strategy.engine.auto_chunks[4] <= 8 and 2 <= strategy.engine.auto_chunks[2] <= 8
    assert strategy.plan.chunks == strategy.engine.auto_chunks[2]
    assert_state_close(module.state_dict(), reference_with({1: 3}))


_reference_with: dict = {}


def reference_with(schedule):
    key = tuple(sorted(schedule.items()))
    if key not in _reference_with:
        _reference_with[key] = fit("bert", "auto", schedule=schedule)[0].state_dict()
    return _reference_with[key]


@pytest.mark.parametrize("pipe_len", [1, 2])
def test_cache_on_equals_cache_off(tmp_path, pipe_len):
    schedule = {1: 1, 2: 3}
    cached, trainer = fit(
        "bert", PipeTransformerStrategy(pipe_len=pipe_len, chunks=2, cache=True, cache_dir=str(tmp_path)),
        schedule=schedule, max_epochs=4,
    )
    stats = trainer.strategy.cache_stats
    # Epoch 1 fills boundary 1, epoch 2 advances it to 3, epochs 2-3 hit: 24 samples per epoch.
    assert stats["autocache/boundary"] == 3 and stats["autocache/hits"] >= 24
    # Served batches skip the embeddings too (each epoch's batches after the first one that shows
    # the embeddings' output reaching the blocks): at least epochs 2-3, 3 batches each.
    assert stats["autocache/embeddings_skipped"] >= 6
    plain, _ = fit("bert", "auto", schedule=schedule, max_epochs=4)
    assert_state_close(cached.state_dict(), plain.state_dict(), rtol=1e-4, atol=1e-5)


def test_cache_dir_not_writable_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    Steps.count = 0
    with pytest.raises(ValueError, match="cache_dir"):
        cpu_trainer(PipeTransformerStrategy(cache=True, cache_dir=str(blocker / "c")), [AutoFreeze(), Steps()], max_epochs=3).fit(
            Classifier("bert"), data_for("bert")
        )
    assert Steps.count == 0


def test_index_cache_key_needs_dict_batches_from_the_first_step(tmp_path):
    Steps.count = 0
    with pytest.raises(ValueError, match="index"):
        cpu_trainer(
            PipeTransformerStrategy(cache=True, cache_key="index", cache_dir=str(tmp_path)), [AutoFreeze(schedule={1: 1}), Steps()], max_epochs=3,
        ).fit(Classifier("bert"), data_for("bert"))
    assert Steps.count == 1  # the first step, long before the first freeze


class ValLosses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_validation_end(self, trainer, pl_module):
        self.losses.append(float(trainer.callback_metrics["val_loss"]))


def fit_indexed(strategy, train, val=None, schedule=SCHEDULE, max_epochs=4):
    module, losses = Classifier("bert"), ValLosses()
    trainer = cpu_trainer(strategy, [AutoFreeze(schedule=schedule), losses], max_epochs=max_epochs)
    trainer.fit(module, train, val)
    return module, trainer, losses.losses


def test_index_cache_key_equals_cache_off(tmp_path, monkeypatch):
    # Shuffled training batches (index != position) and a validation set whose indices 0..23 name
    # other samples than training's 0..23: index keys are namespaced per loader. Classifier's
    # attention mask depends on the position in the batch, so shuffling changes a sample's mask:
    # an index key must then miss (the mask is hashed in), exactly when a content key misses.
    def loaders():
        return indexed_text(shuffle=True), indexed_text(seed=5)

    def cached(key):
        strategy = PipeTransformerStrategy(pipe_len=2, cache=True, cache_key=key, cache_dir=str(tmp_path / key))
        module, trainer, losses = fit_indexed(strategy, *loaders())
        return module, trainer.strategy.cache_stats, losses

    from lightning_pipetransformer.cache.indices import BatchIndices

    host_reads: list[bool] = []
    host_copy = BatchIndices._host_copy
    monkeypatch.setattr(BatchIndices, "_host_copy", lambda self, raw: host_reads.append(host_copy(self, raw) is not None) or host_copy(self, raw))
    by_index, stats, index_losses = cached("index")
    # Every batch's indices were read from the loader's host tensor the strategy remembered (no device wait).
    assert len(host_reads) >= 12 and all(host_reads), host_reads
    _, content_stats, _ = cached("content")
    assert stats["autocache/boundary"] == 3 and stats["autocache/hits"] >= 24 + 24  # epochs 2-3, train + val
    assert (stats["autocache/hits"], stats["autocache/misses"]) == (content_stats["autocache/hits"], content_stats["autocache/misses"])
    plain, _, plain_losses = fit_indexed("auto", *loaders())
    assert_state_close(by_index.state_dict(), plain.state_dict(), rtol=1e-4, atol=1e-5)
    assert index_losses == pytest.approx(plain_losses, rel=1e-5, abs=1e-6)


def test_index_keys_then_validate_under_inference_mode(tmp_path):
    """A standalone validate runs under inference_mode: their batches have no version counter, so
    their indices are read from the tensor the forward gets (there is nothing to tell a change by)."""
    module = Classifier("bert")
    trainer = cpu_trainer(
        PipeTransformerStrategy(cache=True, cache_key="index", cache_dir=str(tmp_path)), [AutoFreeze(schedule={1: 2})], max_epochs=2,
    )
    trainer.fit(module, indexed_text())
    first = trainer.validate(module, indexed_text(seed=5), verbose=False)
    again = trainer.validate(module, indexed_text(seed=5), verbose=False)
    plain = cpu_trainer("auto", max_epochs=1).validate(module, indexed_text(seed=5), verbose=False)
    assert first == again and first[0]["val_loss"] == pytest.approx(plain[0]["val_loss"], rel=1e-5)


def test_index_keys_after_a_transfer_hook_that_reorders_the_rows(tmp_path):
    """A LightningModule whose on_after_batch_transfer reorders the batch on the device: the forward's
    indices are not the loader's order any more, so the loader's host copy must not name its rows."""

    class Reordered(Classifier):
        def on_after_batch_transfer(self, batch, dataloader_idx):
            order = torch.arange(len(batch["index"]) - 1, -1, -1)
            return {k: v[order] for k, v in batch.items()}

    def fitted(strategy):
        module, losses = Reordered("bert"), ValLosses()
        cpu_trainer(strategy, [AutoFreeze(schedule={1: 2}), losses], max_epochs=3).fit(module, indexed_text(shuffle=True), indexed_text(seed=5))
        return module, losses.losses

    strategy = PipeTransformerStrategy(cache=True, cache_key="index", cache_dir=str(tmp_path))
    cached, cached_losses = fitted(strategy)
    plain, plain_losses = fitted("auto")
    assert strategy.cache_stats["autocache/hits"] > 0  # engaged
    assert_state_close(cached.state_dict(), plain.state_dict(), rtol=1e-4, atol=1e-5)
    assert cached_losses == pytest.approx(plain_losses, rel=1e-5, abs=1e-6)


def test_random_augmentation_misses_under_content_keys_and_stops_index_keys(tmp_path):
    # Content keys stay exact (an augmented input misses). Index keys name the sample, not its input: a probed
    # sample whose input changed between epochs stops the run before its first view's activations are served.
    from lightning_pipetransformer.cache.indices import InputChanged

    plain, _, _ = fit_indexed("auto", indexed_text(augment=True))
    by_content, trainer, _ = fit_indexed(
        PipeTransformerStrategy(cache=True, cache_dir=str(tmp_path / "content")), indexed_text(augment=True)
    )
    assert trainer.strategy.cache_stats["autocache/misses"] > 0
    assert_state_close(by_content.state_dict(), plain.state_dict(), rtol=1e-4, atol=1e-5)
    strategy = PipeTransformerStrategy(cache=True, cache_key="index", cache_dir=str(tmp_path / "index"))
    with pytest.raises(InputChanged, match="augmentation or masking.*cache_key='content'"):
        fit_indexed(strategy, indexed_text(augment=True))
    assert strategy.cache_stats["autocache/hits"] == 0  # stopped before anything stale was served


def test_index_keys_probe_unchanged_inputs_without_complaint(tmp_path):
    # The same samples, shuffled, every epoch: the probes match, the cache serves, and the run equals the plain one.
    from lightning_pipetransformer.cache.indices import probed

    assert sum(probed(i) for i in range(24)) >= 1  # at least one of these samples is probed every pass
    cached, trainer, _ = fit_indexed(
        PipeTransformerStrategy(cache=True, cache_key="index", cache_dir=str(tmp_path)), indexed_text(shuffle=True)
    )
    plain, _, _ = fit_indexed("auto", indexed_text(shuffle=True))
    assert trainer.strategy.cache_stats["autocache/hits"] > 0
    assert_state_close(cached.state_dict(), plain.state_dict(), rtol=1e-4, atol=1e-5)


def test_cache_with_trainable_embeddings_and_with_everything_frozen(tmp_path):
    # freeze_embeddings=False: gradients must still reach the embeddings through frozen blocks.
    module = Classifier("bert")
    cpu_trainer(
        PipeTransformerStrategy(cache=True, cache_dir=str(tmp_path / "a")), [AutoFreeze(schedule={1: 2}, freeze_embeddings=False)], max_epochs=3,
    ).fit(module, data_for("bert"))
    plain = Classifier("bert")
    cpu_trainer("auto", [AutoFreeze(schedule={1: 2}, freeze_embeddings=False)], max_epochs=3).fit(plain, data_for("bert"))
    assert_state_close(module.state_dict(), plain.state_dict())
    # min_active=0 with every block frozen: only the head trains, on cached boundaries.
    module = Classifier("bert")
    cpu_trainer(
        PipeTransformerStrategy(cache=True, cache_dir=str(tmp_path / "b")), [AutoFreeze(schedule={1: 4}, min_active=0)], max_epochs=3,
    ).fit(module, data_for("bert"))
    plain = Classifier("bert")
    cpu_trainer("auto", [AutoFreeze(schedule={1: 4}, min_active=0)], max_epochs=3).fit(plain, data_for("bert"))
    assert_state_close(module.state_dict(), plain.state_dict(), rtol=1e-4, atol=1e-5)


class _RecordsApply(torch.nn.Module):
    """A module that keeps state only its own ``_apply`` moves (as torchmetrics does), and records the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[torch.device] = []
        self.state = torch.zeros(2)  # a plain attribute: neither parameter nor buffer

    def _apply(self, fn, recurse=True):
        self.state = fn(self.state)
        self.calls.append(self.state.device)
        return super()._apply(fn, recurse)


def test_modules_outside_the_stack_move_through_their_own_apply():
    """Metrics and other state outside the stack are moved by Module._apply (on CUDA torchmetrics' states
    would otherwise stay on the CPU and the first update() fail)."""
    import torchmetrics

    module = Classifier("bert")
    module.recorder = _RecordsApply()
    module.metric = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
    applied = []
    original = type(module.metric)._apply

    def spy(self, fn, *args, **kwargs):
        applied.append(type(self).__name__)
        return original(self, fn, *args, **kwargs)

    at_start = {}

    class AtStart(Callback):  # before training: teardown moves everything to the CPU through _apply anyway
        def on_train_start(self, trainer, pl_module):
            at_start.update(recorder=len(pl_module.recorder.calls), metric=len(applied))

    type(module.metric)._apply = spy
    try:
        cpu_trainer(PipeTransformerStrategy(pipe_len=2), [AtStart()], max_epochs=1).fit(module, data_for("bert"))
    finally:
        type(module.metric)._apply = original
    assert at_start["recorder"] > 0 and at_start["metric"] > 0, at_start
    # The blocks were not moved as part of their ancestors: only by their stage's placement.
    assert all(p.device.type == "cpu" for p in module.parameters())


def test_the_input_recorder_holds_nothing_while_the_cache_does_not_serve(tmp_path):
    """Before the first freeze no cached stack reads the record: it must not keep the last batch's embeddings."""
    seen = []

    class Check(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((trainer.current_epoch, trainer.strategy.autocache.embeddings.recorder.pending is None))

    strategy = PipeTransformerStrategy(cache=True, cache_dir=str(tmp_path))
    cpu_trainer(strategy, [AutoFreeze(schedule={1: 2}), Check()], max_epochs=2).fit(Classifier("bert"), data_for("bert"))
    assert seen and all(empty for _, empty in seen), seen
    assert strategy.cache_stats["autocache/stored"] > 0  # the cache did serve in epoch 1 (and took each record)


def test_index_keys_stop_a_masking_done_in_training_step(tmp_path):
    """Random tokens masked in training_step, after the loader: the loader's batch is the same every epoch, what reaches
    the model is not. The forward probe stops the run before a first view is served."""
    from lightning_pipetransformer.cache.indices import InputChanged
    from tests.helpers.lightning_models import inputs_and_labels

    class MasksInTrainingStep(Classifier):
        def training_step(self, batch, batch_idx):
            x, y = inputs_and_labels(batch)
            x = x.clone()
            x[torch.rand(x.shape, generator=self.masking) < 0.3] = 0
            loss = torch.nn.functional.cross_entropy(self(x), y)
            return loss

    module = MasksInTrainingStep("bert")
    module.masking = torch.Generator().manual_seed(3)
    strategy = PipeTransformerStrategy(cache=True, cache_key="index", cache_dir=str(tmp_path))
    trainer = cpu_trainer(strategy, [AutoFreeze(schedule=SCHEDULE)], max_epochs=4)
    with pytest.raises(InputChanged, match="training_step"):
        trainer.fit(module, indexed_text(n=48))
    assert strategy.cache_stats["autocache/hits"] == 0  # stopped before anything stale was served
