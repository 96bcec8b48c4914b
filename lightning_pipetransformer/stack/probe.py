"""The probe: the first pass over a stack also runs its blocks, without a graph, to learn what they return.

What that run changes must be put back before the runner's pass (:class:`Probe`: the random-number
state and the blocks' buffers), and it must run each block where its weights are
(:func:`block_device`). The self-check (:mod:`~.self_check`) runs the plain loop beside the
runner's pass the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["Probe", "block_device"]


class Probe:
    """What running the blocks once to learn their outputs must leave untouched: RNG state and buffers."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        cuda = sorted({t.device.index for b in blocks for t in (*b.parameters(), *b.buffers()) if t.is_cuda})
        self._cpu = torch.get_rng_state()
        self._cuda = [(d, torch.cuda.get_rng_state(d)) for d in cuda]
        self._buffers = [(t, t.detach().clone()) for b in blocks for t in b.buffers()]

    def restore(self) -> None:
        torch.set_rng_state(self._cpu)
        for device, state in self._cuda:
            torch.cuda.set_rng_state(state, device)
        with torch.no_grad():
            for buffer, saved in self._buffers:
                # Only what changed: an in-place copy bumps a buffer's version, and a graph built since
                # (the self-check restores after the runner's pass) may have saved it (Swin's index buffers).
                if not torch.equal(buffer, saved):
                    buffer.copy_(saved)


def block_device(block: nn.Module, default: torch.device) -> torch.device:
    """Where ``block``'s weights are (its first parameter, else buffer); ``default`` for a block without any."""
    for tensor in block.parameters():
        return tensor.device
    for tensor in block.buffers():
        return tensor.device
    return default
