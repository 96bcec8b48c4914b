"""AutoCache through the Trainer, configuration by configuration: each run equals the same run without cache.

Every test fits a tiny model with the cache on and the same fit without it (``strategy="auto"``
unless said otherwise), then checks the weights (allclose), the logged validation losses, and that
the cache really served batches (hits > 0).
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from lightning_pipetransformer.stack.observers import sees_block_runs
from tests.helpers.cached_fits import ATOL, RTOL, SCHEDULE, assert_same_run, cached, fit, stats_of
from tests.helpers.compare import assert_state_close
from tests.helpers.lightning_models import Classifier, data_for, indexed_text
from tests.helpers.trainers import cpu_trainer


class Stats(Callback):
    """The cache's counters at each train-epoch end (the store is per boundary, so the last ones are partial)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, float] | None] = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.seen.append(getattr(trainer.strategy, "cache_stats", None))


def assert_served(trainer, at_least=1, boundary=3):
    stats = stats_of(trainer)
    assert stats["autocache/boundary"] == boundary, stats
    assert stats["autocache/hits"] >= at_least, stats
    return stats


# ---------------------------------------------------------------------------- store settings


@pytest.mark.parametrize("key", ["content", "index"])
def test_cache_auto_equals_cache_off(tmp_path, key):
    def data():
        return dict(train=indexed_text(), val=indexed_text(n=16, seed=7))

    run = fit("bert", cached(tmp_path, cache="auto", cache_key=key), **data())
    # Epochs 2-3 at boundary 3: 24 training + 16 validation lookups each; the first all-hit batch
    # decides (on this CPU either way): at least that batch was served.
    assert_served(run[1], at_least=8)
    assert_same_run(run, fit("bert", "auto", **data()))


def test_disk_only_cache_equals_cache_off(tmp_path):
    run = fit("bert", cached(tmp_path, cache_memory=0))
    stats = assert_served(run[1], at_least=2 * (24 + 16))  # epochs 2-3, training and validation, all hit
    assert stats["autocache/bytes_in_memory"] == 0 and stats["autocache/files_on_disk"] == 24 + 16
    assert stats["autocache/disk_hits"] == stats["autocache/hits"]
    assert_same_run(run, fit("bert", "auto"))


def test_memory_budget_spilling_mid_epoch_equals_cache_off(tmp_path):
    # Measure one entry's bytes (activation + mask row) in memory, then allow 36 entries there: the
    # 40 training samples spill from the 5th batch of epoch 1 on (a budget of at least 32 entries:
    # a boundary advance stores 32 entries at a time).
    probe = stats_of(fit("bert", cached(tmp_path, "probe"), max_epochs=2)[1])
    per_entry = probe["autocache/bytes_in_memory"] / probe["autocache/entries_in_memory"]
    budget = int(36 * per_entry)
    seen = Stats()
    run = fit("bert", cached(tmp_path, cache_memory=budget), train=data_for("bert", n=40), callbacks=[seen])
    assert seen.seen[1]["autocache/files_on_disk"] > 0  # epoch 1 (boundary 1) already spilled
    stats = assert_served(run[1], at_least=2 * (40 + 16))
    assert stats["autocache/memory_hits"] > 0 and stats["autocache/disk_hits"] > 0
    assert 0 < stats["autocache/bytes_in_memory"] <= budget
    assert_same_run(run, fit("bert", "auto", train=data_for("bert", n=40)))


def test_budget_of_a_batch_but_not_of_an_advance_group_equals_cache_off(tmp_path):
    # Room for 12 entries (1.5 training batches of 8): the boundary advance moves entries in
    # groups of up to 32, which spill like any entry (before: "smaller than one batch" at epoch 2).
    probe = stats_of(fit("bert", cached(tmp_path, "probe"), max_epochs=2)[1])
    per_entry = probe["autocache/bytes_in_memory"] / probe["autocache/entries_in_memory"]
    run = fit("bert", cached(tmp_path, cache_memory=int(12 * per_entry)))
    stats = assert_served(run[1], at_least=2 * (24 + 16))
    assert stats["autocache/disk_hits"] > 0 and stats["autocache/memory_hits"] > 0
    assert_same_run(run, fit("bert", "auto"))


def test_budget_below_one_batch_fails_at_the_first_step(tmp_path):
    # Before: only at the first store, after all of epoch 0 (the first freeze can be epochs away).
    module = Classifier("bert")
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = cpu_trainer(cached(tmp_path, cache_memory=1000), [AutoFreeze(schedule=SCHEDULE)], max_epochs=4)
    with pytest.raises(ValueError, match="cache_memory=.*smaller than one batch"):
        trainer.fit(module, data_for("bert"))
    assert trainer.global_step == 0
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_cache_without_skipping_embeddings_equals_cache_off(tmp_path):
    run = fit("bert", cached(tmp_path, cache_skip_embeddings=False))
    stats = assert_served(run[1], at_least=2 * (24 + 16))
    assert stats["autocache/embeddings_skipped"] == 0
    assert_same_run(run, fit("bert", "auto"))


# ---------------------------------------------------------------------------- model families


@pytest.mark.parametrize("kind, pipe_len, chunks", [("vit", 2, 2), ("timm", 1, 1), ("torch", 2, 3), ("bert", 4, 3)])
def test_model_families_equal_cache_off(tmp_path, kind, pipe_len, chunks):
    run = fit(kind, cached(tmp_path, pipe_len=pipe_len, chunks=chunks))
    assert_served(run[1], at_least=2 * (24 + 16))
    assert_same_run(run, fit(kind, "auto"))


# ---------------------------------------------------------------------------- pipeline settings


def test_auto_chunks_with_cache_equals_cache_off(tmp_path):
    run = fit("bert", cached(tmp_path, pipe_len=4, chunks="auto"))
    assert 4 in run[1].strategy.engine.auto_chunks  # measured at epoch 0, before anything was cached
    assert_served(run[1], at_least=2 * (24 + 16))
    assert_same_run(run, fit("bert", "auto"))


# ---------------------------------------------------------------------------- Trainer options


def test_gradient_accumulation_with_cache_equals_cache_off(tmp_path):
    run = fit("bert", cached(tmp_path), accumulate_grad_batches=2)
    assert_served(run[1], at_least=2 * (24 + 16))
    assert_same_run(run, fit("bert", "auto", accumulate_grad_batches=2))


def test_bf16_true_with_cache_equals_cache_off(tmp_path):
    run = fit("bert", cached(tmp_path), precision="bf16-true")
    assert_served(run[1], at_least=2 * (24 + 16))
    assert_same_run(run, fit("bert", PipeTransformerStrategy(), precision="bf16-true"))


@pytest.mark.parametrize("key", ["content", "index"])
def test_bf16_mixed_with_a_boundary_advance_equals_cache_off(tmp_path, key):
    # The advance 1 -> 3 runs outside any step; it must run under the same autocast as a forward
    # (before: fp32, so content keys raised StaleCacheError and index keys, never re-verified,
    # trained on silently different activations).
    def data():
        return dict(train=indexed_text(), val=indexed_text(n=16, seed=7))

    run = fit("bert", cached(tmp_path, cache_key=key), precision="bf16-mixed", **data())
    stats = assert_served(run[1], at_least=2 * (24 + 16))
    assert stats["autocache/advanced"] > 0
    assert_same_run(run, fit("bert", PipeTransformerStrategy(), precision="bf16-mixed", **data()))


def test_validation_mid_epoch_with_cache_equals_cache_off(tmp_path):
    run = fit("bert", cached(tmp_path), val_check_interval=1)  # after each of the 3 training batches
    assert len(run[2]) == 3 * 4
    assert_served(run[1], at_least=2 * (24 + 16))
    assert_same_run(run, fit("bert", "auto", val_check_interval=1))


def test_smaller_last_batch_equals_cache_off(tmp_path):
    # 20 samples in batches of 8: 8, 8, 4 (drop_last=False); validation 13: 8, 5.
    train, val = data_for("bert", n=20), data_for("bert", n=13, seed=7)
    run = fit("bert", cached(tmp_path), train=train, val=val)
    assert_served(run[1], at_least=2 * (20 + 13))
    assert_same_run(run, fit("bert", "auto", train=data_for("bert", n=20), val=data_for("bert", n=13, seed=7)))


def test_shuffled_batches_with_content_keys_equal_cache_off(tmp_path):
    # Classifier's mask depends on the position in the batch: a moved sample must miss, never be mixed up.
    def loader():
        x, y = data_for("bert").dataset.tensors
        return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))

    run = fit("bert", cached(tmp_path), train=loader())
    stats = assert_served(run[1], at_least=16 * 2)  # validation is not shuffled: it hits
    assert stats["autocache/misses"] > 0
    assert_same_run(run, fit("bert", "auto", train=loader()))


def test_automatic_freeze_rule_with_cache_equals_cache_off(tmp_path):
    def freeze():
        return AutoFreeze(alpha=0.5)  # the paper's rule: gradient norms decide

    stats = Stats()
    run = fit("bert", cached(tmp_path), freeze=freeze(), callbacks=[stats])
    plain = fit("bert", "auto", freeze=freeze())
    frozen = run[1].callbacks[0].num_frozen
    assert frozen > 0 and frozen == plain[1].callbacks[0].num_frozen
    assert run[1].callbacks[0].history == plain[1].callbacks[0].history
    assert any(s is not None and s.get("autocache/hits", 0) > 0 for s in stats.seen)
    assert_same_run(run, plain)


def test_resume_with_cache_equals_uninterrupted(tmp_path):
    def run(name, max_epochs, ckpt_path=None, strategy=None):
        checkpoints = ModelCheckpoint(dirpath=tmp_path / name, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
        return fit(
            "bert", strategy or cached(tmp_path, name + "-cache"), max_epochs=max_epochs, callbacks=[checkpoints],
            enable_checkpointing=True, ckpt_path=ckpt_path,
        )

    full = run("full", 4)
    run("first", 2)  # stops after epoch 1 (boundary 1, cache filled)
    resumed = run("resumed", 4, ckpt_path=tmp_path / "first" / "epoch=1.ckpt")
    assert_served(resumed[1], at_least=24 + 16)  # epoch 3 at boundary 3
    assert resumed[1].callbacks[0].num_frozen == 3
    plain = run("plain", 4, strategy="auto")
    assert_state_close(resumed[0].state_dict(), full[0].state_dict(), rtol=RTOL, atol=ATOL)
    assert full[2] == pytest.approx(plain[2], rel=1e-5)
    assert resumed[2] == pytest.approx(plain[2][2:], rel=1e-5)  # epochs 2-3
    assert_same_run(full, plain)


def test_mid_epoch_resume_with_cache_equals_it_without(tmp_path):
    # Checkpoints after every step; resume from step 7 (epoch 2, after its first batch: boundary 3,
    # opened cold). Lightning's mid-epoch resume is not the uninterrupted run (under any strategy),
    # so the reference is the same resume without the cache.
    def run(name, strategy, ckpt_path=None):
        checkpoints = ModelCheckpoint(dirpath=tmp_path / name, save_top_k=-1, every_n_train_steps=1, filename="{step}")
        return fit("bert", strategy, callbacks=[checkpoints], enable_checkpointing=True, ckpt_path=ckpt_path)

    run("full-cache", cached(tmp_path, "full-cache-dir"))
    run("full-plain", "auto")
    resumed = run("resumed", cached(tmp_path, "resumed-dir"), ckpt_path=tmp_path / "full-cache" / "step=7.ckpt")
    plain = run("resumed-plain", "auto", ckpt_path=tmp_path / "full-plain" / "step=7.ckpt")
    # Epoch 3: training batches 1-2 (seen after the resume) and validation hit; batch 0 misses.
    assert_served(resumed[1], at_least=16 + 16)
    assert_same_run(resumed, plain)


class WithTest(Classifier):
    def test_step(self, batch, batch_idx):
        self.validation_step(batch, batch_idx)


@pytest.mark.parametrize("memory", [4 * 2**30, 0])  # the entries in memory, or all on disk
def test_validate_test_predict_after_fit_with_cache(tmp_path, memory):
    # Each call after fit goes on with the fit's cache: its current store (boundary 3), whose entries the fit's
    # validation stored, in memory or on disk (content keys, same frozen weights): served from them. The fit's
    # counters are kept (cache_stats_by_stage["fit"]); each call's own are beside them.
    module, trainer, _ = fit("bert", cached(tmp_path, cache_memory=memory), module=WithTest("bert"))
    plain_module, plain_trainer, _ = fit("bert", "auto", module=WithTest("bert"))
    fitted = dict(trainer.strategy.cache_stats_by_stage["fit"])
    assert fitted["autocache/hits"] > 0
    val = data_for("bert", n=16, seed=7)
    for method in ("validate", "test"):
        got = getattr(trainer, method)(module, val, verbose=False)[0]["val_loss"]
        want = getattr(plain_trainer, method)(plain_module, val, verbose=False)[0]["val_loss"]
        assert got == pytest.approx(want, rel=1e-5)
        stats = trainer.strategy.cache_stats_by_stage[method]
        assert stats["autocache/hits"] == 16 and stats["autocache/misses"] == 0, stats
    got = trainer.predict(module, val)
    want = plain_trainer.predict(plain_module, val)
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    stats = trainer.strategy.cache_stats_by_stage["predict"]
    assert stats["autocache/hits"] == 16 and stats["autocache/misses"] == 0 and stats["autocache/boundary"] == 3
    assert trainer.strategy.cache_stats_by_stage["fit"] == fitted  # the training's counters, kept


class OtherSamples(torch.utils.data.Dataset):
    """Other token ids under the dataset indices ``first..first+n-1``, each at the batch position the fit's validation
    loader had it at (the classifier pads every other position: the same attention mask, the same block arguments)."""

    def __init__(self, first: int, n: int) -> None:
        from tests.helpers.lightning_models import IndexedSamples, _ids

        self.samples, self.first, self.n = IndexedSamples(*_ids(first + n, 9)), first, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return self.samples[self.first + i]


@pytest.mark.parametrize("first", [0, 2], ids=["probed-indices", "unprobed-indices"])
def test_validate_after_fit_with_index_keys_serves_no_index_of_another_loader(tmp_path, first):
    # Before: validate after fit went on with the fit's index namespace, and index i of the loader given to validate was
    # served the fit's validation entry of index i: silently where no probed index came (val loss 1.2814 against
    # 1.2518), else InputChanged blaming an augmentation. Index keys name the samples of one set-up's loaders only.
    def data():
        return dict(train=indexed_text(), val=indexed_text(n=16, seed=7))

    module, trainer, _ = fit("bert", cached(tmp_path, cache_key="index"), **data())
    plain_module, plain_trainer, _ = fit("bert", "auto", **data())
    other = DataLoader(OtherSamples(first, 8 if first else 16), batch_size=8)
    got = trainer.validate(module, other, verbose=False)[0]["val_loss"]
    assert got == pytest.approx(plain_trainer.validate(plain_module, other, verbose=False)[0]["val_loss"], rel=1e-5)
    assert trainer.strategy.cache_stats_by_stage["validate"]["autocache/hits"] == 0


# ---------------------------------------------------------------------------- model and data variants


class DropoutClassifier(Classifier):
    """Dropout 0.1 in the embeddings and every block: frozen modules are in eval mode, active ones draw."""

    def __init__(self) -> None:
        super().__init__("bert")
        from tests.helpers.models import tiny_bert

        torch.manual_seed(0)
        self.model = tiny_bert(4, dropout=0.1)


def test_dropout_in_active_blocks_with_cache_equals_cache_off(tmp_path):
    # The same strategy on both sides (it re-seeds at fit start, strategy="auto" does not).
    run = fit("bert", cached(tmp_path), module=DropoutClassifier())
    assert_served(run[1], at_least=2 * (24 + 16))
    assert_same_run(run, fit("bert", PipeTransformerStrategy(), module=DropoutClassifier()))


class PaddedSamples(torch.utils.data.Dataset):
    """Token ids of lengths 3..8; batches are padded to their longest sample (dynamic padding)."""

    def __init__(self, n: int, seed: int) -> None:
        from tests.helpers.models import VOCAB

        g = torch.Generator().manual_seed(seed)
        self.ids = [torch.randint(1, VOCAB, (int(torch.randint(3, 9, (), generator=g)),), generator=g) for _ in range(n)]
        self.labels = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"ids": self.ids[index], "y": self.labels[index], "index": index}


def pad(samples: list[dict]) -> dict:
    length = max(len(s["ids"]) for s in samples)
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(samples):
        ids[row, : len(s["ids"])] = s["ids"]
        mask[row, : len(s["ids"])] = 1
    return {
        "ids": ids, "mask": mask, "y": torch.stack([s["y"] for s in samples]),
        "index": torch.tensor([s["index"] for s in samples]),
    }


class PaddedClassifier(Classifier):
    def forward(self, ids, mask):
        return self.model(input_ids=ids, attention_mask=mask).logits

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.cross_entropy(self(batch["ids"], batch["mask"]), batch["y"])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.cross_entropy(self(batch["ids"], batch["mask"]), batch["y"]))


def padded(n: int, seed: int, shuffle: bool) -> DataLoader:
    generator = torch.Generator().manual_seed(3) if shuffle else None
    return DataLoader(PaddedSamples(n, seed), batch_size=8, shuffle=shuffle, generator=generator, collate_fn=pad)


@pytest.mark.parametrize("key", ["content", "index"])
def test_dynamic_padding_shuffled_equals_cache_off(tmp_path, key):
    # A sample's padded length (so its entry's shape) and mask change with the batch it lands in:
    # those lookups must miss, the others hit, under either key.
    def data():
        return dict(train=padded(24, 0, shuffle=True), val=padded(16, 7, shuffle=False))

    run = fit("bert", cached(tmp_path, cache_key=key), module=PaddedClassifier("bert"), **data())
    stats = assert_served(run[1], at_least=2 * 16)  # validation batches do not move: they hit
    assert stats["autocache/misses"] > 0
    assert_same_run(run, fit("bert", "auto", module=PaddedClassifier("bert"), **data()))


class TrainingBlockRuns(Callback):
    """Real runs of each block during each training epoch's batches (validation not counted)."""

    def __init__(self) -> None:
        self.epochs: list[list[int]] = []
        self._training = False

    def on_fit_start(self, trainer, pl_module):
        for index, block in enumerate(trainer.strategy.stack.blocks):
            block.register_forward_pre_hook(sees_block_runs(lambda *_, i=index: self._count(i)))

    def _count(self, index):
        if self._training:
            self.epochs[-1][index] += 1

    def on_train_epoch_start(self, trainer, pl_module):
        self.epochs.append([0] * len(trainer.strategy.stack.blocks))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._training = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._training = False


def test_a_boundary_move_advances_each_entry_when_it_is_read(tmp_path):
    """Issue 25: at a move F -> F' (one process) no entry is advanced up front; a training batch runs blocks
    F..F'-1 on its own samples' entries only (validation entries advance in validation), never 0..F-1."""
    runs = TrainingBlockRuns()
    seen = Stats()
    run = fit("bert", cached(tmp_path), callbacks=[runs, seen])
    steps = 3  # 24 samples in batches of 8
    # Epoch 1 (boundary 1): the first pass through the installed runner also probes every block once,
    # then block 0 runs for every miss. Epoch 2 (boundary 3): entries read at boundary 1 run blocks 1-2
    # only. Epoch 3: hits; blocks 0-2 run once, to check the first hits.
    assert runs.epochs[1] == [1 + steps] * 4
    assert runs.epochs[2][:3] == [0, steps, steps] and runs.epochs[3][:3] == [1, 1, 1], runs.epochs
    assert runs.epochs[0] == [steps] * 4 and runs.epochs[2][3] == runs.epochs[3][3] == steps
    # Every entry advanced once in epoch 2: the 24 training ones by training batches (blocks 1-2 ran 3 times
    # there, above), the 16 validation ones in its validation.
    assert seen.seen[2]["autocache/advanced"] == 24 + 16
    assert_served(run[1], at_least=2 * (24 + 16))
    assert_same_run(run, fit("bert", "auto"))
