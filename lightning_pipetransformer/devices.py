"""Devices, streams and events: the only place the pipeline executor touches CUDA.

On CUDA every pipeline stage computes on a stream of its own, so stages overlap; a tensor
handed from one stream to another goes through :func:`hop`, which makes the receiving stream
wait on an event recorded on the sending stream and tells the caching allocator
(``record_stream``) that the tensor is now also read there, so its memory is not reused too
early. On CPU a "stream" is ``None``: every helper here is then a no-op (and :func:`hop` a plain
``Tensor.to``), so the executor runs the same code in the same order without any of it.

Streams come from a per-process pool (:func:`stage_streams`), not one set per pipeline. Two test
modes stand in for what the CPU cannot show: :func:`stand_in_streams` replaces CUDA's streams and
events by an object of the test's (timelines, counters), :class:`VirtualDevices` remembers which
tensor is on which device.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

import torch
from torch import Tensor

__all__: list[str] = []

#: A CUDA stream, or ``None`` for a CPU device (ops run in program order: nothing to order).
Stream = torch.cuda.Stream | None
Device = torch.device | str | int


def as_device(device: Device) -> torch.device:
    """``torch.device`` with an explicit index for CUDA (``"cuda"`` -> ``cuda:<current>``).

    An index-less CUDA device compares unequal to the ``cuda:0`` a tensor reports, which would
    make every call look like a cross-device copy.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


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
#: :func:`copy_stream`).
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


def release_cached_memory(device: torch.device) -> None:
    """After blocks moved between GPUs: cuBLAS's per-stream workspaces and the caching allocator's
    free blocks go back to the driver, on every GPU of this process, so that a GPU this process
    left holds nothing of it when another rank's replica is placed there. The workspaces of the
    GPUs still used are made again on their next matmul (a few MB each). Nothing to do on the CPU."""
    if device.type != "cuda":
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


#: The pool's slots of a device's two copy streams (stage streams take slots 0, 1, ...): one for
#: the copies that leave the device, one for those that arrive.
_COPY_OUT, _COPY_IN = -1, -2


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


def _same_device(a: Any, b: Any) -> bool:
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def _copy_between_devices(x: Tensor, src_device: torch.device, device: torch.device) -> Tensor:
    """``x.to(device)``; under stand-in streams, the backend sees the copy (a kernel that takes time)."""
    copy = getattr(_stand_in, "copy", None) if _stand_in is not None else None
    if copy is not None:
        copy(src_device, device)
    return x.to(device)


def _move(x: Tensor, src: Stream, dst: Stream, device: torch.device) -> Tensor:
    """Make ``x`` (ready on ``src``) usable on ``dst`` on ``device``; no autograd involved."""
    if src is not None and dst is not None and not _same_device(src.device, dst.device):
        return _move_across(x, src, dst, device)
    with use_streams(src, dst):
        # 'x' may still be being written on 'src': nothing on 'dst' may read it before that.
        wait(dst, src)
        # Same device: no copy, 'y' is 'x'. Across devices torch's copy kernel runs with
        # both current streams set above, so it is ordered against both sides.
        y = x.to(device)
        # 'x' is read on 'dst' (same device) or by the copy on 'src': keep its memory alive.
        record(x, src, dst)
    return y


def _move_across(x: Tensor, src: Stream, dst: Stream, device: torch.device) -> Tensor:
    """A hand-over between devices, on the two devices' copy streams.

    torch runs a copy between GPUs on the source device's current stream, after both devices'
    current streams' earlier work, and makes the destination's current stream wait for it. With
    the copy streams current, that is: the copy waits for ``x``'s producer (``src``) and earlier
    copies only, and ``dst`` waits for the copy; the producer's next micro-batch does not.
    """
    src_copy, dst_copy = copy_streams(src.device, device)
    with use_streams(src_copy, dst_copy):
        wait(src_copy, src)  # the copy reads 'x' once its producer wrote it
        y = _copy_between_devices(x, src.device, device)
        record(x, src_copy)  # read by the copy: not reused on 'src' before it is done
    wait(dst, dst_copy)  # the consumer reads 'y' once copied
    record(y, dst)  # made on the copy stream, read on 'dst'
    return y


class _Hop(torch.autograd.Function):
    """Hand a tensor from one stream (and device) to another; gradients take the way back."""

    @staticmethod
    def forward(ctx: Any, src: Stream, dst: Stream, device: torch.device, x: Tensor) -> Tensor:
        # The producer's device: where the gradient goes back to (its stream's, which stand-in streams keep apart on CPU).
        ctx.src, ctx.dst, ctx.src_device = src, dst, src.device if src is not None else x.device
        y = _move(x, src, dst, device)
        # Same device: 'y' is 'x'. Returned as is, autograd would make it a view created in a
        # custom Function, and an in-place op on a stage's input would raise (torchgpipe's Wait
        # returns detached tensors for the same reason).
        return y.detach() if y is x else y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None, Tensor]:
        # The gradient is produced on 'dst' (autograd runs each backward op on the stream of
        # its forward op) and consumed by ops that ran on 'src' in the forward.
        return None, None, None, _move(grad, ctx.dst, ctx.src, ctx.src_device)


def hop(x: Tensor, src: Stream, dst: Stream, device: torch.device) -> Tensor:
    """``x`` (produced on stream ``src``) made ready for stream ``dst`` on ``device``.

    CPU to CPU this is ``x.to(device)``, i.e. ``x`` itself: no copy and no autograd node.
    """
    if src is None and dst is None:
        return x.to(device)
    if x.requires_grad and torch.is_grad_enabled():
        # Called with 'dst' current so autograd records 'dst' as this node's stream.
        with use_stream(dst):
            return _Hop.apply(src, dst, device, x)
    return _move(x, src, dst, device)


# ---------------------------------------------------------------------------------- placement

#: Test mode (see :class:`VirtualDevices`); ``None`` in production, where every hook below is a
#: plain ``Module.to`` / ``Tensor.to`` or nothing.
_virtual: VirtualDevices | None = None


class VirtualDeviceError(RuntimeError):
    """What a real multi-device run would have failed with, caught on CPU by :class:`VirtualDevices`."""


def virtual_mode() -> bool:
    """Whether the :class:`VirtualDevices` test mode is on."""
    return _virtual is not None


def device_of(tensor: Tensor) -> torch.device:
    """Where ``tensor`` is: its device, or in the test mode the virtual device it was placed on."""
    return _virtual.device_of(tensor) if _virtual is not None else tensor.device


def tag_as(tensor: Tensor, device: torch.device) -> None:
    """Test mode: ``tensor`` was made on ``device`` (a buffer for a collective)."""
    if _virtual is not None:
        _virtual.tag(tensor, device)


def place_module(module: torch.nn.Module, device: torch.device) -> None:
    """Move ``module`` to ``device`` (``Module.to``: its parameters keep their identity)."""
    module.to(device)
    if _virtual is not None:
        _virtual.placed(module, device)


def place_outside(root: torch.nn.Module, blocks: list[torch.nn.Module], device: torch.device) -> None:
    """Move everything in ``root`` but ``blocks`` to ``device``, each module by its own ``_apply``.

    A subtree without a block moves as ``Module.to`` moves it (overrides of ``_apply`` included:
    torchmetrics' states, a module that caches its device); an ancestor of the blocks moves only
    its own parameters and buffers (``_apply(recurse=False)``), so the blocks stay where they are.
    """
    inside = {id(m) for block in blocks for m in block.modules()}
    above = {id(m) for m in root.modules() if id(m) not in inside and any(id(c) in inside for c in m.modules())}

    def move(module: torch.nn.Module) -> None:
        if id(module) in inside:
            return
        if id(module) not in above:
            place_module(module, device)
            return
        _apply_own(module, lambda t: t.to(device))
        if _virtual is not None:
            for tensor in [*module._parameters.values(), *module._buffers.values()]:
                if tensor is not None:
                    _virtual.tag(tensor, device)
        for child in module.children():
            move(child)

    move(root)


def _apply_own(module: torch.nn.Module, fn: Any) -> None:
    """``module._apply(fn, recurse=False)``; an override without ``recurse`` gets the base version."""
    import inspect

    if "recurse" in inspect.signature(module._apply).parameters:
        module._apply(fn, recurse=False)
    else:
        torch.nn.Module._apply(module, fn, recurse=False)


def move_state(value: Tensor, param: Tensor) -> Tensor:
    """An optimizer-state tensor moved to its parameter's device."""
    moved = value.to(param.device)
    if _virtual is not None:
        _virtual.tag(moved, _virtual.device_of(param))
    return moved


def before_wrap(params: list[Tensor], root: torch.device) -> None:
    """DDP is about to wrap ``params`` on ``root``: they must all be there, and stay there."""
    if _virtual is not None:
        _virtual.wrapping(params, root)


def after_unwrap() -> None:
    """The DDP wrapper was dropped: its parameters may move again."""
    if _virtual is not None:
        _virtual.wrapped.clear()


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Before a step: every state tensor is on its parameter's device (test mode only)."""
    if _virtual is not None:
        _virtual.check_optimizer(optimizer)


def bind_process_device(device: torch.device) -> None:
    """The process's own device: its process groups are bound to it (Lightning's ``device_id``)."""
    if _virtual is not None:
        _virtual.process_device = device


def check_collective(tensor: Tensor, what: str) -> None:
    """Before a collective: the tensor is on the process's own device (test mode only)."""
    if _virtual is not None:
        _virtual.check_collective(tensor, what)


class VirtualDevices:
    """Test mode: CPU "devices" ``cpu:0``, ``cpu:1`` ... that remember which tensor is where.

    On CPU every device is the same memory, so the mistakes a multi-GPU run fails on pass
    silently: DDP bound to parameters that are moved afterwards, optimizer state left on a device
    its parameter left, a collective on a tensor that is not on the process's own device (NCCL
    groups are bound to it). In this mode each parameter, buffer and moved optimizer-state
    tensor carries the virtual device it was placed on (``torch.device("cpu", i)``, which
    compares unequal to ``cpu:j`` although the memory is the same), and the hooks above raise
    :class:`VirtualDeviceError` where the GPU run would fail. Used by tests only::

        with VirtualDevices():
            trainer = Trainer(strategy=PipeTransformerStrategy(parallel_devices=[torch.device("cpu", i) ...]))
    """

    def __init__(self) -> None:
        # id(tensor) -> (tensor ref, device). An id is reused once its tensor dies, so every lookup
        # checks the reference: a stale entry must never speak for a new tensor at the same address.
        self._where: dict[int, tuple[Any, torch.device]] = {}
        self.wrapped: dict[int, tuple[Any, torch.device]] = {}  # id(param) -> (param ref, the device DDP saw it on)
        self.process_device: torch.device | None = None  # set by the strategy (bind_process_device)

    def __enter__(self) -> VirtualDevices:
        global _virtual
        self._previous, _virtual = _virtual, self
        return self

    def __exit__(self, *exc: Any) -> None:
        global _virtual
        _virtual = self._previous

    def tag(self, tensor: Tensor, device: torch.device) -> None:
        self._where[id(tensor)] = (weakref.ref(tensor), device)

    @staticmethod
    def _live(table: dict[int, tuple[Any, torch.device]], tensor: Tensor) -> torch.device | None:
        found = table.get(id(tensor))
        return found[1] if found is not None and found[0]() is tensor else None

    def tagged(self, tensor: Tensor) -> bool:
        return self._live(self._where, tensor) is not None

    def device_of(self, tensor: Tensor) -> torch.device:
        where = self._live(self._where, tensor)
        return tensor.device if where is None else where  # never placed: where torch says it is

    def live_bytes(self, device: torch.device) -> int:
        """Bytes of the memory held by tensors tagged on ``device`` that are still alive (staging
        buffers, for a test's bound): each storage once, however many views of it are tagged."""
        storages: dict[int, int] = {}
        for ref, where in list(self._where.values()):
            tensor = ref()
            if tensor is not None and where == device:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def placed(self, module: torch.nn.Module, device: torch.device) -> None:
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            seen = self._live(self.wrapped, tensor)
            if seen is not None and seen != device:
                raise VirtualDeviceError(
                    f"{name} moved from {seen} to {device} after DDP wrapped it: DDP's hooks and buckets stay on the "
                    "old storage (on GPU: 'Expected to have finished reduction', or silently unsynchronised gradients)."
                )
            self.tag(tensor, device)

    def wrapping(self, params: list[Tensor], root: torch.device) -> None:
        for param in params:
            where = self.device_of(param)
            if where != root:
                raise VirtualDeviceError(f"DDP wraps a parameter on {where}, not on the process's device {root}.")
            self.wrapped[id(param)] = (weakref.ref(param), where)

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        for param, state in optimizer.state.items():
            home = self.device_of(param)
            for key, value in state.items():
                if not isinstance(value, Tensor) or (key == "step" and value.dim() == 0 and not self.tagged(value)):
                    continue
                if not self.tagged(value):  # made by the optimizer next to its parameter
                    self.tag(value, home)
                elif self.device_of(value) != home:
                    raise VirtualDeviceError(
                        f"Optimizer state '{key}' is on {self.device_of(value)} but its parameter on {home}: the first "
                        "step after the move fails on GPU (and the state occupies a device this process left)."
                    )

    def check_collective(self, tensor: Tensor, what: str) -> None:
        root = self.process_device
        where = self.device_of(tensor)
        if root is not None and where != root:
            raise VirtualDeviceError(
                f"{what}: a collective on a tensor on {where}, but this process's groups are bound to {root} "
                "(NCCL refuses tensors on other devices)."
            )


def optimizer_state_to_param_devices(optimizers: list[torch.optim.Optimizer]) -> None:
    """Each optimizer-state tensor to its parameter's device (after a checkpoint load, a state
    transfer, or a plan that moved blocks between devices)."""
    for optimizer in optimizers:
        on_device_step = {
            id(p) for group in optimizer.param_groups if group.get("capturable") or group.get("fused") for p in group["params"]
        }
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                # 'step' stays on the CPU unless the optimizer runs it on the device (capturable, fused).
                if key == "step" and id(param) not in on_device_step:
                    continue
                if value.device != param.device or virtual_mode():
                    state[key] = move_state(value, param)
