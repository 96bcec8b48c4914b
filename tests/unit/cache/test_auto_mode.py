"""``cache="auto"`` decides from device time, and times nothing once decided.

On a GPU the host clock sees launches only: the frozen prefix's kernels and the lookup's copy to the
device run after the host moved on. A stand-in GPU (tests/helpers/stand_in_gpu.py) whose kernels take
device time the host clock does not see shows it on CPU: the host clock decides wrongly both ways,
the events on the current stream decide rightly.
"""

from __future__ import annotations

import sys
import time
import warnings
from contextlib import contextmanager

import pytest
import torch

from lightning_pipetransformer import devices as dev
from lightning_pipetransformer.cache.autocache import AutoCache
from lightning_pipetransformer.cache.cached_stack import CachedStack
from lightning_pipetransformer.cache.prefix import run_blocks
from lightning_pipetransformer.cache.store import ActivationStore
from lightning_pipetransformer.devices import timing
from lightning_pipetransformer.freeze.apply import apply_freeze
from lightning_pipetransformer.stack.discovery import find_block_stack
from lightning_pipetransformer.stack.interception import install_pipeline
from lightning_pipetransformer.stack.observers import sees_block_runs
from tests.helpers.models import SEQ, VOCAB, tiny_bert
from tests.helpers.stand_in_gpu import StandInGpu

ROWS = 6


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    return ids, torch.ones_like(ids)


class Scenario:
    """A 3-block BERT, blocks 0-1 frozen and cached, on a stand-in GPU.

    Each frozen block's real run is ``prefix_host`` seconds of host work (launches) and a kernel of
    ``prefix_kernel`` seconds per row; the active block a kernel of ``active_kernel`` (the rest of the step, queued);
    each lookup ``lookup_host`` of host work (dict, disk, CRC) and a copy to the device of ``copy`` seconds per row.
    """

    def __init__(
        self, tmp_path, monkeypatch, mode="auto", *, prefix_host=0.0, prefix_kernel=0.0, active_kernel=1.0,
        lookup_host=0.0, copy=0.0,
    ):
        self.gpu = gpu = StandInGpu()
        torch.manual_seed(0)
        self.model = tiny_bert(3)
        self.cache = AutoCache(mode, str(tmp_path), 10**7)
        self.said: list[str] = []
        self.cache.announce = self.said.append
        stack = find_block_stack(self.model)
        apply_freeze(stack, 2, include_pre=True)
        self.cache.attach(stack, self.model)
        self.cache.move_boundary(stack, 2, True, torch.device("cpu"), (0, 1))

        def frozen_run(module, args, out):
            gpu.host_work(prefix_host)
            gpu.kernel(prefix_kernel * out[0].shape[0] if isinstance(out, tuple) else prefix_kernel * out.shape[0])

        for block in stack.blocks[:2]:
            block.register_forward_hook(sees_block_runs(frozen_run))
        stack.blocks[2].register_forward_hook(sees_block_runs(lambda module, args, out: gpu.kernel(active_kernel)))
        active = run_blocks(stack.blocks[2:])
        install_pipeline(stack.container, CachedStack(self.cache, stack.blocks, 2, lambda call: active(call.hidden, call.calls)))

        lookup = ActivationStore.lookup

        def timed_lookup(store, keys, *args, **kwargs):
            found = lookup(store, keys, *args, **kwargs)
            gpu.host_work(lookup_host)
            gpu.kernel(copy * int(found[0].sum()))  # the non_blocking copy of the hits, queued on the current stream
            return found

        monkeypatch.setattr(ActivationStore, "lookup", timed_lookup)

    def step(self, seed=0):
        with dev.stand_in_streams(self.gpu):
            ids, mask = batch(seed)
            self.model(input_ids=ids, attention_mask=mask)


def test_kernels_the_host_clock_does_not_see_keep_the_cache(tmp_path, monkeypatch):
    # The prefix: 20 ms of device time per sample, its launches free for the host. A lookup: 20 ms of host work per
    # batch, hidden behind the step's queued kernels (the device is busy meanwhile), and a 1 ms copy per sample.
    # The host clock sees a lookup of ~3 ms per sample against a prefix of almost nothing, and turned the cache off.
    run = Scenario(tmp_path, monkeypatch, prefix_kernel=0.01, lookup_host=0.02, copy=0.001)
    run.step()  # all miss: the prefix is timed
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # turning off warns
        run.step()  # all hit: decides
    assert run.cache.enabled and not run.cache.auto.measuring
    assert any("keeps the cache at boundary 2" in line and "device time" in line for line in run.said), run.said
    assert run.cache.counters.served >= 1


def test_a_copy_the_host_clock_does_not_see_turns_the_cache_off(tmp_path, monkeypatch):
    # The prefix: 20 ms of host work per block (launches), kernels of 0.1 ms per sample: launch-bound, ~7 ms per sample
    # on the device too. A lookup: a copy to the device of 20 ms per sample (large entries), issued in no host time.
    # The host clock sees a lookup of almost nothing against a 7 ms prefix, and kept the cache.
    run = Scenario(tmp_path, monkeypatch, prefix_host=0.02, prefix_kernel=1e-4, copy=0.02)
    run.step()
    with pytest.warns(UserWarning, match=r"turned off at boundary 2: a lookup takes 20\.000 ms per sample.*device time"):
        run.step()
    assert not run.cache.enabled and not run.cache.auto.measuring


#: Every event a span made (a host wait on one is a timing wait; the store's copies wait on their own events).
TIMING_EVENTS: list[object] = []


@contextmanager
def timing_calls():
    """Counts the timing events made and the host-clock reads by the cache and the timer."""
    made: list[object] = []
    reads: list[str] = []
    make, clock = timing._timing_event, time.perf_counter

    def counting_event(stream):
        made.append(stream)
        event = make(stream)
        TIMING_EVENTS.append(event)
        return event

    def counting_clock():
        caller = sys._getframe(1).f_code.co_filename
        if "lightning_pipetransformer/cache" in caller or "lightning_pipetransformer/devices" in caller:
            reads.append(caller)
        return clock()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(timing, "_timing_event", counting_event)
        patch.setattr(time, "perf_counter", counting_clock)
        yield made, reads


def test_nothing_is_timed_once_decided(tmp_path, monkeypatch):
    run = Scenario(tmp_path, monkeypatch, prefix_kernel=0.01, copy=0.001)
    with timing_calls() as (made, _):
        run.step()  # misses: the prefix's span and the lookup's
        run.step()  # all hit: the lookup's span, then the decision
    assert len(made) == 6 and set(made) == {run.gpu}  # three spans (lookup, prefix; lookup), on the current stream
    waited = len(run.gpu.waited)
    with timing_calls() as (made, reads):
        run.step()  # hits
        run.step(seed=1)  # misses: the prefix runs, untimed
        run.step(seed=1)  # hits (a lookup may wait for its entries' copy to the host: the store's event, not a span's)
    timing_waits = [e for e in run.gpu.waited[waited:] if any(e is t for t in TIMING_EVENTS)]
    assert made == [] and reads == [] and timing_waits == []
    assert run.cache.enabled


@pytest.mark.parametrize("mode", [True, False])
def test_nothing_is_timed_unless_auto(tmp_path, monkeypatch, mode):
    run = Scenario(tmp_path, monkeypatch, mode, prefix_kernel=0.01, copy=0.001)
    with timing_calls() as (made, reads):
        run.step()
        run.step()  # hits (a lookup may wait for its entries' copy to the host: the store's event, not a span's)
    timing_waits = [e for e in run.gpu.waited if any(e is t for t in TIMING_EVENTS)]
    assert made == [] and reads == [] and timing_waits == []


def test_a_new_boundary_is_measured_again(tmp_path, monkeypatch):
    run = Scenario(tmp_path, monkeypatch, prefix_kernel=0.01, copy=0.001)
    run.step()
    run.step()
    assert run.cache.enabled and not run.cache.auto.measuring
    run.cache.move_boundary(find_block_stack(run.model), 1, True, torch.device("cpu"), (0, 1))
    assert run.cache.store.boundary == 1 and run.cache.auto.measuring
