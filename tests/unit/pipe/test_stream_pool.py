"""Pipelines take their streams from one per-process pool (devices.stage_streams), counted on CPU with stand-in streams."""

import torch

from lightning_pipetransformer import devices as dev
from lightning_pipetransformer.pipe.chunks import ChunkTuner, chunk_candidates
from lightning_pipetransformer.pipe.pipeline import Pipeline
from lightning_pipetransformer.stack.stack_call import StackCall
from tests.unit.pipe.stand_in_streams import TimedBlock, Timeline, numbered_batch

CPU0, CPU1 = torch.device("cpu", 0), torch.device("cpu", 1)


def test_chunks_auto_times_every_candidate_on_the_same_streams():
    timeline = Timeline()
    chosen = []
    with dev.stand_in_streams(timeline):
        blocks = [TimedBlock(timeline, j) for j in range(4)]
        tuner = ChunkTuner(blocks, (2, 2), [torch.device("cpu")] * 2, 0, lambda k, m: chosen.append(m))
        call = StackCall.uniform(numbered_batch(12), (), {}, len(blocks))  # 24 samples: every M in 2..12 is timed
        tuner.run(call)
        tuner.run(call)
    assert len(chunk_candidates(2)) == 11 and len(chosen) == 1
    # 11 timed pipelines and the chosen one, two stages each: two streams, not 24.
    assert len(timeline.made) == 2
    assert {k.stream for k in timeline.kernels} == set(timeline.made)


def test_stages_on_one_device_get_distinct_streams_and_pipelines_share_them():
    timeline = Timeline()
    with dev.stand_in_streams(timeline):
        four = dev.stage_streams([CPU0] * 4)
        assert len(set(four)) == 4  # stages on one device still overlap: one stream each
        assert dev.stage_streams([CPU0] * 4) == four  # another pipeline, same slots
        assert dev.stage_streams([CPU0] * 2) == four[:2]  # K 4 -> 2 on the same device
        mixed = dev.stage_streams([CPU0, CPU1, CPU0, CPU1])  # the s-th stage on a device takes its slot s
        assert mixed[0] is four[0] and mixed[2] is four[1] and mixed[1] is not mixed[3]
        assert {s.device for s in mixed[1::2]} == {CPU1}
        blocks = [TimedBlock(timeline, j) for j in range(3)]
        pipe = Pipeline(blocks, (1, 1, 1), [CPU0] * 3, 2)
        pipe(numbered_batch(2))
        assert pipe._streams == four[:3]
    assert len(timeline.made) == 6  # four on cpu:0, two on cpu:1


def test_no_streams_on_cpu_and_the_stand_in_pool_does_not_leak():
    assert dev.stage_streams([CPU0, CPU0]) == [None, None]
    with dev.stand_in_streams(Timeline()):
        assert None not in dev.stage_streams([CPU0, CPU0])
    assert dev.stage_streams([CPU0, CPU0]) == [None, None]
