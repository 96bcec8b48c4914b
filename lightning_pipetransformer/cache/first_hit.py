"""The first-hit check: the first hits at each boundary are recomputed and compared with what the store returned.

A key names what enters the frozen blocks (the embeddings' inputs and the blocks' arguments). If
something else feeds them (a trainable module before the stack, randomness in the forward), the
store returns a stale activation with the right key: recomputing the first hits once per boundary
shows it at the cost of one prefix run. The comparison allows what the two computations may
honestly differ by (other batch sizes pick other kernels), and no more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from lightning_pipetransformer.cache.arguments import select_rows
from lightning_pipetransformer.cache.prefix import StaleCacheError
from lightning_pipetransformer.stack.interception import BlockArgs

__all__ = ["FirstHitCheck", "prefix_convolves", "verification_tolerance"]


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
        cached = boundary[hit_mask.to(boundary.device)]
        convolutions = True if blocks is None else prefix_convolves(blocks)
        math_dtype = _fp32_math_dtype(fresh.device, convolutions=convolutions)
        rtol, atol = verification_tolerance(fresh.dtype, cached.dtype, _autocast_dtype(fresh.device), math_dtype)
        # equal_nan: a NaN computed the same way both times is the same value (a NaN input feature).
        if torch.allclose(fresh.float(), cached.float(), rtol=rtol, atol=atol, equal_nan=True):
            return None
        return StaleCacheError(
            "AutoCache returned an activation that differs from recomputing the frozen prefix: something "
            "other than the embeddings' inputs and the blocks' arguments feeds the frozen blocks (a trainable "
            "module before the stack, or randomness in the forward). Turn caching off (cache=False)."
        )


def prefix_convolves(blocks: Sequence[nn.Module]) -> bool:
    """Whether the frozen blocks hold a convolution (cuDNN's TF32 switch then counts)."""
    return any(isinstance(m, torch.nn.modules.conv._ConvNd) for block in blocks for m in block.modules())


def verification_tolerance(*dtypes: torch.dtype | None) -> tuple[float, float]:
    """``(rtol, atol)`` for comparing a cached activation with a recomputed one.

    The two were computed for batches of other sizes, and a GPU picks its kernels (and summation
    order) by shape: in fp32 they agree to ~1e-4, under bf16/fp16 (autocast or ``*-true``) or TF32
    matmuls only to a few units in the last place of the lowest precision in play. A cache fed by something other
    than its keys differs by far more.
    """
    eps = max((torch.finfo(d).eps for d in dtypes if d is not None and d.is_floating_point), default=0.0)
    if eps <= torch.finfo(torch.float32).eps:
        return 1e-3, 1e-4
    return 4 * eps, 4 * eps


#: Stands for TF32 (a 10-bit mantissa, like float16's) in the tolerance: fp32 matmuls and convolutions in TF32.
_TF32 = torch.float16


def _fp32_math_dtype(device: torch.device, convolutions: bool = False) -> torch.dtype | None:
    """The precision the frozen prefix's fp32 math really runs at: ``torch.set_float32_matmul_precision("high")``
    (which Lightning suggests on every Ampere/Hopper GPU) means TF32 matmuls, ``"medium"`` bf16.
    ``convolutions``: whether the prefix runs any; only then does ``cudnn.allow_tf32`` (True by
    default on CUDA) count: Transformer blocks run matmuls only, and counting it for them would
    loosen every fp32 check on CUDA about 40x. ``None``: full fp32."""
    precision = torch.get_float32_matmul_precision()
    if precision == "medium":
        return torch.bfloat16
    if precision == "high":
        return _TF32
    if device.type == "cuda" and (torch.backends.cuda.matmul.allow_tf32 or (convolutions and torch.backends.cudnn.allow_tf32)):
        return _TF32
    return None


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
