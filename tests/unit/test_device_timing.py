"""devices/timing.py: a region's device time from events on the current stream, the host clock off CUDA."""

from __future__ import annotations

import time

import pytest
import torch

from lightning_pipetransformer import devices as dev
from lightning_pipetransformer.devices.timing import DeviceSpan, HostEvent
from tests.helpers.stand_in_gpu import StandInGpu

CPU = torch.device("cpu")


def test_a_span_is_the_device_time_between_events_on_the_current_stream():
    gpu = StandInGpu()
    with dev.stand_in_streams(gpu):
        span = DeviceSpan(CPU)
        with span:
            gpu.kernel(0.25)  # the host returns at once; the device works 0.25 s
            gpu.kernel(0.5)
        assert [event.stream for event in gpu.recorded] == [gpu, gpu]  # both events on the current stream
        assert gpu.waits == 0 and gpu.host == 0.0  # recording waits for nothing
        assert span.seconds() == pytest.approx(0.75)
        assert gpu.waits == 1 and gpu.host == pytest.approx(0.75)  # reading waits once, for the end event


def test_host_work_hidden_behind_queued_kernels_costs_no_device_time():
    gpu = StandInGpu()
    with dev.stand_in_streams(gpu):
        gpu.kernel(1.0)  # a backlog from earlier work
        with DeviceSpan(CPU) as span:
            gpu.host_work(0.01)
            gpu.kernel(0.002)
        assert span.seconds() == pytest.approx(0.002)


def test_off_cuda_a_span_reads_the_host_clock():
    with DeviceSpan(CPU) as span:
        time.sleep(0.02)
    assert isinstance(span._end, HostEvent)
    assert 0.02 <= span.seconds() < 1.0


def test_a_span_read_before_it_ended_is_an_error():
    span = DeviceSpan(CPU)
    with pytest.raises(RuntimeError, match="before the span ended"):
        span.seconds()
