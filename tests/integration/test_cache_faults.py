"""AutoCache under faults: nothing silently wrong, and no crash where recomputing is possible (issue #19).

Each fault is injected into a real run (or a store) and the run is compared with the same run
without a cache; where the cache should still serve, the test asserts that it did (hits > 0).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipetransformer.cache.autocache import AutoCache
from lightning_pipetransformer.cache.cached_stack import CachedStack
from lightning_pipetransformer.cache.prefix import StaleCacheError, run_blocks
from lightning_pipetransformer.cache.store import ActivationStore
from lightning_pipetransformer.freeze.apply import apply_freeze
from lightning_pipetransformer.stack.discovery import find_block_stack
from lightning_pipetransformer.stack.interception import install_pipeline, remove_pipeline
from tests.helpers.cached_fits import assert_same_run, cached, fit, stats_of
from tests.helpers.lightning_models import Classifier, IndexedSamples, _ids, _images, indexed_text
from tests.helpers.models import SEQ, VOCAB, tiny_bert
from tests.helpers.trainers import cpu_trainer

FP = "0123456789abcdef0123456789abcdef"


def overwrite_tensor_bytes(path: Path, name: str = "hidden") -> None:
    """Zero one tensor's bytes in a safetensors file; the header (with its metadata) stays as it was."""
    data = bytearray(path.read_bytes())
    size = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8 : 8 + size])[name]["data_offsets"]
    base = 8 + size
    data[base + start : base + end] = bytes(end - start)
    path.write_bytes(bytes(data))


def entry_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.safetensors"))


# ---------------------------------------------------------------------------- 1. corrupted bytes


def test_overwritten_bytes_under_an_intact_header_are_a_miss_and_rewritten(tmp_path):
    store = ActivationStore(tmp_path, FP, 2, memory_budget=0)
    keys = ["a", "b", "c"]
    acts = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 1, 4, 4, dtype=torch.bool)
    store.store(keys, acts, {"t.b2.a0": mask})
    overwrite_tensor_bytes(store.directory / "b.safetensors")
    overwrite_tensor_bytes(store.directory / "c.safetensors", "x.t.b2.a0")  # a stored block input
    hit, hits = store.lookup(keys)
    assert hit.tolist() == [True, False, True]  # c's activation is intact: its lookup reads only that
    assert torch.equal(hits, acts[[0, 2]])
    assert store.read("c") is None  # the advance reads the block inputs too: corrupt, never returned
    assert store.stats().corrupt == 2 and store.stats().rejected == 0
    store.store(keys, acts, {"t.b2.a0": mask})  # the corrupt files are rewritten, not trusted
    hit, hits = store.lookup(keys)
    assert hit.all() and torch.equal(hits, acts)
    assert torch.equal(store.read("c").extras["t.b2.a0"], mask[2])


class CorruptEveryFile(Callback):
    """At the start of ``epoch``, zero the activation bytes of every entry on disk at ``boundary`` (headers intact)."""

    def __init__(self, root: Path, epoch: int, boundary: int = 3) -> None:
        self.root, self.epoch, self.boundary, self.corrupted = root, epoch, boundary, 0

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            for path in entry_files(self.root):
                if f"-b{self.boundary}-" not in path.parent.name:
                    continue  # the earlier boundary's files (read for a lazy advance) are another test
                overwrite_tensor_bytes(path)
                self.corrupted += 1


def test_corrupted_entries_are_recomputed_and_the_run_equals_cache_off(tmp_path):
    # Before: the zeroed activations were served in epoch 3 (the first-hit check ran in epoch 2).
    corrupt = CorruptEveryFile(tmp_path / "cache", epoch=3)
    run = fit("bert", cached(tmp_path, cache_memory=0), callbacks=[corrupt])
    assert corrupt.corrupted == 24 + 16
    assert_same_run(run, fit("bert", "auto"))
    stats = stats_of(run[1])
    assert stats["autocache/corrupt"] == 24 + 16  # epoch 3: every lookup at boundary 3 found a corrupt file ...
    # ... and was served by advancing boundary 1's intact entry again (epoch 2 by advancing it the first time).
    assert stats["autocache/hits"] == 2 * (24 + 16) and stats["autocache/advanced"] == 2 * (24 + 16)


# ---------------------------------------------------------------------------- 2. index keys that are not unique


class ModuloIndex(IndexedSamples):
    """Samples whose 'index' is ``i % modulo``: several samples share one index."""

    def __init__(self, modulo: int) -> None:
        super().__init__(*_ids(24, 0))
        self.modulo = modulo

    def __getitem__(self, index: int) -> dict:
        return {**super().__getitem__(index), "index": index % self.modulo}


@pytest.mark.parametrize(
    "modulo, words",
    [(4, "batch 0 of the train0 loader holds dataset index\\(es\\) \\[0, 1, 2, 3\\] more than once"),
     (8, "batch 1 of the train0 loader holds dataset index\\(es\\) \\[0, 1, 2, 3, 4\\], already seen earlier")],
    ids=["within-a-batch", "across-a-pass"],
)
def test_repeated_index_keys_are_refused_at_the_first_steps(tmp_path, modulo, words):
    # Before: 64 hits served from 8 entries, one sample's activations for another's.
    trainer = cpu_trainer(cached(tmp_path, cache_key="index"), max_epochs=4)
    with pytest.raises(ValueError, match=words) as err:
        trainer.fit(Classifier("bert"), DataLoader(ModuloIndex(modulo), batch_size=8))
    assert "cache_key='content'" in str(err.value)
    assert trainer.global_step == modulo // 8  # the first batch that repeats one


def test_set_batch_resets_at_each_pass_and_per_loader(tmp_path):
    cache = AutoCache(True, str(tmp_path), 0, key="index")
    batch = {"index": torch.arange(4)}
    for _ in range(3):  # validation three times in one training epoch: each run starts at batch 0
        cache.set_batch(batch, "val0", 0)
        cache.set_batch({"index": torch.arange(4, 8)}, "val0", 1)
    cache.set_batch(batch, "train0", 0)  # another loader: its own pass
    cache.set_batch(batch, "val1", 0)
    with pytest.raises(ValueError, match="already seen earlier in this pass"):
        cache.set_batch(batch, "train0", 1)
    with pytest.raises(ValueError, match="more than once"):
        cache.set_batch({"index": [3, 3]}, "test0")  # without batch_idx: the batch alone is checked


def test_index_keys_with_validation_several_times_per_epoch_equal_cache_off(tmp_path):
    # The pass check must restart with each validation run (batch_idx 0), or this would be refused.
    def data():
        return dict(train=indexed_text(), val=indexed_text(n=16, seed=7))

    run = fit("bert", cached(tmp_path, cache_key="index"), val_check_interval=1, **data())
    assert len(run[2]) == 3 * 4
    assert stats_of(run[1])["autocache/hits"] >= 2 * (24 + 3 * 16)
    assert_same_run(run, fit("bert", "auto", val_check_interval=1, **data()))


# ---------------------------------------------------------------------------- 3. non-finite activations


def test_non_finite_activations_are_never_stored(tmp_path):
    store = ActivationStore(tmp_path, FP, 1, memory_budget=10**6)
    acts = torch.randn(4, 4, 8, generator=torch.Generator().manual_seed(0))
    acts[1, 2, 3] = float("nan")
    acts[2, 0, 0] = float("inf")
    with pytest.warns(UserWarning, match="non-finite"):
        store.store(["a", "b", "c", "d"], acts)
    hit, hits = store.lookup(["a", "b", "c", "d"])
    assert hit.tolist() == [True, False, False, True] and torch.equal(hits, acts[[0, 3]])
    stats = store.stats()
    assert (stats.nonfinite, stats.stored) == (2, 2)
    # A finite fp32 value that overflows the lossy fp16 storage is non-finite there: not stored either.
    half = ActivationStore(tmp_path, FP, 1, memory_budget=10**6, storage_dtype=torch.float16, warn=lambda r, m: None)
    big = torch.ones(2, 3)
    big[0, 0] = 1e6
    half.store(["x", "y"], big)
    assert half.lookup(["x", "y"])[0].tolist() == [False, True] and half.stats().nonfinite == 1


class NanOnce(IndexedSamples):
    """Images with their index; sample ``at`` reads as NaN on its ``read``-th read only (a transient fault)."""

    def __init__(self, n: int, seed: int, at: int, read: int) -> None:
        super().__init__(*_images(n, seed))
        self.at, self.read, self.reads = at, read, 0

    def __getitem__(self, index: int) -> dict:
        sample = super().__getitem__(index)
        if index == self.at:
            self.reads += 1
            if self.reads == self.read:
                sample["x"] = torch.full_like(sample["x"], float("nan"))
        return sample


class NonFiniteSeen(Callback):
    def __init__(self) -> None:
        self.nonfinite = 0.0

    def on_validation_end(self, trainer, pl_module):
        stats = trainer.strategy.cache_stats or {}
        self.nonfinite = max(self.nonfinite, stats.get("autocache/nonfinite", 0.0))


def test_a_transient_nan_is_not_replayed_under_index_keys(tmp_path):
    # Validation sample 3 reads as NaN once, in epoch 1 (boundary 1, when it is stored). Before: its
    # entry (index 3) held NaN and was replayed in every later validation (index keys skip the
    # first-hit check); without a cache, epochs 2-3 see the real image again.
    def data():
        train = DataLoader(IndexedSamples(*_images(24, 0)), batch_size=8)
        return dict(train=train, val=DataLoader(NanOnce(16, 7, at=3, read=2), batch_size=8))

    seen = NonFiniteSeen()
    module, trainer, losses = fit("vit", cached(tmp_path, cache_key="index"), callbacks=[seen], **data())
    plain = fit("vit", "auto", **data())
    assert torch.isnan(torch.tensor(losses[1])) and torch.isnan(torch.tensor(plain[2][1]))
    assert [losses[0], *losses[2:]] == pytest.approx([plain[2][0], *plain[2][2:]], rel=1e-5)
    assert_same_run((module, trainer, losses[2:]), (plain[0], plain[1], plain[2][2:]))
    assert seen.nonfinite >= 1
    assert stats_of(trainer)["autocache/hits"] >= 2 * (24 + 16) - 2  # epochs 2-3; sample 3 misses once


# ---------------------------------------------------------------------------- 6. NaN inputs with content keys


def test_first_hit_check_treats_the_same_nan_as_equal(tmp_path):
    cache = AutoCache(True, str(tmp_path), 0)
    hidden = torch.randn(3, 2, 4)
    hidden[1, 0, 0] = float("nan")
    prefix = lambda h, calls: h * 2  # noqa: E731
    boundary = prefix(hidden, [])
    hit = torch.ones(3, dtype=torch.bool)
    cache.after_hits(lambda m: hidden[m], [], hit, boundary, prefix, 0.0, 3)  # before: StaleCacheError
    cache.first_hit.reset()
    stale = boundary.clone()
    stale[2] += 1
    with pytest.raises(StaleCacheError):
        cache.after_hits(lambda m: hidden[m], [], hit, stale, prefix, 0.0, 3)


class FiniteRowsLoss(Classifier):
    """Validation loss over the samples whose logits are finite: one NaN image does not hide the rest."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        finite = torch.isfinite(logits).all(dim=1)
        self.log("val_loss", torch.nn.functional.cross_entropy(logits[finite], y[finite]))


def test_nan_input_with_content_keys_equals_cache_off(tmp_path):
    # Validation image 2 has a NaN pixel. Before: its NaN activation was stored, and validate after
    # fit (a new store: its first hits are checked again) raised StaleCacheError on it.
    def val() -> DataLoader:
        x, y = _images(16, 7)
        x[2, 0, 1, 1] = float("nan")
        return DataLoader(TensorDataset(x, y), batch_size=8)

    run = fit("vit", cached(tmp_path, cache_memory=0), module=FiniteRowsLoss("vit"), val=val())
    plain = fit("vit", "auto", module=FiniteRowsLoss("vit"), val=val())
    assert_same_run(run, plain)
    got = run[1].validate(run[0], val(), verbose=False)[0]["val_loss"]
    assert got == pytest.approx(plain[1].validate(plain[0], val(), verbose=False)[0]["val_loss"], rel=1e-5)
    stats = run[1].strategy.cache_stats_by_stage["validate"]  # that call's own counts (the fit's cache goes on)
    assert stats["autocache/hits"] == 15 and stats["autocache/misses"] == 1 and stats["autocache/nonfinite"] == 1


# ---------------------------------------------------------------------------- 4. a removed directory


class RemoveDirectory(Callback):
    """Delete the whole cache_dir at the start of ``epoch``, after the boundary moved (a cleaner, a user)."""

    def __init__(self, root: Path, epoch: int) -> None:
        self.root, self.epoch = root, epoch

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            shutil.rmtree(self.root)


def test_cache_dir_removed_between_epochs_is_recreated(tmp_path, recwarn):
    # Before: FileNotFoundError on a temporary file at the first store of epoch 2.
    root = tmp_path / "cache"
    run = fit("bert", cached(tmp_path, cache_memory=0), callbacks=[RemoveDirectory(root, epoch=2)])
    stats = stats_of(run[1])
    assert stats["autocache/recreated"] == 1
    assert stats["autocache/hits"] == 24 + 16  # epoch 3, from the entries epoch 2 wrote again
    assert stats["autocache/files_on_disk"] == 24 + 16
    assert len([w for w in recwarn if "was removed while in use" in str(w.message)]) == 1
    assert_same_run(run, fit("bert", "auto"))


# ---------------------------------------------------------------------------- 5. two runs sharing a directory


def batch(seed: int, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[::2, -3:] = 0
    return ids, mask


def install(model: torch.nn.Module, cache: AutoCache, num_frozen: int):
    stack = find_block_stack(model)
    remove_pipeline(stack.container)
    apply_freeze(stack, num_frozen, include_pre=True)
    cache.attach(stack, model)
    cache.move_boundary(stack, num_frozen, True, torch.device("cpu"), (0, 1))
    active = run_blocks(stack.blocks[num_frozen:])
    install_pipeline(stack.container, CachedStack(cache, stack.blocks, num_frozen, lambda call: active(call.hidden, call.calls)))
    return stack


def logits(model: torch.nn.Module, seed: int) -> torch.Tensor:
    ids, mask = batch(seed)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def test_a_boundary_advance_keeps_the_directory_another_run_still_uses(tmp_path):
    # Two runs, same frozen weights, one cache_dir (disk only): the fast one advances 1 -> 3 while
    # the slow one still stores at boundary 1. Before: the advance deleted the directory under the
    # slow run, whose next store raised FileNotFoundError.
    torch.manual_seed(0)
    reference = tiny_bert(4).eval()
    fast, slow = tiny_bert(4).eval(), tiny_bert(4).eval()
    fast.load_state_dict(reference.state_dict())
    slow.load_state_dict(reference.state_dict())
    fast_cache, slow_cache = AutoCache(True, str(tmp_path), 0), AutoCache(True, str(tmp_path), 0)
    install(fast, fast_cache, 1)
    install(slow, slow_cache, 1)
    shared = slow_cache.store.directory
    assert fast_cache.store.directory == shared
    for model in (fast, slow):
        logits(model, 0)  # the fast run stores batch 0 at boundary 1, the slow one finds it there
    assert slow_cache.store.stats().hits == 6
    install(fast, fast_cache, 3)  # advance, then try to delete boundary 1: the slow run holds it
    assert fast_cache.advanced == 6 and shared.is_dir()
    for seed in (1, 0):  # the slow run stores batch 1 and is served batch 0, at boundary 1
        torch.testing.assert_close(logits(slow, seed), logits(reference, seed), rtol=1e-5, atol=1e-6)
    assert slow_cache.store.stats().hits == 12 and slow_cache.store.stats().files_on_disk == 12
    install(slow, slow_cache, 3)  # the last user of boundary 1 advances and deletes it
    assert not shared.exists()
    for model in (fast, slow):
        torch.testing.assert_close(logits(model, 1), logits(reference, 1), rtol=1e-5, atol=1e-6)
    assert fast_cache.store.stats().hits == 6  # batch 1: advanced by the slow run into the shared boundary 3


def test_a_forked_child_does_not_keep_the_directory_locked(tmp_path):
    # DataLoader workers are forked: their copy of the lock must not stop the parent from deleting.
    store = ActivationStore(tmp_path, FP, 1, memory_budget=0)
    store.store(["a"], torch.ones(1, 2))
    to_parent, to_child = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # the child (its at-fork handlers have run) says so, waits for the parent's try, exits
        os.write(to_parent[1], b"r")
        os.read(to_child[0], 1)
        os._exit(0)
    try:
        assert os.read(to_parent[0], 1) == b"r"
        assert store.close(delete=True) and not store.directory.exists()
    finally:
        os.write(to_child[1], b"x")
        os.waitpid(pid, 0)
        for fd in (*to_parent, *to_child):
            os.close(fd)


# ---------------------------------------------------------------------------- full disk


def fill_disk_after(monkeypatch, root: Path, writes: int) -> dict[str, int]:
    """From the ``writes + 1``-th entry file under ``root`` on, writes fail half-way with ENOSPC."""
    real_fdopen = os.fdopen
    count = {"ok": 0, "failed": 0}

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[: len(data) // 2])  # a partial file is left for the store to clean up
            count["failed"] += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def fdopen(fd, *args, **kwargs):
        f = real_fdopen(fd, *args, **kwargs)
        target = os.readlink(f"/proc/self/fd/{fd}")
        if not (target.startswith(str(root)) and target.endswith(".tmp")):
            return f
        if count["ok"] < writes:
            count["ok"] += 1
            return f
        return Full(f)

    monkeypatch.setattr(os, "fdopen", fdopen)
    return count


def test_a_full_disk_falls_back_to_recomputing_with_one_warning(tmp_path, monkeypatch, recwarn):
    # Before: a raw OSError out of the first write that did not fit. Here epoch 1 writes its 40
    # entries, the advance to boundary 3 writes 20 of them, then the disk is full.
    root = tmp_path / "cache"
    count = fill_disk_after(monkeypatch, root, writes=40 + 20)
    run = fit("bert", cached(tmp_path, cache_memory=0))
    stats = stats_of(run[1])
    assert count["failed"] == 1  # disk writes stop at the first failure
    # Epoch 2 reads every entry at boundary 1 and advances it to 3 (lazily, as each batch comes): 20 are
    # written, then the disk is full and 20 are not. Epoch 3 hits the 20 files and advances the other
    # 20 again from boundary 1's files (cheaper than recomputing them, still exact), unwritten again.
    assert stats["autocache/hits"] == 2 * 40 and stats["autocache/misses"] == 0
    assert stats["autocache/advanced"] == 40 + 20 and stats["autocache/unwritten"] == 20 + 20
    assert stats["autocache/files_on_disk"] == 20
    assert not list(root.rglob("*.tmp"))
    assert len([w for w in recwarn if "AutoCache stopped writing" in str(w.message)]) == 1
    monkeypatch.undo()
    assert_same_run(run, fit("bert", "auto"))


def test_a_full_disk_at_a_new_boundary_keeps_to_memory(tmp_path, monkeypatch):
    # The directory of a new boundary cannot even be made: the store keeps to its memory budget.
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self.name.endswith("-b2-native"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.warns(UserWarning, match="stopped writing"):
        store = ActivationStore(tmp_path, FP, 2, memory_budget=2 * 32 * 4)
    acts = torch.randn(3, 4, 8)
    store.store(["a", "b", "c"], acts, check_fits=False)
    hit, hits = store.lookup(["a", "b", "c"])
    assert hit.tolist() == [True, True, False] and torch.equal(hits, acts[:2])
    assert store.stats().unwritten == 1 and not store.directory.exists()


# ---------------------------------------------------------------------------- a disk that fails mid-run


class DiskFailsAfter(Callback):
    """From the end of ``epoch`` on, ``root`` refuses every new directory and file (``errno_``): the
    filesystem remounted read-only, its permissions changed, or an I/O error. chmod would not stop
    root, so ``Path.mkdir`` and ``os.open`` are made to refuse, as the kernel would."""

    def __init__(self, monkeypatch, root: Path, epoch: int, errno_: int) -> None:
        self.root, self.epoch, self.errno, self.failing, self.refused = str(root), epoch, errno_, False, 0
        real_mkdir, real_open = Path.mkdir, os.open

        def refuse(path) -> None:
            if self.failing and str(path).startswith(self.root):
                self.refused += 1
                raise OSError(self.errno, os.strerror(self.errno), str(path))

        def mkdir(path, *args, **kwargs):
            refuse(path)
            return real_mkdir(path, *args, **kwargs)

        def open_(path, flags, *args, **kwargs):
            if flags & os.O_CREAT:
                refuse(path)
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", mkdir)
        monkeypatch.setattr(os, "open", open_)

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            self.failing = True


@pytest.mark.parametrize("errno_", [errno.EROFS, errno.EACCES, errno.EIO])
def test_a_disk_failing_between_two_freezes_stops_disk_writes_never_training(tmp_path, monkeypatch, recwarn, errno_):
    # Before: every rank crashed at the next freeze with CacheConfigError (the boundary's directory
    # could not be made), though writes refused mid-boundary only stopped disk writes.
    root = tmp_path / "cache"
    failing = DiskFailsAfter(monkeypatch, root, epoch=1, errno_=errno_)
    run = fit("bert", cached(tmp_path), callbacks=[failing])
    stats = stats_of(run[1])
    assert failing.refused >= 1  # the fault was injected
    assert stats["autocache/boundary"] == 3 and stats["autocache/disk_failures"] == 1  # counted in the metrics
    assert stats["autocache/hits"] > 0  # memory keeps serving at the new boundary
    assert stats["autocache/files_on_disk"] == 0
    warned = [str(w.message) for w in recwarn if "AutoCache stopped writing" in str(w.message)]
    assert len(warned) == 1 and os.strerror(errno_) in warned[0]  # once, with the cause
    monkeypatch.undo()
    assert_same_run(run, fit("bert", "auto"))
