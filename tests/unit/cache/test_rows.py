"""Rows picked by the host's mask: the same values and gradients as bool indexing, and no count of
the rows on the device (on a GPU, bool indexing reads that count back: a host synchronisation).

On the CPU nothing waits, so the rule is checked by what would: every bool-mask index of a tensor
other than the mask, and every ``nonzero`` of one, is recorded by a ``TorchFunctionMode``.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from lightning_pipetransformer.cache.batch import merge_rows
from lightning_pipetransformer.cache.rows import put_rows, take_rows


class DeviceCounts(TorchFunctionMode):
    """Records the calls that, on a device tensor, make the host wait for the count of selected rows."""

    def __init__(self, host_mask: torch.Tensor) -> None:
        super().__init__()
        self.host_masks = {id(host_mask), id(~host_mask)}
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and isinstance(args[1], torch.Tensor) and args[1].dtype == torch.bool:
            self.seen.append(f"{func.__name__} by a bool mask")
        if func in (torch.Tensor.nonzero, torch.nonzero) and not _is_host_mask(args[0]):
            self.seen.append("nonzero of a value")
        return func(*args, **kwargs)


def _is_host_mask(t: torch.Tensor) -> bool:
    return t.dtype == torch.bool and t.device.type == "cpu" and t.dim() == 1


def test_take_rows_is_bool_indexing_without_a_count_on_the_device():
    mask = torch.tensor([True, False, True, True, False])
    value = torch.randn(5, 3, 4, requires_grad=True)
    with DeviceCounts(mask) as counts:
        taken = take_rows(value, mask)
    assert counts.seen == []
    torch.testing.assert_close(taken, value[mask], rtol=0, atol=0)
    (taken * torch.arange(taken.numel()).view_as(taken)).sum().backward()
    expected = torch.zeros_like(value)
    expected[mask] = torch.arange(taken.numel(), dtype=value.dtype).view_as(taken)
    torch.testing.assert_close(value.grad, expected, rtol=0, atol=0)


def test_merge_rows_puts_hits_and_misses_in_batch_order_by_index():
    hit = torch.tensor([False, True, True, False])
    hits, computed = torch.randn(2, 3), torch.randn(2, 3, requires_grad=True)
    with DeviceCounts(hit) as counts:
        merged = merge_rows(hit, hits, computed)
    assert counts.seen == []
    torch.testing.assert_close(merged[hit], hits, rtol=0, atol=0)
    torch.testing.assert_close(merged[~hit], computed.detach(), rtol=0, atol=0)
    merged.sum().backward()  # the computed rows' gradient flows through the scatter
    torch.testing.assert_close(computed.grad, torch.ones_like(computed), rtol=0, atol=0)


def test_put_rows_casts_to_the_destination():
    out = torch.zeros(3, 2, dtype=torch.float64)
    put_rows(out, torch.tensor([False, True, False]), torch.ones(1, 2, dtype=torch.float32))
    assert out.dtype == torch.float64 and out.sum().item() == 2 and out[1].tolist() == [1.0, 1.0]
