"""Rows of a batch picked by the host's mask, without making the host wait for a GPU.

Which rows of a batch hit the store, missed it, or need their real values is known on the host
(the store's keys are host strings), as a ``[B]`` bool mask. Indexing a device tensor with a
bool mask (``value[mask.to(device)]``) makes the GPU count the selected rows and the host read the
count back, before it can size the result: one synchronisation per call, several per batch with a
miss. The mask's indices are known on the host instead; they go up with the step's other work
(a copy that does not wait) and the device gathers or scatters by index.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["put_rows", "take_rows"]


def _index(mask: Tensor, device: object) -> Tensor:
    """The positions where ``mask`` (on the host) holds, on ``device``, copied without waiting for it."""
    return mask.nonzero().flatten().to(device, non_blocking=True)


def take_rows(value: Tensor, mask: Tensor) -> Tensor:
    """``value[mask]`` along the first dimension (the gradient flows as through that indexing).

    A mask already on a device (nothing in the cache makes one) is used as it is: reading it
    would cost the synchronisation this function avoids."""
    if mask.device.type != "cpu":
        return value[mask.to(value.device)]
    return value.index_select(0, _index(mask, value.device))


def put_rows(out: Tensor, mask: Tensor, rows: Tensor) -> None:
    """``out[mask] = rows`` along the first dimension, in place (``rows`` cast to ``out``'s dtype)."""
    rows = rows.to(device=out.device, dtype=out.dtype)
    if mask.device.type != "cpu":
        out[mask.to(out.device)] = rows
        return
    out.index_copy_(0, _index(mask, out.device), rows)
