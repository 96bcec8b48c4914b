"""The frozen prefix, one batch at a time: what AutoCache and the cached stack both use.

Running the frozen blocks (:func:`run_blocks`), the index keys' view of the blocks' arguments
(:func:`with_block_arguments`), the error raised when a cached activation is stale and how
refusals reach every rank (:class:`Verdicts`).
:mod:`~lightning_pipetransformer.cache.autocache` and :mod:`~lightning_pipetransformer.cache.cached_stack`
import this module; it imports neither.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from lightning_pipetransformer import tree
from lightning_pipetransformer.cache.arguments import shared_once
from lightning_pipetransformer.cache.keys import content_keys
from lightning_pipetransformer.stack.interception import call_block
from lightning_pipetransformer.stack.stack_call import BlockArgs, hidden_of

__all__ = ["StaleCacheError", "Verdicts", "run_blocks", "with_block_arguments"]

class StaleCacheError(RuntimeError):
    """A cached activation differs from the recomputed one: caching cannot be exact for this model."""


class Verdicts:
    """The cache's refusals (a stale activation, a repeated index): raised now, or kept for the step's end.

    With several processes (``defer``), a verdict one rank alone reaches must not skip the
    collectives the others are in (DDP's buffer broadcast in the forward): the step finishes,
    computing without the cache, and the strategy raises it on every rank together (:meth:`take`).
    """

    def __init__(self) -> None:
        self.defer = False
        #: The first refusal kept during this step; the cache computes, never guesses, while one waits.
        self.pending: Exception | None = None

    def refuse(self, error: Exception) -> None:
        if not self.defer:
            raise error
        if self.pending is None:
            self.pending = error

    def take(self) -> Exception | None:
        """The refusal kept during this step, if any (and forget it)."""
        verdict, self.pending = self.pending, None
        return verdict


def run_blocks(blocks: Sequence[nn.Module]) -> Callable[[Tensor, Sequence[BlockArgs]], Tensor]:
    """``run(hidden, calls)`` = the model's loop over ``blocks``, block ``i`` with ``calls[i]``; returns the hidden state."""

    def run(hidden: Tensor, calls: Sequence[BlockArgs]) -> Tensor:
        for block, (args, kwargs) in zip(blocks, calls, strict=True):
            hidden = hidden_of(call_block(block, hidden, *args, **kwargs))
        return hidden

    return run


def with_block_arguments(keys: list[str], calls: Sequence[BlockArgs], device: torch.device) -> list[str] | None:
    """Index keys plus a fingerprint of the blocks' other arguments (attention masks, flags).

    An index names the sample's input (one view of it, reused); the mask the blocks get with it
    may still change (a shuffled batch, other padding). Hashed in, a changed mask misses instead
    of pairing the active blocks' mask with a boundary computed under another.
    """
    # A row per sample, even with no per-sample argument; on the host when no argument is a tensor,
    # so that such keys are made without waiting for the device.
    on = device if tree.tensors(calls) else torch.device("cpu")
    rows = torch.zeros(len(keys), 1, dtype=torch.uint8, device=on)
    try:
        extras = content_keys(rows, shared_once(calls, len(keys)), batch_size=len(keys))
    except TypeError:
        return None  # an argument we cannot hash reliably: compute, never guess
    return [f"{key}-{extra}" for key, extra in zip(keys, extras)]
