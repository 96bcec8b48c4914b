"""Devices: every CUDA stream, event and ``record_stream`` (no-ops on CPU), and where tensors are placed.

One module per idea: :mod:`~.streams` (streams, events, the per-process pool, the stand-in for
tests), :mod:`~.handover` (the cross-device hop between stages), :mod:`~.placement` (moves, and the
checks a multi-GPU run makes), :mod:`~.timing` (device time of a region: events, or the host clock
off CUDA) and :mod:`~.virtual` (the test-only ``VirtualDevices``). This face
hands on each module's public names (its ``__all__``), so that callers keep one short import:
``from lightning_pipetransformer import devices as dev``.
"""

from lightning_pipetransformer.devices import handover, placement, streams, timing, virtual
from lightning_pipetransformer.devices.handover import *  # noqa: F403
from lightning_pipetransformer.devices.placement import *  # noqa: F403
from lightning_pipetransformer.devices.streams import *  # noqa: F403
from lightning_pipetransformer.devices.timing import *  # noqa: F403
from lightning_pipetransformer.devices.virtual import *  # noqa: F403

__all__ = [*streams.__all__, *handover.__all__, *placement.__all__, *timing.__all__, *virtual.__all__]
