"""No host synchronisation in a steady-state step of the strategy's own code (issue 31).

On CPU nothing synchronises, so the rule is checked by what would: every call that makes the
host wait for a GPU tensor (``.item()``, ``.tolist()``, ``.cpu()``, ``bool()``/``int()``/``float()``
of a tensor, ``nonzero``, ``.numpy()``), and every tensor made from host data, counted by a
``TorchFunctionMode`` around the strategy's per-batch hook (the progress bar) and the pipeline's
pass (the runner, the executor and the blocks), from the third step on. ``torch.tensor(v)`` of host
data without a device is no sync (it stays on the CPU); with ``device=`` it is a copy to the GPU.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
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


class OnDevice(TorchFunctionMode):
    """The host waits a GPU would make: reads of tensors that would live on it, on a CPU machine.

    ``roots`` stand for what is on the GPU (the batch's device copy, the model's parameters);
    every tensor an op computes from one of them is on the GPU too. A read (``.cpu()``,
    ``.tolist()``, ...) of such a tensor is counted; a read of host data (the loader's own tensor,
    the store's hit mask) is not: it makes no wait. Not modelled: the store's entries copied to
    the device (``.to`` a CPU target here); nothing reads them in a served step.
    """

    def __init__(self, seen: list[str], *roots: object) -> None:
        super().__init__()
        self.seen = seen
        self._on: dict[int, weakref.ref] = {}
        for root in roots:
            if isinstance(root, torch.Tensor):
                self._tag(root)

    def _tag(self, tensor: torch.Tensor) -> None:
        self._on[id(tensor)] = weakref.ref(tensor)

    def as_host(self, tensor: torch.Tensor) -> None:
        """``tensor`` is host memory (a pinned buffer the device copied into, read after its event)."""
        self._on.pop(id(tensor), None)

    def holds(self, tensor: object) -> bool:
        ref = self._on.get(id(tensor))
        return isinstance(tensor, torch.Tensor) and ref is not None and ref() is tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and self.holds(args[0]) and _bool_index(args[1]):
            # Rows picked by a bool mask: the GPU counts them and the host reads the count to size the result.
            self.seen.append(f"{func.__name__} by a bool mask")
        if func in SYNCING and args and self.holds(args[0]):
            self.seen.append(getattr(func, "__name__", str(func)))
            out = func(*args, **kwargs)
            # What a read returns is host data: on a GPU ``.cpu()`` makes a new tensor, here it returns itself.
            return out.clone() if out is args[0] else out
        out = func(*args, **kwargs)
        if any(self.holds(t) for t in pytree.tree_leaves((args, kwargs))):
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._tag(t)
        return out


def _bool_index(index: object) -> bool:
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in pytree.tree_leaves(index))


def _count_cached_passes(monkeypatch, model) -> tuple[list[list[str]], list[torch.Tensor]]:
    """From now on, the host waits of each cached stack's pass (keys, lookup, misses, merge), one list a
    pass, counted by :class:`OnDevice`; the second list takes the tensors that stand for the device
    copy of the next batch (with the model's parameters and buffers)."""
    from lightning_pipetransformer.cache import store
    from lightning_pipetransformer.cache.cached_stack import CachedStack

    counts: list[list[str]] = []
    on_device: list[torch.Tensor] = []
    run, start_host_copy = CachedStack.run, store.start_host_copy
    modes: list[OnDevice] = []

    def counted(self, call):
        seen: list[str] = []
        counts.append(seen)
        with OnDevice(seen, call.hidden, *pytree.tree_leaves(call.calls), *model.parameters(), *model.buffers(), *on_device) as mode:
            modes[:] = [mode]
            return run(self, call)

    def to_host(*args, **kwargs):  # what the misses' copy fills is host memory (cache/host_copy.py): reading it waits for no GPU
        copy = start_host_copy(*args, **kwargs)
        if modes:
            for t in (copy._hidden, *copy._extras.values()):
                modes[0].as_host(t)
        return copy

    monkeypatch.setattr(CachedStack, "run", counted)
    monkeypatch.setattr(store, "start_host_copy", to_host)
    return counts, on_device


def _device_copy(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What ``batch_to_device`` makes of the loader's tensors: new tensors (here on the CPU too)."""
    return tuple(t.clone() for t in tensors)


def test_a_served_cached_step_waits_once_for_its_content_keys(tmp_path, monkeypatch):
    """Content keys: a batch the store answers in full waits for the device once, to read its keys
    (the store is a host dictionary keyed by them, and they fingerprint what the model computed
    on the device: its 4-D attention mask); the hit mask is host data. A batch with misses adds
    what running them needs; none of it may creep into the served step."""
    from tests.unit.cache.test_autocache import batch

    model, cache = _cached_bert(tmp_path, "content")
    counts, on_device = _count_cached_passes(monkeypatch, model)
    first, second = batch(0), batch(1)
    mixed = tuple(torch.cat([a[:3], b[3:]]) for a, b in zip(first, batch(2)))
    for host in [first, second, first, second, mixed]:
        ids, mask = _device_copy(*host)
        on_device[:] = [ids, mask]
        model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert cache.store.stats().hits == 6 + 6 + 3  # engaged: batches 3 and 4 served in full, 3 rows of the last
    served = counts[3]  # the first hit's one-off check ran at batch 3 (counts[2])
    assert served == ["cpu"], served
    # Misses: their rows run, leave the device without a wait, are checked finite on the host and merged by index;
    # the keys' one read is all (bool-mask indexing of device rows, a count read back per use, is gone: cache/rows.py).
    assert counts[4] == ["cpu"], counts[4]


def _index_steps(tmp_path, monkeypatch, with_mask: bool) -> tuple[list[list[str]], list[list[str]], Any]:
    """Steps of one batch with index keys, as the strategy hands them over: the loader's batch remembered before its
    device copy; the host waits of each ``set_batch`` and each cached pass. The first stores (and keeps the rows'
    content keys, one read); the next :data:`~lightning_pipetransformer.cache.indices.FORWARD_PROBES` are a pass's
    probed forwards (one read each: what reaches the model against what was stored); the last ones are the steady
    state."""
    from lightning_pipetransformer.cache.indices import FORWARD_PROBES
    from tests.unit.cache.test_autocache import batch

    model, cache = _cached_bert(tmp_path, "index")
    counts, on_device = _count_cached_passes(monkeypatch, model)
    given: list[list[str]] = []
    for _ in range(1 + FORWARD_PROBES + 2):
        ids, mask = batch(0)
        loader_batch = {"input_ids": ids, "attention_mask": mask, "index": torch.arange(6)}
        device_batch = dict(zip(loader_batch, _device_copy(*loader_batch.values())))
        cache.indices.remember(loader_batch, device_batch)
        given.append([])
        with OnDevice(given[-1], *device_batch.values()):
            cache.set_batch(device_batch, "train0", None)
        on_device[:] = list(device_batch.values())
        kwargs = {"attention_mask": device_batch["attention_mask"]} if with_mask else {}
        model(input_ids=device_batch["input_ids"], **kwargs).logits.sum().backward()
    return given, counts, cache


def test_a_served_step_with_index_keys_reads_its_indices_on_the_host(tmp_path, monkeypatch):
    """Index keys: the indices come from the loader's host tensor (no wait); the blocks' arguments
    are hashed into the keys (a changed mask must miss), and the mask the model built on the
    device is read once for that; nothing else."""
    given, counts, cache = _index_steps(tmp_path, monkeypatch, with_mask=True)
    assert cache.store.stats().hits == 6 * (len(counts) - 1)  # engaged: every batch after the first was served
    assert given == [[]] * len(counts), given
    assert counts[1] == ["cpu", "cpu"] and counts[-1] == ["cpu"], counts  # a probed forward reads its content keys too


def test_a_served_step_with_index_keys_and_no_block_argument_makes_the_host_wait_for_nothing(tmp_path, monkeypatch):
    """Without an attention mask the blocks get no tensor besides the hidden state: the keys are made
    on the host alone, and a served step makes no host wait at all."""
    given, counts, cache = _index_steps(tmp_path, monkeypatch, with_mask=False)
    assert cache.store.stats().hits == 6 * (len(counts) - 1)  # engaged
    assert given == [[]] * len(counts) and counts[1] == ["cpu"] and counts[-1] == [], (given, counts)


def test_indices_read_from_a_device_copy_the_loader_did_not_give_are_read_there(tmp_path):
    """No remembered host copy (a batch moved by other code, or changed in place since): the indices
    are read from the tensor the forward gets, never from a stale host copy."""
    model, cache = _cached_bert(tmp_path, "index")
    loader_batch = {"index": torch.arange(6)}
    device_batch = {"index": loader_batch["index"].clone()}
    cache.indices.remember(loader_batch, device_batch)
    device_batch["index"].add_(10)  # changed in place after the copy: the host ints are stale
    seen: list[str] = []
    with OnDevice(seen, device_batch["index"]):
        keys = cache.indices.read(device_batch, "train0", "train0", None, cache.verdicts.refuse)
    assert keys == [f"train0i{i}" for i in range(10, 16)] and seen == ["tolist"], (keys, seen)


class DeviceReads(TorchFunctionMode):
    """The host waits a GPU would make in the averaging by hand: reads (``.tolist()``, ``.item()``, ...) of tensors
    that :class:`~lightning_pipetransformer.devices.VirtualDevices` places on a device; host data is not counted."""

    def __init__(self, seen: list[str], virtual: Any) -> None:
        super().__init__()
        self.seen, self.virtual = seen, virtual

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCING and args and isinstance(args[0], torch.Tensor) and self.virtual.tagged(args[0]):
            self.seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _averaged_by_hand(rank: int, world: int) -> None:
    """Two replicas of two stages (virtual devices), averaged by hand for three AdamW steps; per step, the host reads
    of device tensors and the group, device and dtype of every all-reduce."""
    import torch.distributed as dist

    from lightning_pipetransformer import devices as dev
    from lightning_pipetransformer.devices import VirtualDevices
    from lightning_pipetransformer.dp.ddp import GradientSync
    from tests.unit.dp.test_gradient_average import CPU0, CPU1, STEPS, _halves, _Model, _optimizer

    data, host = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")  # NCCL's active group, its gloo twin
    model = _Model()
    optimizer = _optimizer(model)
    reduced: list[tuple[str, torch.device, torch.dtype]] = []
    all_reduce = dist.all_reduce

    def recording(tensor, *args, group=None, **kwargs):
        reduced.append(("host" if group is host else "data" if group is data else "other", dev.device_of(tensor), tensor.dtype))
        return all_reduce(tensor, *args, group=group, **kwargs)

    dist.all_reduce = recording  # this spawned process only
    with VirtualDevices() as virtual:
        dev.bind_process_device(CPU0)
        for module, device in ((model.embed, CPU0), (model.block, CPU0), (model.late, CPU1), (model.branch, CPU1), (model.pooler, CPU1), (model.head, CPU1)):
            dev.place_module(module, device)
        sync = GradientSync()
        sync.wrap(
            model, group=data, host_group=host, world_size=world, active=True, pipe_len=2, num_replicas=world,
            root_device=CPU0, stage_devices=(CPU0, CPU1), init_sync=False,
        )  # fmt: skip
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            model(_halves(step)[rank], rank == 0).backward()
            seen: list[str] = []
            reduced.clear()
            with DeviceReads(seen, virtual):
                sync.average(model.parameters(), CPU0)
            assert seen == [], seen  # before: the flags' all-reduce read back from the device (.tolist()), every step
            # Which parameters some replica used: host flags over the gloo twin; the gradients over the data group, on CPU0.
            assert reduced[0] == ("host", torch.device("cpu"), torch.uint8), reduced
            assert len(reduced) > 1 and all(group == "data" and device == CPU0 for group, device, _ in reduced[1:]), reduced
            assert model.pooler.weight.grad is None and model.branch.weight.grad is not None  # DDP's rules still
            optimizer.step()


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_averaging_by_hand_agrees_on_the_used_parameters_on_the_host_without_reading_the_device():
    """Issue 40, item 9: a replica of several stages averaged by hand (K > 1, several replicas) makes no host wait for
    the device per step; ``tests/unit/dp/test_gradient_average.py`` checks it still equals one process."""
    from tests.helpers.spawn import spawn_gloo

    spawn_gloo(_averaged_by_hand, 2)
