"""Entries kept for later runs (``cache_keep``, issue 42): a sweep pays for the frozen prefix once.

Each later run is compared with the same run without the cache (weights, validation losses) and checked to have
been served from its first step (hits counted in epoch 0, the frozen blocks not run); anything that computes the
prefix otherwise (one ulp of a frozen weight, another dtype, config, forward or entry format) misses every lookup.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from transformers import BertConfig, BertForSequenceClassification
from transformers.models.bert.modeling_bert import BertSelfOutput

from lightning_pipetransformer import AutoFreeze
from lightning_pipetransformer.cache import arguments, autocache, validity
from lightning_pipetransformer.cache.kept import store_folders
from lightning_pipetransformer.cache.store import ActivationStore
from tests.helpers.block_runs import ForwardRunsPerEpoch
from tests.helpers.cached_fits import assert_same_run, cached, fit, stats_of
from tests.helpers.compare import assert_state_close
from tests.helpers.launch import clean_env
from tests.helpers.lightning_models import Classifier
from tests.helpers.models import tiny_bert
from tests.integration.test_cache_faults import DiskFailsAfter, entry_files, overwrite_tensor_bytes

EARLY = {0: 2}  # embeddings + 2 of 4 blocks frozen from the first step (an early AutoFreeze decision)
LOOKUPS = 24 + 16  # per epoch: 3 training and 2 validation batches of 8
# A run that finds nothing kept computes its first training batch before the call order is known, and does not store
# it: a one-epoch run keeps the other 32 entries (the first batch is stored when it comes again).
KEPT_BY_ONE_EPOCH = LOOKUPS - 8


def with_head(seed: int, module: Classifier | None = None) -> Classifier:
    """The same pretrained backbone (seed 0), the classifier head initialised with ``seed``: one run of a sweep."""
    module = module or Classifier("bert")
    torch.manual_seed(seed)
    module.model.classifier.reset_parameters()
    return module


class EpochStats(Callback):
    """The cache's hits and misses in each training epoch (training and its validation), from the counters' deltas."""

    def __init__(self) -> None:
        self.epochs: list[dict[str, float]] = []
        self._before = {"autocache/hits": 0.0, "autocache/misses": 0.0}

    def on_train_epoch_start(self, trainer, pl_module):
        stats = trainer.strategy.cache_stats or {}
        self._before = {k: stats.get(k, 0.0) for k in self._before}

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking:
            return
        stats = trainer.strategy.cache_stats or {}
        self.epochs.append({k.split("/")[1]: stats.get(k, 0.0) - v for k, v in self._before.items()})


def kept_fit(folder: Path, module: Classifier, *callbacks: Callback, max_epochs: int = 2, **kwargs):
    return fit("bert", cached(folder.parent, folder.name, cache_keep=True, **kwargs), module=module,
               freeze=AutoFreeze(schedule=EARLY), max_epochs=max_epochs, callbacks=callbacks)


def plain_fit(module: Classifier, max_epochs: int = 2):
    return fit("bert", "auto", module=module, freeze=AutoFreeze(schedule=EARLY), max_epochs=max_epochs)


# ---------------------------------------------------------------------------- reuse across runs


def test_a_later_run_with_another_head_is_served_from_its_first_step_and_equals_cache_off(tmp_path):
    # Before: each run of a sweep started cold (the entries stayed in the run's memory, and the first training
    # forward computed the prefix whatever was kept): 0 hits in the second run's first epoch.
    folder = tmp_path / "sweep"
    first_module = with_head(1)
    first_runs, first_stats = ForwardRunsPerEpoch(first_module), EpochStats()
    kept_fit(folder, first_module, first_runs, first_stats)
    assert first_stats.epochs[0]["hits"] == 0  # the first run pays for the prefix
    module = with_head(2)
    runs, stats = ForwardRunsPerEpoch(module), EpochStats()
    run = kept_fit(folder, module, runs, stats)
    assert stats.epochs[0] == {"hits": LOOKUPS, "misses": 0}  # every lookup of epoch 0 hit, the first batch's too
    # The frozen blocks ran twice in epoch 0, for the checks of the first step (the first-batch self-check's plain
    # loop, the first-hit check), where the first run ran them for every batch; the active blocks ran as there.
    assert runs.epochs[0][:2] == [2, 2] and first_runs.epochs[0][:2] == [6, 6]
    assert runs.epochs[0][2:] == first_runs.epochs[0][2:]
    assert runs.epochs[1][:2] == [0, 0]
    assert_same_run(run, plain_fit(with_head(2)))


class EditBeforeSecondStep(Callback):
    """Block 0's output weight scaled in place before the second training step (epoch 0, batch 1)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.current_epoch == 0 and batch_idx == 1:
            with torch.no_grad():
                pl_module.model.bert.encoder.layer[0].output.dense.weight.mul_(1.05)


def test_a_prefix_edited_after_a_first_step_served_from_kept_entries_opens_again_and_equals_cache_off(tmp_path, recwarn):
    # Before: the second step's check of the store opened early (its fingerprint against the prefix now) built its
    # PrefixChange with an argument the class does not take: TypeError.
    folder = tmp_path / "sweep"
    kept_fit(folder, with_head(1))
    run = kept_fit(folder, with_head(2), EditBeforeSecondStep())
    assert any("changed between the first step and the second" in str(w.message) for w in recwarn)
    assert stats_of(run[1])["autocache/prefix_changes"] >= 1 and stats_of(run[1])["autocache/hits"] > 0
    plain = fit("bert", "auto", module=with_head(2), freeze=AutoFreeze(schedule=EARLY), max_epochs=2,
                callbacks=[EditBeforeSecondStep()])
    assert_same_run(run, plain)


# ---------------------------------------------------------------------------- anything else misses


def _ulp(module: Classifier) -> Classifier:
    weight = module.model.bert.encoder.layer[1].output.dense.weight
    with torch.no_grad():
        weight.view(-1)[0] = torch.nextafter(weight.view(-1)[0], torch.tensor(float("inf")))
    return module


def _double(module: Classifier) -> Classifier:
    return module.double()


def _config(module: Classifier) -> Classifier:
    # The same weights (same seed, same shapes), another activation: only the configuration differs.
    torch.manual_seed(0)
    config = module.model.config.to_dict() | {"hidden_act": "gelu_new"}
    module.model = BertForSequenceClassification(BertConfig(**config))
    return with_head(1, module)


def _halved_residual(self, hidden_states, input_tensor):
    return self.LayerNorm(self.dropout(self.dense(hidden_states)) + 0.5 * input_tensor)


VARIANTS = {
    "one ulp of a frozen weight": lambda m, mp: _ulp(m),
    "float64": lambda m, mp: _double(m),
    "another model config": lambda m, mp: _config(m),
    "another forward": lambda m, mp: (mp.setattr(BertSelfOutput, "forward", _halved_residual), m)[1],
    "another entry format": lambda m, mp: (mp.setattr(autocache, "ENTRY_FORMAT", arguments.ENTRY_FORMAT + 1), m)[1],
    "another format version": lambda m, mp: (mp.setattr(validity, "FORMAT_VERSION", validity.FORMAT_VERSION + 1), m)[1],
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_run_that_computes_the_prefix_otherwise_misses_every_lookup(tmp_path, monkeypatch, variant):
    folder = tmp_path / "sweep"
    kept_fit(folder, with_head(1), max_epochs=1)
    first = {f.path.name: f.files for f in store_folders(folder)}
    assert list(first.values()) == [KEPT_BY_ONE_EPOCH]
    stats = EpochStats()
    module = VARIANTS[variant](with_head(1), monkeypatch)
    run = kept_fit(folder, module, stats, max_epochs=1)
    assert stats.epochs[0]["hits"] == 0 and stats.epochs[0]["misses"] > 0, stats.epochs
    assert stats_of(run[1])["autocache/rejected"] == 0  # another folder, not another file in the same one
    after = {f.path.name: f.files for f in store_folders(folder)}
    assert {k: after[k] for k in first} == first and len(after) == 2  # its own folder beside the first run's


# ---------------------------------------------------------------------------- kept folders outlive boundary moves


def test_boundary_moves_keep_the_earlier_folders_for_a_later_run(tmp_path):
    # Before: the move 1 -> 3 deleted boundary 1's folder (close(delete=True)), and the second run started cold.
    folder = tmp_path / "sweep"
    schedule = {0: 1, 1: 3}
    fit("bert", cached(tmp_path, "sweep", cache_keep=True), module=with_head(1), freeze=AutoFreeze(schedule=schedule),
        max_epochs=2)
    first = {f.path.name.split("-")[1]: f for f in store_folders(folder)}
    assert sorted(first) == ["b1", "b3"] and all(f.kept for f in first.values())
    stats = EpochStats()
    run = fit("bert", cached(tmp_path, "sweep", cache_keep=True), module=with_head(2), freeze=AutoFreeze(schedule=schedule),
              max_epochs=2, callbacks=[stats])
    # Epoch 0 (block 0 frozen from the start, as in the first run): served from the first run's boundary-1 folder. Blocks
    # 1-2 trained in epoch 0 under another head, so boundary 3 is another prefix: its own folder, never the first run's.
    assert stats.epochs[0] == {"hits": KEPT_BY_ONE_EPOCH, "misses": 8}
    assert run[1].strategy.autocache.store.directory != first["b3"].path and len(store_folders(folder)) == 3
    assert_same_run(run, fit("bert", "auto", module=with_head(2), freeze=AutoFreeze(schedule=schedule), max_epochs=2))


# ---------------------------------------------------------------------------- two runs at once


RUN_ONE = """
import sys, torch
from lightning_pipetransformer import AutoFreeze
from tests.helpers.cached_fits import cached, fit, stats_of
from tests.integration.test_cache_keep import EARLY, with_head
folder, seed, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
module, trainer, losses = fit("bert", cached(__import__("pathlib").Path(folder).parent, __import__("pathlib").Path(folder).name,
                              cache_keep=True), module=with_head(seed), freeze=AutoFreeze(schedule=EARLY), max_epochs=2)
torch.save({"state": module.state_dict(), "losses": losses, "stats": stats_of(trainer)}, out)
"""


def test_two_runs_at_once_share_one_folder_and_each_equals_cache_off(tmp_path):
    folder = tmp_path / "sweep"
    env = clean_env(PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    outs = [tmp_path / f"run{seed}.pt" for seed in (1, 2)]
    children = [
        subprocess.Popen([sys.executable, "-c", RUN_ONE, str(folder), str(seed), str(out)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for seed, out in zip((1, 2), outs)
    ]
    for child in children:
        output, _ = child.communicate(timeout=600)
        assert child.returncode == 0, output[-3000:]
    for seed, out in zip((1, 2), outs):
        got = torch.load(out)
        module, _, losses = plain_fit(with_head(seed))
        assert_state_close(got["state"], module.state_dict(), rtol=1e-4, atol=1e-5)
        assert got["losses"] == pytest.approx(losses, rel=1e-5)
        assert got["stats"]["autocache/hits"] >= KEPT_BY_ONE_EPOCH and got["stats"]["autocache/corrupt"] == 0  # both served
    (only,) = store_folders(folder)  # one folder for the one prefix, every sample in it once
    assert only.files == LOOKUPS and only.kept


# ---------------------------------------------------------------------------- the cap, faults


def test_the_cap_evicts_the_least_recently_used_folders_at_the_end_of_a_run(tmp_path):
    folder = tmp_path / "sweep"
    kept_fit(folder, with_head(1), max_epochs=1)
    (oldest,) = store_folders(folder)
    other = kept_fit(folder, _ulp(with_head(1)), max_epochs=1)  # another prefix: a second folder, while under the cap
    assert len(store_folders(folder)) == 2
    cap = oldest.bytes + oldest.bytes // 2
    third = fit("bert", cached(tmp_path, "sweep", cache_keep=True, cache_keep_bytes=cap), module=_ulp(_ulp(with_head(1))),
                freeze=AutoFreeze(schedule=EARLY), max_epochs=1)
    left = store_folders(folder)
    assert len(left) == 1 and left[0].path == third[1].strategy.autocache.store.directory  # the two older ones went
    assert sum(f.bytes for f in left) <= cap
    assert other[1].strategy.autocache.store.directory not in [f.path for f in left]


def test_a_corrupted_kept_file_is_detected_and_recomputed(tmp_path):
    folder = tmp_path / "sweep"
    kept_fit(folder, with_head(1))
    files = entry_files(folder)
    overwrite_tensor_bytes(files[5])
    stats = EpochStats()
    module = with_head(2)
    run = kept_fit(folder, module, stats)
    assert stats_of(run[1])["autocache/corrupt"] >= 1
    assert stats.epochs[0]["hits"] == LOOKUPS - 1 and stats.epochs[0]["misses"] == 1
    assert_same_run(run, plain_fit(with_head(2)))
    store = ActivationStore(folder, files[5].parent.name.split("-")[0], 2, memory_budget=0)
    assert store.lookup([files[5].name.removesuffix(".safetensors")])[0].all() and store.stats().corrupt == 0  # rewritten


def test_a_kept_folder_that_turns_read_only_degrades_to_a_per_run_cache(tmp_path, monkeypatch, recwarn):
    # Before: a cache_dir that cannot be written was a CacheConfigError before training, kept entries or not.
    folder = tmp_path / "sweep"
    kept_fit(folder, with_head(1), max_epochs=1)
    failing = DiskFailsAfter(monkeypatch, folder, epoch=-1, errno_=errno.EROFS)
    failing.failing = True  # read-only from the start (a read-only mount of an earlier sweep's folder)
    stats = EpochStats()
    run = kept_fit(folder, with_head(2), failing, stats, max_epochs=3)
    assert failing.refused >= 1 and stats_of(run[1])["autocache/disk_failures"] >= 1
    assert stats.epochs[0]["hits"] == KEPT_BY_ONE_EPOCH  # the kept entries are read
    # The one batch nothing kept is computed in epochs 0 and 1 (the disk refuses it), then served from memory.
    assert [e["misses"] for e in stats.epochs] == [8, 8, 0]
    assert sum("AutoCache stopped writing" in str(w.message) for w in recwarn) == 1
    assert sum("this run keeps its own in memory only" in str(w.message) for w in recwarn) == 1
    monkeypatch.undo()
    assert_same_run(run, plain_fit(with_head(2), max_epochs=3))


def test_index_keys_are_kept_per_run_and_said_once(tmp_path, recwarn):
    from tests.helpers.lightning_models import indexed_text

    folder = tmp_path / "sweep"
    fit("bert", cached(tmp_path, "sweep", cache_keep=True, cache_key="index"), module=with_head(1), train=indexed_text(),
        val=indexed_text(n=16, seed=7), freeze=AutoFreeze(schedule=EARLY), max_epochs=2)
    said = [w for w in recwarn if "cache_keep=True with cache_key='index'" in str(w.message)]
    assert len(said) == 1
    assert not any(f.kept for f in store_folders(folder))


def test_cache_keep_needs_a_cache_dir():
    with pytest.raises(ValueError, match="cache_keep=True needs cache_dir"):
        from lightning_pipetransformer import PipeTransformerStrategy

        PipeTransformerStrategy(cache=True, cache_keep=True)



def with_dropout(seed: int) -> Classifier:
    """A backbone with dropout 0.1 everywhere (the embeddings' too), the head initialised with ``seed``."""
    module = Classifier("bert")
    torch.manual_seed(0)
    module.model = tiny_bert(4, dropout=0.1)
    return with_head(seed, module)


def test_an_early_freeze_with_dropout_in_the_embeddings_is_served_and_equals_cache_off(tmp_path):
    # Before: when the first forward showed the call order, the cache checked the prefix before AutoFreeze had put the
    # embeddings in eval mode, and their dropout raised NondeterministicPrefixError at the first step.
    folder = tmp_path / "sweep"
    kept_fit(folder, with_dropout(1))
    stats = EpochStats()
    run = kept_fit(folder, with_dropout(2), stats)
    # The first step computes the prefix (the embeddings' dropout is on until the call order is known, as in a plain
    # run); every lookup after it hits.
    assert stats.epochs[0] == {"hits": LOOKUPS - 8, "misses": 0} and stats_of(run[1])["autocache/batches_bypassed"] == 1
    off = fit("bert", cached(tmp_path, "off", cache=False), module=with_dropout(2), freeze=AutoFreeze(schedule=EARLY),
              max_epochs=2)
    assert_same_run(run, off)
