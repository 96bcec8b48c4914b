"""The executor's schedule is GPipe's: makespans replayed on CPU with stand-in streams and events.

The real :class:`Pipeline` runs with :func:`devices.stand_in_streams` plugged in, so it takes its
CUDA path: a stream per stage, events at every hand-over, the ``hop`` autograd function. Each
block's forward is a kernel of known duration on the current stand-in stream, and its backward a
kernel on the same stream (:mod:`.stand_in_streams`). A stage's work thus starts when its
stream's earlier work and the events it waits on are done, as on a GPU with enough SMs for every
stage at once; the span of the kernels is the makespan. All stages share one device, as on one
GPU: the CPU autograd engine then runs the backward in the order CUDA's one-GPU engine does.
"""

import pytest
import torch

from lightning_pipetransformer import devices as dev
from lightning_pipetransformer.pipe.pipeline import Pipeline
from tests.unit.pipe.stand_in_streams import TimedBlock, Timeline, numbered_batch

CPU = torch.device("cpu")


def flow_shop(stage_times, chunks):
    """GPipe's makespan for identical micro-batches: the first one through every stage, then the
    others one slowest-stage-time apart."""
    return sum(stage_times) + (chunks - 1) * max(stage_times)


def run_timed(balance, chunks, durations=None, kernels=1, launch_cost=0.0):
    """(forward makespan, backward makespan) of one pass of the real executor on the stand-in."""
    timeline = Timeline(launch_cost)
    durations = durations or [1.0] * sum(balance)
    with dev.stand_in_streams(timeline):
        blocks = [TimedBlock(timeline, b, kernels, d / kernels) for b, d in enumerate(durations)]
        out = Pipeline(blocks, balance, ["cpu"] * len(balance), chunks)(numbered_batch(chunks))
        forward = timeline.span()
        ready = timeline.current_stream(CPU).tail  # the output is usable by the caller from here
        launched = len(timeline.kernels)
        out.sum().backward()
    backward = max(k.end for k in timeline.kernels[launched:]) - ready
    assert launched == len(timeline.kernels) // 2 == chunks * len(blocks) * kernels  # every block once per micro-batch
    return forward, backward


@pytest.mark.parametrize("stages,chunks", [(2, 2), (3, 5), (4, 8), (8, 16), (4, 1), (1, 4), (5, 3)])
def test_unit_stages_take_m_plus_k_minus_1_forward_and_backward(stages, chunks):
    forward, backward = run_timed([1] * stages, chunks)
    # Fill, steady state, drain: K - 1 cycles with idle stages, then one stage-time per micro-batch.
    # Each hand-over waiting on one micro-batch too many gave M + 2(K - 1) (K=4, M=8: 14; K=8, M=16: 30).
    assert forward == chunks + stages - 1
    assert backward == chunks + stages - 1


@pytest.mark.parametrize(
    "balance,durations",
    [((1, 1, 1, 1), [1.0, 2.0, 1.0, 1.0]), ((2, 1, 3), [1.0] * 6), ((1, 2), [3.0, 0.5, 0.5])],
    ids=["slow-stage", "uneven-blocks", "slow-first"],
)
def test_uneven_stages_take_the_flow_shop_makespan(balance, durations):
    edges = [sum(balance[:j]) for j in range(len(balance) + 1)]
    stage_times = [sum(durations[edges[j] : edges[j + 1]]) for j in range(len(balance))]
    for chunks in (1, 3, 6):
        forward, backward = run_timed(balance, chunks, durations)
        assert forward == pytest.approx(flow_shop(stage_times, chunks))
        assert backward == pytest.approx(flow_shop(stage_times, chunks))


def test_stages_overlap_on_their_streams():
    timeline = Timeline()
    with dev.stand_in_streams(timeline):
        blocks = [TimedBlock(timeline, j) for j in range(3)]
        Pipeline(blocks, (1, 1, 1), ["cpu"] * 3, 4)(numbered_batch(4))
    start = {k.label[1:]: k.start for k in timeline.kernels}  # (block, micro-batch) -> start time
    assert all(start[j, i] == i + j for i in range(4) for j in range(3))  # micro-batch i on stage j at cycle i + j
    assert len({k.stream for k in timeline.kernels}) == 3


# -- one Python thread launches every stage's kernels ------------------------------------------


@pytest.mark.parametrize("launch_cost", [0.01, 0.02])
def test_launches_cost_nothing_while_a_cycle_launches_faster_than_a_stage_computes(launch_cost):
    # K = 4 stages of 10 kernels of 0.1 each: a cycle's launches take 4 * 10 * c, a stage 10 * 0.1.
    stages, chunks, kernels = 4, 8, 10
    forward, backward = run_timed([1] * stages, chunks, kernels=kernels, launch_cost=launch_cost)
    assert stages * launch_cost < 0.1
    # GPipe's makespan, late by the first launch only (the backward's launches start earlier).
    assert forward == pytest.approx(chunks + stages - 1 + launch_cost)
    assert backward == pytest.approx(chunks + stages - 1)


@pytest.mark.parametrize("launch_cost", [0.05, 0.1])
def test_small_kernels_make_the_pipeline_launch_bound(launch_cost):
    # Now a cycle's launches (K * 10 * c) outlast a stage's work (10 * 0.1): the GPU waits for the
    # host, and the makespan becomes the time to launch all M * K * 10 kernels one after another.
    stages, chunks, kernels = 4, 8, 10
    forward, _ = run_timed([1] * stages, chunks, kernels=kernels, launch_cost=launch_cost)
    serial_launches = chunks * stages * kernels * launch_cost
    assert stages * launch_cost > 0.1
    assert forward > 1.4 * (chunks + stages - 1)
    assert forward == pytest.approx(serial_launches, rel=0.1)


@pytest.mark.parametrize("stages,chunks", [(2, 4), (3, 5), (4, 8)])
def test_copies_between_devices_run_on_copy_streams_and_overlap_the_next_micro_batch(stages, chunks):
    """Stages on K devices, each hand-over a copy of a quarter of a stage's time. On the devices'
    copy streams a copy overlaps the producer's next micro-batch: M + K - 1 plus the K - 1 copies
    on one micro-batch's way. On the producer's compute stream (before) each stage's step was
    1 + copy: about (M + K - 1) * 1.25."""
    copy = 0.25
    timeline = Timeline(copy_cost=copy)
    devices = [torch.device("cpu", j) for j in range(stages)]
    with dev.stand_in_streams(timeline):
        blocks = [TimedBlock(timeline, j, device=devices[j]) for j in range(stages)]
        out = Pipeline(blocks, [1] * stages, devices, chunks)(numbered_batch(chunks))
        forward = timeline.span()
        computes = {s for s in timeline.made if s in {k.stream for k in timeline.kernels}}
        copy_streams = {s for a, b in zip(devices, devices[1:]) for s in dev.copy_streams(a, b)}
        launched = len(timeline.kernels)
        forward_copies = len(timeline.copies)
        out.sum().backward()
    assert forward_copies == chunks * (stages - 1)  # one per hand-over between devices
    assert {k.stream for k in timeline.copies[:forward_copies]} <= copy_streams and not computes & copy_streams
    assert forward == chunks + stages - 1 + (stages - 1) * copy
    assert len(timeline.copies) == 2 * forward_copies  # the gradients go back the same way
    backward = max(k.end for k in timeline.kernels[launched:]) - min(k.start for k in timeline.kernels[launched:])
    assert backward == chunks + stages - 1 + (stages - 1) * copy
