"""The activation store: memory budget, disk spill read back bit-exact, sharing, safety of the files."""

from __future__ import annotations

import os
import pickle
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_pipetransformer.cache.keys import content_keys
from lightning_pipetransformer.cache.store import ActivationStore, CacheConfigError

FP = "0123456789abcdef0123456789abcdef"
ROW = (4, 8)  # one sample's activation: 32 fp32 = 128 bytes


def _batch(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[list[str], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    acts = torch.randn(n, *ROW, generator=g).to(dtype)
    return [f"s{seed}-{i}" for i in range(n)], acts


def test_memory_hits_are_exact_and_counted(tmp_path):
    store = ActivationStore(tmp_path, FP, 2, memory_budget=10_000)
    keys, acts = _batch(4)
    store.store(keys, acts)
    hit, hits = store.lookup(["nope", *keys[::-1]])
    assert hit.tolist() == [False, True, True, True, True]
    assert torch.equal(hits, acts.flip(0))
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.memory_hits, stats.disk_hits) == (4, 1, 4, 0)
    assert stats.bytes_on_disk == 0 and stats.bytes_in_memory == acts.nbytes
    assert stats.as_metrics()["autocache/hit_rate"] == pytest.approx(0.8)


def test_budget_is_never_exceeded_and_the_rest_spills_to_disk_bit_exact(tmp_path):
    per_row = 4 * 8 * 4
    budget = 5 * per_row + 17  # room for 5 rows
    store = ActivationStore(tmp_path, FP, 2, memory_budget=budget)
    all_keys, all_acts = [], []
    for seed in range(4):  # 4 batches of 3 rows
        keys, acts = _batch(3, seed)
        acts[0, 0, 0] = -0.0  # -0.0 and subnormals survive bit for bit
        acts[1, 0, 0] = 1e-40
        store.store(keys, acts)
        assert store.stats().bytes_in_memory <= budget
        all_keys += keys
        all_acts.append(acts)
    stats = store.stats()
    assert stats.entries_in_memory == 5 and stats.files_on_disk == 7
    hit, hits = store.lookup(all_keys)
    assert hit.all()
    expected = torch.cat(all_acts)
    assert torch.equal(hits.view(torch.int32), expected.view(torch.int32))
    assert store.stats().disk_hits == 7


def test_bf16_native_and_opt_in_lower_precision(tmp_path):
    keys, acts = _batch(3, dtype=torch.bfloat16)
    native = ActivationStore(tmp_path, FP, 1, memory_budget=0)  # disk only
    native.store(keys, acts)
    assert torch.equal(native.lookup(keys)[1], acts)
    keys, acts = _batch(3)
    low = ActivationStore(tmp_path, FP, 1, memory_budget=0, storage_dtype=torch.bfloat16)
    low.store(keys, acts)
    _, back = low.lookup(keys)
    assert back.dtype == torch.float32  # original dtype restored, values rounded
    torch.testing.assert_close(back, acts, rtol=1e-2, atol=1e-2)
    assert low.directory != native.directory  # never mixed with exact entries


def test_budget_below_one_batch_is_an_error(tmp_path):
    store = ActivationStore(tmp_path, FP, 2, memory_budget=100)
    keys, acts = _batch(3)
    with pytest.raises(CacheConfigError, match="smaller than one batch"):
        store.store(keys, acts)
    with pytest.raises(CacheConfigError, match="memory_budget"):
        ActivationStore(tmp_path, FP, 2, memory_budget=-1)


def test_unwritable_cache_dir_is_an_error_at_construction(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    # A path below a regular file cannot be created, even by root.
    with pytest.raises(CacheConfigError, match="not a writable directory"):
        ActivationStore(blocker / "cache", FP, 2, memory_budget=0)


def test_files_are_private_and_hold_no_pickle(tmp_path):
    cache_dir = tmp_path / "cache"
    store = ActivationStore(cache_dir, FP, 2, memory_budget=0)
    keys, acts = _batch(2)
    store.store(keys, acts)
    assert stat.S_IMODE(os.stat(cache_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.directory).st_mode) == 0o700
    files = list(store.directory.iterdir())
    assert len(files) == 2
    for f in files:
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
        data = f.read_bytes()
        assert b"\x80\x04" not in data[:2] and b"pickle" not in data  # safetensors: JSON header + raw bytes
        assert data[8:9] == b"{"


class _Bomb:
    def __reduce__(self):
        return (os.mkdir, (str(_Bomb.target),))


def test_a_pickle_bomb_in_the_directory_is_rejected_and_never_run(tmp_path):
    store = ActivationStore(tmp_path, FP, 2, memory_budget=0)
    _Bomb.target = tmp_path / "pwned"
    keys, acts = _batch(1)
    (store.directory / f"{keys[0]}.safetensors").write_bytes(pickle.dumps(_Bomb()))
    hit, hits = store.lookup(keys)
    assert not hit.any() and hits.shape[0] == 0
    assert not _Bomb.target.exists()
    assert store.stats().rejected == 1
    store.store(keys, acts)  # the bad file is overwritten, not trusted
    assert torch.equal(store.lookup(keys)[1], acts)


def test_entries_of_another_prefix_or_key_are_rejected(tmp_path):
    keys, acts = _batch(2)
    other = ActivationStore(tmp_path, "ffffffffffffffffffffffffffffffff", 2, memory_budget=0)
    other.store(keys, acts)
    store = ActivationStore(tmp_path, FP, 2, memory_budget=0)
    # Copy a file of another fingerprint in, and rename one entry to another key.
    (store.directory / f"{keys[0]}.safetensors").write_bytes((other.directory / f"{keys[0]}.safetensors").read_bytes())
    os.replace(other.directory / f"{keys[1]}.safetensors", other.directory / "renamed.safetensors")
    assert not store.lookup([keys[0]])[0].any()
    assert not other.lookup(["renamed"])[0].any()
    assert store.stats().rejected == 1 and other.stats().rejected == 1


def test_shape_mismatch_is_a_miss_and_bad_keys_are_refused(tmp_path):
    store = ActivationStore(tmp_path, FP, 2, memory_budget=10_000)
    keys, acts = _batch(2)
    store.store(keys, acts)
    hit, _ = store.lookup(keys, sample_shape=(5, 8))  # e.g. index keys with another padding
    assert not hit.any()
    with pytest.raises(ValueError, match="Invalid cache key"):
        store.lookup(["../../etc/passwd"])
    with pytest.raises(ValueError, match="one row per key"):
        store.store(keys, acts[:1])


_WRITER = textwrap.dedent(
    """
    import sys, types, torch
    # Import the pure core without the package's Lightning shell (10+ s on a busy CPU): a stub
    # parent package stops lightning_pipetransformer/__init__.py from running.
    stub = types.ModuleType("lightning_pipetransformer")
    stub.__path__ = [{pkg!r}]
    sys.modules["lightning_pipetransformer"] = stub
    from lightning_pipetransformer.cache.store import ActivationStore
    from lightning_pipetransformer.cache import advance  # noqa: F401  (the whole core is Lightning-free)
    assert "lightning" not in sys.modules and "lightning.pytorch" not in sys.modules
    cache_dir, seed = sys.argv[1], int(sys.argv[2])
    store = ActivationStore(cache_dir, "{fp}", 2, memory_budget=10**6, write_through=True)
    for rep in range(5):  # both writers write the same keys at the same time
        g = torch.Generator().manual_seed(0)
        acts = torch.randn(16, 4, 8, generator=g)
        store.store([f"k{{i}}" for i in range(16)], acts)
        store.close()  # forget memory, write again: exercises concurrent os.replace
    # Then read what the other process wrote.
    hit, hits = store.lookup([f"k{{i}}" for i in range(16)])
    assert hit.all(), hit
    print("ok", seed)
    """
).format(fp=FP, pkg=str(Path(__file__).resolve().parents[3] / "lightning_pipetransformer"))


@pytest.mark.distributed
def test_two_processes_share_one_cache_dir(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(s)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for s in range(2)
    ]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
    # A third reader (this process) sees every entry, bit-exact, and no temporary file is left.
    reader = ActivationStore(tmp_path, FP, 2, memory_budget=0)
    keys = [f"k{i}" for i in range(16)]
    hit, hits = reader.lookup(keys)
    assert hit.all()
    assert torch.equal(hits, torch.randn(16, 4, 8, generator=torch.Generator().manual_seed(0)))
    assert sorted(p.name for p in reader.directory.iterdir()) == sorted(f"{k}.safetensors" for k in keys)
    assert reader.stats().rejected == 0


def test_content_keys_store_round_trip_and_a_changed_input_misses(tmp_path):
    store = ActivationStore(tmp_path, FP, 2, memory_budget=0)
    ids = torch.randint(0, 100, (4, 6), generator=torch.Generator().manual_seed(0))
    keys = content_keys(ids)
    store.store(keys, torch.randn(4, *ROW))
    changed = ids.clone()
    changed[2, 5] += 1
    assert store.lookup(content_keys(changed))[0].tolist() == [True, True, False, True]


def test_bytes_reserved_by_another_store_count_against_the_budget(tmp_path):
    """Lazy advance: an earlier boundary's entries still in memory share the one budget with the new store's."""
    one = 4 * 8 * 4  # a [4, 8] fp32 activation
    store = ActivationStore(tmp_path, FP, 2, memory_budget=4 * one)
    store.reserve(3 * one)
    store.store(["a", "b"], torch.randn(2, 4, 8), check_fits=False)
    assert store.in_memory("a") and not store.in_memory("b") and store.on_disk("b")
    assert store.bytes_in_memory == one
    store.reserve(0)
    store.store(["c", "d"], torch.randn(2, 4, 8), check_fits=False)
    assert store.in_memory("c") and store.in_memory("d") and store.bytes_in_memory == 3 * one


def test_a_listener_hears_each_reason_once_per_store(tmp_path):
    # Whoever listens (AutoCache, a direct user): a batch of NaN rows, then another, is one warning.
    heard: list[str] = []
    store = ActivationStore(tmp_path, FP, 1, memory_budget=10**6, warn=lambda r, m: heard.append(r))
    bad = torch.full((3, 4), float("nan"))
    store.store(["a", "b", "c"], bad)
    store.store(["d", "e"], bad[:2])
    assert heard == ["nonfinite"] and store.stats().nonfinite == 5


def _scan(directory: Path) -> tuple[int, int]:
    """(files, bytes) of the entry files in ``directory``, read afresh."""
    if not directory.exists():
        return 0, 0
    files = [p for p in directory.iterdir() if p.name.endswith(".safetensors")]
    return len(files), sum(p.stat().st_size for p in files)


def test_the_disk_figures_are_counters_that_follow_the_folder_without_walking_it(tmp_path, monkeypatch):
    """stats() is read every step (the progress bar): it touches no file. Its disk figures are kept as the
    store writes, reads, meets another store's files or finds one gone, and equal a fresh scan."""
    first = ActivationStore(tmp_path, FP, 2, memory_budget=0)
    keys, acts = _batch(6)
    first.store(keys[:3], acts[:3])
    second = ActivationStore(tmp_path, FP, 2, memory_budget=0)  # opened now: counts the 3 files already there
    first.store(keys[3:], acts[3:])
    touched: list[str] = []
    for name in ("scandir", "listdir", "stat"):
        monkeypatch.setattr(os, name, lambda *a, _f=getattr(os, name), _n=name, **k: touched.append(_n) or _f(*a, **k))
    figures = {s: (s.stats().files_on_disk, s.stats().bytes_on_disk) for s in (first, second)}
    assert touched == []
    monkeypatch.undo()
    assert figures[first] == _scan(first.directory) and figures[first][0] == 6
    # The other store knew the 3 files of its open; it counts the rest as it meets them.
    assert figures[second] == (3, figures[first][1] // 2)
    assert second.lookup(keys)[0].all()
    assert (second.stats().files_on_disk, second.stats().bytes_on_disk) == _scan(second.directory)
    # A file removed from outside: the read that misses it counts it gone.
    os.unlink(second.directory / f"{keys[0]}.safetensors")
    assert not second.lookup(keys[:1])[0].any()
    assert (second.stats().files_on_disk, second.stats().bytes_on_disk) == _scan(second.directory) == (5, figures[first][1] * 5 // 6)
    # The directory deleted by the last store to let go: nothing left on disk.
    assert not first.close(delete=True)  # the second still holds it
    assert second.close(delete=True) and _scan(second.directory) == (0, 0)
    assert (second.stats().files_on_disk, second.stats().bytes_on_disk) == (0, 0)
