"""What a batch missed, copied from the device to the host without the step waiting for it.

A miss's activation (and the block inputs stored with it) leaves the device once, to become an
entry. A plain ``tensor.to("cpu")`` there blocks the host until the device has computed the
activation and copied it through the driver's own pinned staging buffer. :func:`start_host_copy`
instead:

1. casts on the device, on the producer's stream, to the storage dtype (fewer bytes cross the bus),
   and makes a private device copy where the copy is asynchronous (``copy=True``): the compute
   stream's later kernels may write the caller's tensor in place while the copy still reads it;
2. lets the device's copy stream to the host (:func:`~lightning_pipetransformer.devices.streams.host_copy_stream`)
   wait for the producer, and copies into pinned host memory with ``non_blocking=True`` there;
3. tells the caching allocator that the copy stream reads the device copy (``record``: its memory
   is not handed to other work before the copy ran, though this module drops it at once), and
   records an event on the copy stream after the copies.

The :class:`HostCopy` it returns hands its host tensors out only once every event completed
(:meth:`HostCopy.ready`, :meth:`HostCopy.wait`); before that :meth:`HostCopy.host` raises
:class:`IncompleteCopyError`: a non-blocking copy is not done when the call returns, and a buffer
read early holds whatever the memory held before. The buffers belong to the copy until then (the
store drops them after taking its rows, and torch's pinned allocator reuses a block only after the
copies recorded on it completed).

On the CPU the streams are ``None``: no wait, no private copy, the "buffer" is the tensor itself
(already host memory) and the copy is done at once. The code path is the same; under stand-in
streams (:func:`~lightning_pipetransformer.devices.streams.stand_in_streams`) a test sees every step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_pipetransformer.devices import streams

__all__ = ["HostCopy", "IncompleteCopyError", "start_host_copy"]



class IncompleteCopyError(RuntimeError):
    """A host buffer was about to be read before the device finished copying into it."""


class HostCopy:
    """Host tensors being filled from the device: read them only once :meth:`ready` or :meth:`wait` said so.

    The device copies are not held here: ``record`` told the allocator that the copy stream reads
    them, so dropping them frees their memory for new work only once the copy ran, and a batch's
    misses do not stay on the device until the next step looks.
    """

    def __init__(self, hidden: Tensor, extras: dict[str, Tensor], events: list[Any]) -> None:
        self._hidden = hidden
        self._extras = extras
        self._events = events
        self._done = not events

    @property
    def nbytes(self) -> int:
        """Host bytes held by the buffers (pinned on CUDA)."""
        return self._hidden.nbytes + sum(t.nbytes for t in self._extras.values())

    def ready(self) -> bool:
        """Whether every copy has run (never blocks)."""
        if not self._done and all(streams.event_done(e) for e in self._events):
            self._done = True
        return self._done

    def wait(self) -> None:
        """Block the host until every copy has run."""
        if not self._done:
            for event in self._events:
                streams.event_wait(event)
            self._done = True

    def host(self) -> tuple[Tensor, dict[str, Tensor]]:
        """The host tensors ``(hidden, extras)``; :class:`IncompleteCopyError` while a copy may still run."""
        if not self._done:
            raise IncompleteCopyError(
                "A device-to-host copy of cache entries was read before its event completed: the buffer may still "
                "hold what the memory held before. Call ready() or wait() first."
            )
        return self._hidden, self._extras


def start_host_copy(activations: Tensor, dtype: torch.dtype, extras: Mapping[str, Tensor]) -> HostCopy:
    """Start copying ``activations`` (cast to ``dtype`` on its device) and ``extras`` (their own dtype) to the host.

    Returns at once on an accelerator; see the module docstring for the order of the steps.
    """
    wanted = {"": (activations, dtype), **{name: (t, t.dtype) for name, t in extras.items()}}
    host: dict[str, Tensor] = {}
    used: list[Any] = []  # the copy streams, in first-use order (an event on each)
    for name, (tensor, to) in wanted.items():
        device = tensor.device
        stream = streams.host_copy_stream(device)
        # On the producer's stream: the cast on the device, and (asynchronous copy) a private copy.
        source = tensor.detach().to(dtype=to, copy=stream is not None)
        if stream is None:  # a CPU tensor, no stand-in: already host memory, nothing to order
            host[name] = source
            continue
        streams.wait(stream, streams.current_stream(device))
        buffer = streams.host_buffer(source.shape, to, device)
        with streams.use_stream(stream):
            buffer.copy_(source, non_blocking=True)
        streams.record(source, stream)
        host[name] = buffer
        if stream not in used:
            used.append(stream)
    events = []
    for stream in used:
        with streams.use_stream(stream):
            events.append(streams.record_event(stream))
    hidden = host.pop("")
    return HostCopy(hidden, host, events)
