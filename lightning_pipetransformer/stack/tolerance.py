"""How closely two computations of the same blocks must agree: as closely as the math actually used allows.

Two checks compare one computation of blocks with another: the cache's first-hit check (a stored
activation against the frozen prefix run again, :mod:`~lightning_pipetransformer.cache.first_hit`)
and the first-batch self-check (the runner's pass against the plain loop, :mod:`~.self_check`).
Each pair ran at other batch shapes, and a GPU picks its kernels (and their summation order) by
shape, so the two agree only to the lowest precision in play: the tensors' dtypes, autocast's
(``bf16-mixed``, ``16-mixed``), and the precision fp32 math really runs at (TF32 or bf16 matmuls
under ``torch.set_float32_matmul_precision``, which Lightning suggests on every Ampere/Hopper GPU;
cuDNN's TF32 for convolutions). A tolerance read from the output's dtype alone refuses exact runs
there: a Transformer block's output is fp32 (residual, layer norm) while its matmuls ran in bf16
or TF32. Both checks read the precision in play here, so that one rule serves both.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = [
    "TF32", "autocast_dtype", "convolves", "fp32_math_dtype", "lowest_precision", "precisions_in_play", "verification_tolerance",
]

#: Stands for TF32 (a 10-bit mantissa, like float16's) in a tolerance: fp32 matmuls and convolutions in TF32.
TF32 = torch.float16


def convolves(blocks: Sequence[nn.Module]) -> bool:
    """Whether ``blocks`` hold a convolution (cuDNN's TF32 switch then counts)."""
    return any(isinstance(m, torch.nn.modules.conv._ConvNd) for block in blocks for m in block.modules())


def fp32_math_dtype(device: torch.device, convolutions: bool = False) -> torch.dtype | None:
    """The precision fp32 math on ``device`` really runs at: ``torch.set_float32_matmul_precision("high")``
    means TF32 matmuls, ``"medium"`` bf16.

    ``convolutions``: whether the blocks run any; only then does ``cudnn.allow_tf32`` (True by
    default on CUDA) count: Transformer blocks run matmuls only, and counting it for them would
    loosen every fp32 check on CUDA about 40x. ``None``: full fp32.
    """
    precision = torch.get_float32_matmul_precision()
    if precision == "medium":
        return torch.bfloat16
    if precision == "high":
        return TF32
    if device.type == "cuda" and (torch.backends.cuda.matmul.allow_tf32 or (convolutions and torch.backends.cudnn.allow_tf32)):
        return TF32
    return None


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast runs ``device``'s eligible ops in right now, or ``None`` when it is off."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def precisions_in_play(device: torch.device, blocks: Sequence[nn.Module] | None) -> tuple[torch.dtype | None, torch.dtype | None]:
    """``(autocast's dtype, fp32 math's dtype)`` for blocks computing on ``device`` now.

    ``blocks=None``: unknown blocks, counted as running convolutions (the looser tolerance).
    """
    return autocast_dtype(device), fp32_math_dtype(device, convolutions=True if blocks is None else convolves(blocks))


def lowest_precision(*dtypes: torch.dtype | None) -> torch.dtype | None:
    """The floating dtype of ``dtypes`` with the fewest mantissa bits (the largest ``eps``); ``None`` if none is floating."""
    floating = [d for d in dtypes if d is not None and d.is_floating_point]
    return max(floating, key=lambda d: torch.finfo(d).eps, default=None)


def verification_tolerance(*dtypes: torch.dtype | None) -> tuple[float, float]:
    """``(rtol, atol)`` for comparing a cached activation with a recomputed one.

    The two were computed for batches of other sizes, and a GPU picks its kernels (and summation
    order) by shape: in fp32 they agree to ~1e-4, under bf16/fp16 (autocast or ``*-true``) or TF32
    matmuls only to a few units in the last place of the lowest precision in play. A cache fed by something other
    than its keys differs by far more.
    """
    lowest = lowest_precision(*dtypes)
    eps = torch.finfo(lowest).eps if lowest is not None else 0.0
    if eps <= torch.finfo(torch.float32).eps:
        return 1e-3, 1e-4
    return 4 * eps, 4 * eps
