"""Sample keys for the activation cache: a 128-bit content fingerprint per row, or the dataset index.

Two kinds of key (``cache_key=`` on the strategy):

``"content"`` (the default)
    A fingerprint of everything that enters the frozen prefix for one sample (its token ids,
    attention mask, pixels ...). It is computed on the tensors' own device for a whole batch at
    once and only 16 bytes per sample cross to the host. It is exact: a sample whose inputs
    differ in one token or one pixel gets another key, so a random augmentation simply misses
    (the augmented view is computed, stored, and rarely seen again) and training is unchanged.
``"index"``
    The dataset index the caller supplies (the paper's choice). Cheaper to get, but with random
    augmentation the first augmented view of a sample is cached and then reused every epoch:
    the frozen prefix sees one fixed view, which *changes training*. Use it only when the inputs
    of a sample never change between epochs, or when that reuse is what you want.

The default is ``"content"`` because it is correct without knowing anything about the data
pipeline, and its cost is a few element-wise passes over the *inputs* (a batch of 32 x 64 token
ids is 2,048 numbers, far cheaper than one Transformer block); see ``docs/cache.md``.

How the content hash works (per tensor, per row)::

    word_i   = the row's raw bits as 32-bit words (fp32/int32: 1 per element, int64/fp64: 2,
               fp16/bf16: 1, bool/uint8: 1), so -0.0 != 0.0 and NaN payloads count
    h(row)   = sum_i mix(word_i | i << 32  XOR seed)   (mod 2**64)

``mix`` is a bijective 64-bit finalizer (two of them: splitmix64's and murmur3's, with their own
seeds, give the two 64-bit halves of the key). Because ``mix`` is a bijection and ``(word, i)``
is packed without loss, two rows that differ in exactly one element *always* differ in ``h``;
rows that differ in more elements collide with probability about 2**-128. Integer sums wrap and
are associative, so the key does not depend on the device, the reduction order or chunking.
Tensors are combined with a salt made of their position in the batch structure, dtype and
per-row shape; non-batch tensors (shared by all rows) and plain values (None, bool, int, float,
str) enter every row's key.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_pipetransformer.cache.arguments import leaves as nested_leaves

__all__ = [
    "CacheKey",
    "DEFAULT_CACHE_KEY",
    "KEY_PATTERN",
    "content_keys",
    "index_keys",
    "row_hashes",
    "tensor_digest",
]

CacheKey = Literal["content", "index"]
DEFAULT_CACHE_KEY: CacheKey = "content"

# Keys become file names: letters, digits, '_', '-' and '.', not starting with '.'.
KEY_PATTERN = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")

_M64 = (1 << 64) - 1
# Seeds and multipliers as signed int64 (torch has no uint64 arithmetic): wrapping multiply.


def _signed(x: int) -> int:
    x &= _M64
    return x - (1 << 64) if x >= 1 << 63 else x


_SEED_A = _signed(0x9E3779B97F4A7C15)
_SEED_B = _signed(0xD1B54A32D192ED03)
_SPLITMIX = (_signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB))
_MURMUR = (_signed(0xFF51AFD7ED558CCD), _signed(0xC4CEB9FE1A85EC53))
# Bound temporaries when hashing one large tensor (parameters): words per chunk.
_CHUNK_WORDS = 1 << 22


def _lsr(z: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic and would smear the sign)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix_a(z: Tensor) -> Tensor:
    z = z ^ _lsr(z, 30)
    z = z * _SPLITMIX[0]
    z = z ^ _lsr(z, 27)
    z = z * _SPLITMIX[1]
    return z ^ _lsr(z, 31)


def _mix_b(z: Tensor) -> Tensor:
    z = z ^ _lsr(z, 33)
    z = z * _MURMUR[0]
    z = z ^ _lsr(z, 33)
    z = z * _MURMUR[1]
    return z ^ _lsr(z, 33)


_VIEW_BY_SIZE = {1: (torch.uint8, 0xFF), 2: (torch.int16, 0xFFFF), 4: (torch.int32, 0xFFFFFFFF)}


def _words(rows: Tensor) -> Tensor:
    """``[B, ...]`` -> ``[B, n]`` int64 holding the rows' raw bits as unsigned 32-bit-or-less words."""
    t = rows.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    t = t.reshape(t.shape[0], -1).contiguous()
    size = t.element_size()
    if size == 8:
        t, size = t.view(torch.int32), 4  # two words per element (needs the contiguous last dim)
    if size not in _VIEW_BY_SIZE:
        raise TypeError(f"Cannot hash a tensor of dtype {rows.dtype} (element size {rows.element_size()}).")
    view, mask = _VIEW_BY_SIZE[size]
    return t.view(view).to(torch.int64) & mask


def _hash_words(words: Tensor, offset: int = 0) -> tuple[Tensor, Tensor]:
    """Two 64-bit sums over positions ``offset..offset+n`` of ``[B, n]`` words -> two ``[B]``."""
    n = words.shape[1]
    if offset + n >= 1 << 32:
        raise ValueError("A row of more than 2**32 words cannot be hashed exactly: split it.")
    pos = torch.arange(offset, offset + n, device=words.device, dtype=torch.int64) << 32
    packed = words | pos  # lossless: word < 2**32, position in the high half
    return _mix_a(packed ^ _SEED_A).sum(dim=1), _mix_b(packed ^ _SEED_B).sum(dim=1)


def row_hashes(rows: Tensor) -> Tensor:
    """Per-row 128-bit hash of ``rows`` (``[B, ...]``) as ``[B, 2]`` int64 on the rows' device."""
    if rows.dim() == 0:
        rows = rows.reshape(1)
    words = _words(rows)
    if words.shape[1] <= _CHUNK_WORDS:
        a, b = _hash_words(words)
    else:
        # Sums are associative mod 2**64: chunks with global positions give the same hash.
        a = torch.zeros(words.shape[0], dtype=torch.int64, device=words.device)
        b = torch.zeros_like(a)
        for start in range(0, words.shape[1], _CHUNK_WORDS):
            ca, cb = _hash_words(words[:, start : start + _CHUNK_WORDS], start)
            a, b = a + ca, b + cb
    return torch.stack((a, b), dim=1)


def tensor_digest(tensor: Tensor) -> bytes:
    """16 bytes fingerprinting a whole tensor (dtype, shape and bits), hashed on its device."""
    h = row_hashes(tensor.reshape(1, -1)).cpu()[0].tolist()
    meta = f"{tensor.dtype}|{tuple(tensor.shape)}".encode()
    return hashlib.blake2b(meta + b"".join(int(v & _M64).to_bytes(8, "little") for v in h), digest_size=16).digest()


def _salt(*parts: object) -> int:
    digest = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).digest()
    return _signed(int.from_bytes(digest, "little"))


def content_keys(*values: Any, batch_size: int | None = None) -> list[str]:
    """One 32-hex-digit content key per sample of a batch.

    Args:
        values: the batch, in any nesting of tuples, lists and dicts (the LightningModule's
            ``batch``, or ``(hidden, args, kwargs)`` as a block receives them). Tensors whose
            first dimension is the batch size are hashed per row; other tensors, and plain
            values (None, bool, int, float, str), enter every row's key.
        batch_size: the number of samples; default: the first dimension of the first tensor.

    Raises:
        TypeError: a leaf of another type (it could change the activation and cannot be hashed
            reliably: pass only what enters the frozen prefix).
        ValueError: no tensor to take the batch size from.
    """
    leaves = list(nested_leaves(values, "batch"))
    tensors = [(p, v) for p, v in leaves if isinstance(v, Tensor)]
    if batch_size is None:
        first = next((v for _, v in tensors if v.dim() > 0), None)
        if first is None:
            raise ValueError("content_keys needs a tensor with a batch dimension, or batch_size=.")
        batch_size = int(first.shape[0])
    host_salt = 0
    per_row: list[Tensor] = []
    shared: list[Tensor] = []
    for path, value in leaves:
        if isinstance(value, Tensor):
            if value.dim() > 0 and value.shape[0] == batch_size:
                salt = _salt(path, value.dtype, tuple(value.shape[1:]), "rows")
                per_row.append(_combine(row_hashes(value), salt))
            else:
                salt = _salt(path, value.dtype, tuple(value.shape), "whole")
                shared.append(_combine(row_hashes(value.reshape(1, -1)), salt))
        elif value is None or isinstance(value, (bool, int, float, str)):
            host_salt = _signed(host_salt + _salt(path, type(value).__name__, repr(value)))
        else:
            raise TypeError(
                f"content_keys cannot hash {path} of type {type(value).__name__}: pass only the tensors "
                "and plain values that enter the frozen prefix."
            )
    if not per_row:
        raise ValueError(f"No tensor in the batch has the batch size {batch_size} as its first dimension.")
    device = per_row[0].device
    total = torch.stack([h.to(device) for h in per_row]).sum(dim=0)  # [B, 2]
    for h in shared:
        total = total + h.to(device)
    # Python scalars, not a tensor made from host data: that would be a copy to the device in every step.
    total = torch.stack((total[:, 0] + host_salt, total[:, 1] + _signed(host_salt * 3 + 1)), dim=1)
    # Final mix so keys are uniform even when only salts differ; one transfer per batch.
    final = torch.stack((_mix_a(total[:, 0] ^ total[:, 1]), _mix_b(total[:, 1] + _SEED_A)), dim=1).cpu()
    return [f"{a & _M64:016x}{b & _M64:016x}" for a, b in final.tolist()]


def _combine(hashes: Tensor, salt: int) -> Tensor:
    """Re-mix a tensor's ``[B, 2]`` hashes with its salt so tensors are not just added together."""
    return torch.stack((_mix_a(hashes[:, 0] ^ salt), _mix_b(hashes[:, 1] ^ _signed(salt * 5 + 7))), dim=1)


def index_keys(indices: Tensor | Sequence[int], namespace: str = "") -> list[str]:
    """Keys from dataset indices: ``f"{namespace}i{index}"``.

    Give each dataset its own ``namespace`` (e.g. ``"train"``, ``"val"``): index 7 of two
    datasets is two samples. Index keys reuse one augmented view per sample (module docstring).
    """
    if namespace and not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", namespace):
        raise ValueError(f"namespace={namespace!r}: use 1-64 letters, digits, '_' or '-' (it becomes part of file names).")
    if isinstance(indices, Tensor):
        if indices.is_floating_point() or indices.is_complex():
            raise TypeError(f"Dataset indices must be integers, got a {indices.dtype} tensor.")
        indices = indices.reshape(-1).tolist()
    out = []
    for index in indices:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"Dataset indices must be non-negative ints, got {index!r}.")
        out.append(f"{namespace}i{index}")
    return out
