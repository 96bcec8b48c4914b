"""The first-hit check: the first hits at each boundary are recomputed and compared with what the store returned.

A key names what enters the frozen blocks (the embeddings' inputs and the blocks' arguments). If
something else feeds them (a trainable module before the stack, randomness in the forward), the
store returns a stale activation with the right key: recomputing the first hits once per boundary
shows it at the cost of one prefix run. The comparison allows what the two computations may
honestly differ by (other batch sizes pick other kernels, at the precision in play:
:mod:`~lightning_pipetransformer.stack.tolerance`), and no more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from lightning_pipetransformer.cache.arguments import select_rows
from lightning_pipetransformer.cache.prefix import StaleCacheError
from lightning_pipetransformer.cache.rows import take_rows
from lightning_pipetransformer.stack.stack_call import BlockArgs
from lightning_pipetransformer.stack.tolerance import precisions_in_play, verification_tolerance

__all__ = ["FirstHitCheck"]


class FirstHitCheck:
    """Recompute the first hits of a boundary once; :meth:`reset` when a new boundary opens."""

    def __init__(self) -> None:
        self.done = False

    def reset(self) -> None:
        self.done = False

    def check(
        self, rows: Callable[[Tensor], Tensor], calls: Sequence[BlockArgs], hit_mask: Tensor, boundary: Tensor,
        prefix: Callable[[Tensor, Sequence[BlockArgs]], Tensor], blocks: Sequence[nn.Module] | None,
    ) -> StaleCacheError | None:
        """The error to raise if the store's rows of ``boundary`` differ from recomputing them (the first time only).

        ``rows(mask)``: the input of the frozen blocks for the rows in ``mask``; ``blocks``: the frozen
        blocks (``None``: unknown, the looser tolerance).
        """
        if self.done:
            return None
        self.done = True
        with torch.no_grad():
            fresh = prefix(rows(hit_mask), select_rows(calls, hit_mask, hit_mask.numel()))
        cached = take_rows(boundary, hit_mask)
        # The precision the prefix really computed at (autocast, TF32): the shared rule of stack/tolerance.py.
        rtol, atol = verification_tolerance(fresh.dtype, cached.dtype, *precisions_in_play(fresh.device, blocks))
        # equal_nan: a NaN computed the same way both times is the same value (a NaN input feature).
        if torch.allclose(fresh.float(), cached.float(), rtol=rtol, atol=atol, equal_nan=True):
            return None
        return StaleCacheError(
            "AutoCache returned an activation that differs from recomputing the frozen prefix: something "
            "other than the embeddings' inputs and the blocks' arguments feeds the frozen blocks (a trainable "
            "module before the stack, or randomness in the forward), or the frozen weights were written through "
            "param.data inside a training epoch (unseen by version counters until the next pass start: write them "
            "under torch.no_grad() instead). Turn caching off (cache=False) if the forward itself is the cause."
        )
