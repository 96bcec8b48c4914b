"""Streams and events: the only place the pipeline executor touches CUDA's ordering.

On CUDA every pipeline stage computes on a stream of its own, so stages overlap; the hand-over of a
tensor from one stream to another (:mod:`~.handover`) orders the two with an event and tells the
caching allocator (:func:`record`) that the tensor is now also read there, so its memory is not
reused too early. On CPU a "stream" is ``None``: every helper here is then a no-op, so the executor
runs the same code in the same order without any of it.

Streams come from a per-process pool (:func:`stage_streams`, :func:`copy_streams`), not one set per
pipeline. A test stands in for CUDA's streams and events with :func:`stand_in_streams` (timelines,
counters), so the executor takes its CUDA path on CPU tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = [
    "Stream", "StreamBackend", "copy_between_devices", "copy_streams", "current_stream", "event_done", "event_wait",
    "host_buffer", "host_catches_up", "host_copy_stream", "new_event", "new_stream", "record", "record_event", "release_cached_memory", "stage_streams",
    "stand_in_streams", "until_done", "use_stream", "use_streams", "wait",
]  # fmt: skip

#: A CUDA stream, or ``None`` for a CPU device (ops run in program order: nothing to order).
Stream = torch.cuda.Stream | None


class StreamBackend(Protocol):
    """What :func:`stand_in_streams` takes: CUDA's streams and events, for every device, CPU ones too."""

    def new_stream(self, device: torch.device) -> Any: ...
    def current_stream(self, device: torch.device) -> Any: ...
    def use_stream(self, stream: Any) -> AbstractContextManager[Any]: ...
    def new_event(self) -> Any: ...
    def record_stream(self, tensor: Tensor, stream: Any) -> None: ...


#: Test seam (see :func:`stand_in_streams`); ``None`` in production, where streams are CUDA's.
_stand_in: StreamBackend | None = None

#: The stream pool: ``(device, slot) -> stream``, made on first use (see :func:`stage_streams`,
#: :func:`copy_streams`).
_pool: dict[tuple[torch.device, int], Stream] = {}


@contextmanager
def stand_in_streams(backend: StreamBackend) -> Iterator[StreamBackend]:
    """Test mode: ``backend`` makes the streams and events of every device, with a pool of its own.

    The executor then takes its CUDA path on CPU tensors, so a test can replay on a stand-in
    timeline what the GPU would do (which stream waits for which, and when). Used by tests only.
    """
    global _stand_in, _pool
    saved = _stand_in, _pool
    _stand_in, _pool = backend, {}
    try:
        yield backend
    finally:
        _stand_in, _pool = saved


def new_stream(device: torch.device) -> Stream:
    """A fresh stream on ``device``; ``None`` off CUDA. Pipelines take theirs from :func:`stage_streams`."""
    if _stand_in is not None:
        return _stand_in.new_stream(device)
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device=device)


def stage_streams(devices: Sequence[torch.device]) -> list[Stream]:
    """One stream per pipeline stage, from the per-process pool: the ``s``-th stage on ``device``
    (in stage order) gets the pool's stream ``(device, s)``, whatever pipeline it belongs to.

    Why a pool: ``chunks="auto"`` builds a pipeline per candidate M (K..6K of them) and every plan
    builds another; fresh streams each time would leave dozens of streams per device, each with
    its own caching-allocator pool (memory freed on one stream is reused only on that stream) and
    its own cuBLAS workspace. Sharing a stream between pipelines costs no overlap (they run one
    pass at a time) and is never a race (a stream is a queue: work on it is only ordered more).
    Two stages of one pipeline on the same device get different slots, so they still overlap.
    """
    slots: dict[torch.device, int] = {}
    streams: list[Stream] = []
    for device in devices:
        slot = slots.get(device, 0)
        slots[device] = slot + 1
        if (device, slot) not in _pool:
            _pool[device, slot] = new_stream(device)
        streams.append(_pool[device, slot])
    return streams


def current_stream(device: torch.device) -> Stream:
    """The caller's current stream on ``device``; ``None`` off CUDA."""
    if _stand_in is not None:
        return _stand_in.current_stream(device)
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device)


def use_stream(stream: Stream) -> Any:
    """Context that makes ``stream`` current on its device; does nothing for ``None``."""
    if stream is None:
        return nullcontext()
    if _stand_in is not None:
        return _stand_in.use_stream(stream)
    return torch.cuda.stream(stream)


@contextmanager
def use_streams(first: Stream, second: Stream) -> Iterator[None]:
    """Make both streams current at once (a cross-device copy orders against both devices)."""
    with use_stream(first), use_stream(second):
        yield


def wait(waiter: Stream, producer: Stream) -> None:
    """Work queued on ``waiter`` from now on starts after everything queued on ``producer`` so far."""
    if waiter is None or producer is None or waiter == producer:
        return
    event = _stand_in.new_event() if _stand_in is not None else torch.cuda.Event()
    event.record(producer)
    waiter.wait_event(event)


def until_done(work: Any, device: torch.device) -> None:
    """Block the host until ``work`` (a collective or point-to-point request) no longer uses its buffers.

    ``Work.wait()`` alone is not that under NCCL: it makes the current stream wait on the NCCL
    stream and returns at once; :func:`host_catches_up` then blocks until the stream is past it.
    On the CPU (gloo) ``wait()`` already blocks. Call it on a request not yet waited (gloo's
    point-to-point ``wait`` is not idempotent: a second one waits for another message).
    """
    work.wait()
    host_catches_up(device)


def host_catches_up(device: torch.device) -> None:
    """Block the host until everything queued so far on ``device``'s current stream has run
    (requests it was made to wait on included): an event recorded there, synchronised.
    Nothing to do on the CPU."""
    if _stand_in is not None:
        event = _stand_in.new_event()
    elif device.type == "cuda":
        event = torch.cuda.Event()
    else:
        return
    event.record(current_stream(device))
    event.synchronize()


def release_cached_memory(left: Sequence[torch.device]) -> None:
    """Blocks left the devices ``left``: cuBLAS's per-stream workspaces and the caching allocator's
    free blocks go back to the driver, so that a GPU this process left holds nothing of it when
    another rank's replica is placed there. Why only then: emptying the cache costs every later
    allocation a ``cudaMalloc`` until the cache refills, for nothing when no block moved. Torch
    empties every GPU of the process at once (it has no call for one); the workspaces of the GPUs
    still used are made again on their next matmul (a few MB each). Nothing to do unless one of
    ``left`` is a GPU."""
    if not any(device.type == "cuda" for device in left):
        return
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()


def record(tensor: Tensor, *streams: Stream) -> None:
    """Tell the caching allocator that ``tensor`` is also read on ``streams``.

    Without it, freeing ``tensor`` on the Python side lets the allocator hand its memory to
    new work on the stream that allocated it while another stream still reads it. Only
    streams of the tensor's own device are recorded: the allocator tracks uses per device.
    """
    if _stand_in is not None:
        for stream in streams:
            if stream is not None:
                _stand_in.record_stream(tensor, stream)
        return
    if not tensor.is_cuda:
        return
    for stream in streams:
        if stream is not None and stream.device == tensor.device:
            tensor.record_stream(stream)


#: The pool's slots of a device's copy streams (stage streams take slots 0, 1, ...): one for the
#: hand-overs that leave the device, one for those that arrive, one for the cache's copies to the host.
_COPY_OUT, _COPY_IN, _COPY_HOST = -1, -2, -3


def copy_streams(src: torch.device, dst: torch.device) -> tuple[Stream, Stream]:
    """The copy streams of a hand-over from ``src`` to ``dst``, from the per-process pool: ``src``'s
    outgoing one and ``dst``'s incoming one. ``None`` off CUDA.

    Cross-device hand-overs run there, off the stages' compute streams (as torchgpipe's copy
    streams), so a copy overlaps the producer's next micro-batch instead of queueing behind it.
    Two per device, not one: the outgoing stream waits for the device's compute (the copy reads
    its output), and an arriving copy queued behind that wait would hold the next micro-batch
    back until the current one is computed.
    """
    for key in ((src, _COPY_OUT), (dst, _COPY_IN)):
        if key not in _pool:
            _pool[key] = new_stream(key[0])
    return _pool[src, _COPY_OUT], _pool[dst, _COPY_IN]


def host_copy_stream(device: torch.device) -> Stream:
    """The stream of ``device``'s copies to the host (the cache's misses), from the per-process pool; ``None``
    off CUDA. Not the hand-overs' outgoing stream: a batch's misses (tens of MB over PCIe) would hold the
    next micro-batch's hand-over to the next stage behind them."""
    key = (device, _COPY_HOST)
    if key not in _pool:
        _pool[key] = new_stream(device)
    return _pool[key]


def copy_between_devices(x: Tensor, src_device: torch.device, device: torch.device) -> Tensor:
    """``x.to(device)``; under stand-in streams, the backend sees the copy (a kernel that takes time)."""
    copy = getattr(_stand_in, "copy", None) if _stand_in is not None else None
    if copy is not None:
        copy(src_device, device)
    return x.to(device)


def host_buffer(shape: Sequence[int], dtype: torch.dtype, source: torch.device) -> Tensor:
    """Host memory for a copy from ``source``: pinned when it is a CUDA device, plain otherwise.

    Pinned because a ``non_blocking`` copy into pageable memory is a blocking one (the driver stages
    it through a pinned buffer of its own and the host waits). torch's pinned allocator keeps a
    block from reuse until the copies recorded on it completed, so freeing the buffer once its
    event is done is safe. Under stand-in streams the backend's ``host_buffer`` makes it (a test
    marks it "pinned": on a CPU-only build nothing can be pinned).
    """
    make = getattr(_stand_in, "host_buffer", None) if _stand_in is not None else None
    if make is not None:
        return make(tuple(shape), dtype)
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=source.type == "cuda")


def new_event(timing: bool = False) -> Any:
    """A device event, not yet recorded: the stand-in's under stand-in streams, else CUDA's (``timing``:
    one that can measure elapsed time, which plain events skip to stay cheap)."""
    if _stand_in is not None:
        return _stand_in.new_event()
    return torch.cuda.Event(enable_timing=timing)


def record_event(stream: Stream) -> Any:
    """An event recorded on ``stream`` now: done once everything queued there so far has run; ``None`` off CUDA."""
    if stream is None:
        return None
    event = new_event()
    event.record(stream)
    return event


def event_done(event: Any) -> bool:
    """Whether the work before ``event`` has run (never blocks); ``None`` (CPU) is always done."""
    return event is None or bool(event.query())


def event_wait(event: Any) -> None:
    """Block the host until the work before ``event`` has run; nothing to wait for on the CPU."""
    if event is not None:
        event.synchronize()
