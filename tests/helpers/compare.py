"""Assertions that two trainings ended in the same weights."""

from __future__ import annotations

import torch
from torch import nn


def assert_state_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Same keys, and every tensor close (the failing key is named)."""
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=rtol, atol=atol, msg=key)


def assert_same_weights(a: nn.Module, b: nn.Module, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Two modules' state dicts are close and finite; a ``torch.compile``d module's keys (``_orig_mod.``)
    compare with the plain module's."""
    sa = {k.replace("_orig_mod.", ""): v for k, v in a.state_dict().items()}
    sb = {k.replace("_orig_mod.", ""): v for k, v in b.state_dict().items()}
    for key, value in sa.items():
        assert torch.isfinite(value).all(), key
    assert_state_close(sa, sb, rtol=rtol, atol=atol)
