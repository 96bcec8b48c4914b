"""What a batch missed leaves the device without the step waiting (cache/host_copy.py, issue 40 item 5).

On a CPU every tensor shares one memory and every copy is done when it returns, so the rule is
checked on a stand-in GPU (tests/unit/cache/async_copies.py) whose non-blocking copies run late:
which copy ran ``non_blocking`` into pinned memory on the copy stream, that the copy stream waited
for the producer, that the event was recorded after the copies and waited before any host read,
and that an entry equals what the device held when ``store`` was called.
"""

from __future__ import annotations

import pytest
import torch

from lightning_pipetransformer.cache.host_copy import IncompleteCopyError, start_host_copy
from lightning_pipetransformer.cache.store import MAX_COPIES_IN_FLIGHT, ActivationStore
from lightning_pipetransformer.devices import streams

FP = "0123456789abcdef0123456789abcdef"


def _every_store_copied_late(gpu) -> None:
    """Copies into host buffers happened, every one on the copy stream, pinned, non-blocking (the model's own
    copies on the compute stream aside)."""
    to_host = [c for c in gpu.copies() if c[2] or c[1].startswith("copy")]
    assert to_host and all(c[1] == "copy1" and c[2] and c[3] for c in to_host), to_host


def test_a_miss_leaves_the_device_non_blocking_into_pinned_memory_and_is_read_after_its_event(tmp_path, async_gpu):
    gpu = async_gpu
    store = ActivationStore(tmp_path, FP, 1, memory_budget=10**6)
    keys = ["a", "b", "c"]
    acts = torch.randn(3, 4, 5)
    mask = torch.ones(3, 5, dtype=torch.long)
    expected = acts.clone()
    store.store(keys, acts, {"mask": mask})

    copies = gpu.copies()
    # Not the pipeline's outgoing hand-over stream: a batch's misses must not queue ahead of the next micro-batch's hand-over.
    handover_out = streams.copy_streams(torch.device("cpu"), torch.device("cpu"))[0]
    assert streams.host_copy_stream(torch.device("cpu")) is not handover_out
    # Both tensors (the activation, the stored block input): non-blocking, into pinned buffers, on the copy stream.
    assert [c[1:4] for c in copies] == [("copy1", True, True)] * 2, gpu.log
    log = gpu.log
    first_copy = log.index(copies[0])
    assert log.index(("wait", "copy1", "compute:cpu")) < first_copy  # the copy stream waits for the producer
    assert log.count(("record_stream", "copy1")) == 2  # the allocator knows the copy stream reads the sources
    assert log.index(("event", "copy1")) > log.index(copies[-1])  # the event comes after the copies
    # Nothing was read yet: the copy has not run (a blocking copy would have made the entries already).
    assert ("host read",) not in log
    assert store.stats().entries_in_memory == 0

    acts.add_(100.0)  # a later kernel of the compute stream writes the caller's tensor in place
    hit, hits = store.lookup(keys)
    assert hit.all()
    assert torch.equal(hits, expected)  # the entry is what the device held at store(), not the later write
    assert log.index(("synchronize", "copy1")) < log.index(("host read",))
    read = store.read("b")
    assert read is not None and torch.equal(read.extras["mask"], mask[1])


def test_the_cast_to_the_storage_dtype_happens_on_the_device_before_the_copy(tmp_path, async_gpu):
    store = ActivationStore(tmp_path, FP, 1, memory_budget=10**6, storage_dtype=torch.bfloat16)
    acts = torch.randn(2, 8)
    store.store(["a", "b"], acts)
    (copy,) = async_gpu.copies()
    assert copy[4] == torch.bfloat16  # half the bytes cross the bus
    hit, hits = store.lookup(["a", "b"])
    assert hit.all() and hits.dtype == torch.float32
    assert torch.equal(hits, acts.to(torch.bfloat16).float())


def test_a_buffer_read_before_its_event_completed_raises(async_gpu):
    source = torch.arange(6.0).view(2, 3)
    copy = start_host_copy(source, torch.float32, {})
    assert not copy.ready()
    with pytest.raises(IncompleteCopyError, match="before its event completed"):
        copy.host()
    async_gpu.run()  # the device runs the copy
    assert copy.ready()
    hidden, extras = copy.host()
    assert torch.equal(hidden, source) and extras == {}


def test_a_finished_copy_becomes_entries_without_the_host_waiting(tmp_path, async_gpu):
    store = ActivationStore(tmp_path, FP, 1, memory_budget=10**6)
    store.store(["a", "b"], torch.randn(2, 3))
    async_gpu.run()  # the device got there by itself
    assert store.stats().stored == 2  # the statistics take it without a wait
    assert ("synchronize", "copy1") not in async_gpu.log
    assert ("done", "copy1") in async_gpu.log


def test_copies_in_flight_are_bounded(tmp_path, async_gpu):
    store = ActivationStore(tmp_path, FP, 1, memory_budget=10**6)
    extra = 3
    for i in range(MAX_COPIES_IN_FLIGHT + extra):
        store.store([f"k{i}"], torch.full((1, 4), float(i)))
    # The oldest ones were waited for, so the pinned memory in flight stays at MAX_COPIES_IN_FLIGHT batches.
    assert async_gpu.log.count(("synchronize", "copy1")) == extra
    assert len(store._pending) == MAX_COPIES_IN_FLIGHT
    hit, hits = store.lookup([f"k{i}" for i in range(MAX_COPIES_IN_FLIGHT + extra)])
    assert hit.all() and hits[:, 0].tolist() == [float(i) for i in range(MAX_COPIES_IN_FLIGHT + extra)]


def test_on_the_cpu_the_same_path_stores_before_store_returns(tmp_path):
    store = ActivationStore(tmp_path, FP, 1, memory_budget=10**6)
    acts = torch.randn(2, 3)
    expected = acts.clone()
    store.store(["a", "b"], acts)
    assert not store._pending and store._stats.stored == 2  # no stream, no event: done at once
    acts.add_(1.0)
    assert torch.equal(store.lookup(["a", "b"])[1], expected)  # rows were cloned out of the batch


def test_cache_on_equals_cache_off_with_late_copies(tmp_path, async_gpu):
    """The forward with hits and misses (memory and disk) equals no cache while every copy runs late."""
    from tests.unit.cache import test_advance

    test_advance.test_cache_on_equals_cache_off_with_hits_and_misses(tmp_path)
    _every_store_copied_late(async_gpu)

