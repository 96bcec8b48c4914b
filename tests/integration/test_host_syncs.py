"""No host synchronisation in a steady-state step of the strategy's own code (issue 31).

On CPU nothing synchronises, so the rule is checked by what would: every call that makes the
host wait for a GPU tensor (``.item()``, ``.tolist()``, ``.cpu()``, ``bool()``/``int()``/``float()``
of a tensor, ``nonzero``, ``.numpy()``), and every tensor made from host data, counted by a
``TorchFunctionMode`` around the strategy's per-batch hook (the progress bar) and the pipeline's
pass (the runner, the executor and the blocks), from the third step on. ``torch.tensor(v)`` of host
data without a device is no sync (it stays on the CPU); with ``device=`` it is a copy to the GPU.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from lightning_pipetransformer import PipeTransformerStrategy, runners
from tests.helpers.lightning_models import Classifier, data_for
from tests.helpers.trainers import cpu_trainer

SYNCING = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.nonzero, torch.nonzero,
    torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
}


class SyncCounter(TorchFunctionMode):
    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCING:
            self.seen.append(getattr(func, "__name__", str(func)))
        elif func is torch.tensor and (kwargs or {}).get("device") is not None:
            # Host data placed on the module's device (Lightning's logging of a Python number): a
            # synchronising copy from pageable memory on a GPU. A CPU tensor (no device) is none.
            self.seen.append("tensor(device=...)")
        return func(*args, **(kwargs or {}))


def test_a_steady_state_pipelined_step_makes_the_host_wait_for_nothing(monkeypatch):
    seen: list[str] = []
    steps = {"n": 0}
    strategy = PipeTransformerStrategy(pipe_len=2, chunks=2)

    def counted(method):
        def wrapper(*args, **kwargs):
            if steps["n"] < 2:
                return method(*args, **kwargs)
            with SyncCounter(seen):
                return method(*args, **kwargs)
        return wrapper

    run = runners.ReturnTo.run
    counted_passes = []

    def counted_run(self, call):
        counted_passes.append(steps["n"] >= 2)
        return counted(run)(self, call)

    monkeypatch.setattr(runners.ReturnTo, "run", counted_run)
    batch_start = strategy.on_train_batch_start

    def on_train_batch_start(batch, batch_idx):
        steps["n"] = batch_idx
        return counted(batch_start)(batch, batch_idx)

    strategy.on_train_batch_start = on_train_batch_start
    trainer = cpu_trainer(strategy, max_epochs=1)
    trainer.fit(Classifier("bert"), data_for("bert", n=48))
    assert trainer.global_step == 6 and sum(counted_passes) == 4  # the pipeline ran the steps counted
    assert seen == [], seen


def _cached_bert(tmp_path, key: str):
    """A tiny BERT with AutoCache installed over its first 2 of 3 blocks (the cache's unit-test set-up)."""
    from lightning_pipetransformer.cache.autocache import AutoCache
    from tests.helpers.models import tiny_bert
    from tests.unit.cache.test_autocache import install

    torch.manual_seed(0)
    model = tiny_bert(3)
    cache = AutoCache(True, str(tmp_path), 10**7, key=key)
    install(model, cache, 2)
    return model, cache


def _count_cached_passes(monkeypatch) -> list[list[str]]:
    """From now on, the host waits of each cached stack's pass (keys, lookup, misses, merge), one list a pass."""
    from lightning_pipetransformer.cache.cached_stack import CachedStack

    counts: list[list[str]] = []
    run = CachedStack.run

    def counted(self, call):
        seen: list[str] = []
        counts.append(seen)
        with SyncCounter(seen):
            return run(self, call)

    monkeypatch.setattr(CachedStack, "run", counted)
    return counts


def _counted_cached_steps(monkeypatch, model, cache, batches, indices=None):
    """The host waits counted in the cached stack's pass of each batch."""
    counts = _count_cached_passes(monkeypatch)
    for i, (ids, mask) in enumerate(batches):
        if indices is not None:
            cache.set_batch({"index": indices[i]}, "train0", i)
        model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    return counts


def test_a_served_cached_step_reads_only_its_keys_back(tmp_path, monkeypatch):
    """Content keys: a batch the store answers in full waits for the host once, to read its keys
    (the store is a host dictionary keyed by them: ``.cpu()``, then a ``.tolist()`` of that host
    copy); the hit mask is host data read once (``tolist``). A batch with misses adds what running
    them needs; none of it may creep into the served step."""
    from tests.unit.cache.test_autocache import batch

    model, cache = _cached_bert(tmp_path, "content")
    first, second = batch(0), batch(1)
    mixed = tuple(torch.cat([a[:3], b[3:]]) for a, b in zip(first, batch(2)))
    counts = _counted_cached_steps(monkeypatch, model, cache, [first, second, first, second, mixed])
    assert cache.store.stats().hits == 6 + 6 + 3  # engaged: batches 3 and 4 served in full, 3 rows of the last
    served = counts[3]  # the first hit's one-off check ran at batch 3 (counts[2])
    assert served == ["cpu", "tolist", "tolist"], served
    assert len(counts[4]) > len(served)  # misses cost more (their rows run, are checked finite, stored, merged)


def test_a_served_cached_step_with_index_keys_reads_its_indices_once(tmp_path, monkeypatch):
    """Index keys: the batch's indices are read once (they name the entries), then the blocks'
    arguments hashed into the keys once (a changed mask must miss); nothing else."""
    from tests.unit.cache.test_autocache import batch

    model, cache = _cached_bert(tmp_path, "index")
    ids, mask = batch(0)
    counts = _count_cached_passes(monkeypatch)
    for _ in range(3):
        given: list[str] = []
        with SyncCounter(given):
            cache.set_batch({"index": torch.arange(6)}, "train0", None)
        model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert cache.store.stats().hits == 12  # engaged: the second and third batches were served
    assert given == ["tolist"], given
    assert counts[-1] == ["cpu", "tolist", "tolist"], counts[-1]
