"""Stand-in values that must never reach a block: the one check every path that runs a block makes.

AutoCache skips the embeddings on batches it serves: the model's forward then gets a NaN tensor
of the right shape from them (:mod:`~lightning_pipetransformer.cache.embedding_skip`), and the
cached stack runs the real embeddings for the rows it must compute. If any path ran a block on
that stand-in instead (the cache standing aside for a batch, a hook changing it, a runner that
does not know about it), training would silently go on NaN. So the stand-in is made here, marked,
and every place that runs a block (:func:`~.interception.call_block`, the pipeline's entry, the
interception of the model's own block calls) refuses a marked tensor with :class:`PlaceholderError`.
A convention would hold until the next path is added; a check that raises holds for every path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["PlaceholderError", "is_placeholder", "make_placeholder", "refuse_placeholder"]

_MARK = "_pipetransformer_placeholder"


class PlaceholderError(RuntimeError):
    """A block was about to run on a stand-in value (the skipped embeddings' NaN placeholder)."""


def make_placeholder(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A NaN tensor of ``shape`` marked as a stand-in (never uninitialised memory: arithmetic on it shows NaN).

    A normal tensor even under ``inference_mode``, so that its version counter tracks in-place changes.
    """
    with torch.inference_mode(False):
        placeholder = torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
    setattr(placeholder, _MARK, True)
    return placeholder


def is_placeholder(value: Any) -> bool:
    """Whether ``value`` is a stand-in made by :func:`make_placeholder`."""
    return isinstance(value, Tensor) and getattr(value, _MARK, False)


def refuse_placeholder(value: Any, where: str) -> None:
    """Raise :class:`PlaceholderError` if ``value`` is a stand-in; ``where`` names the block about to run."""
    if is_placeholder(value):
        raise PlaceholderError(
            f"{where} was about to run on the skipped embeddings' placeholder (NaN) instead of their real output. "
            "This is a bug in strategy='pipetransformer' (every path must compute the real embeddings where the "
            "cache does not serve a batch): please report it with your model. To go on meanwhile, pass "
            "cache_skip_embeddings=False to the strategy."
        )
