"""Block costs: parameter counts and the CPU profiler (the CUDA path runs where a GPU exists)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipetransformer.pipe.costs import parameter_costs, parameter_count, profile_blocks


class Scale(nn.Module):
    """y = x * w (+ mask): saves x and w for backward; returns a tuple like some HF layers."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((8,), 2.0))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        y = x * self.w
        return (y if mask is None else y + mask, None)


class LinearGelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return nn.functional.gelu(self.fc(x))


def test_parameter_costs() -> None:
    blocks = [nn.Linear(4, 3), nn.Linear(3, 2, bias=False)]
    blocks[1].requires_grad_(False)  # frozen or not, a parameter counts
    assert parameter_costs(blocks) == (15.0, 6.0)
    tied = nn.Sequential(blocks[0], blocks[0])
    assert parameter_count(tied) == 15


def _profile(device: str) -> None:
    blocks = [Scale(), LinearGelu(), Scale()]
    blocks[0].requires_grad_(False)
    sample = torch.randn(4, 8)
    mask = torch.zeros(4, 8)
    prof = profile_blocks(blocks, sample, (mask,), device=device, repeats=2, warmup=1)
    assert len(prof.forward_s) == len(prof.forward_backward_s) == len(prof.activation_bytes) == 3
    assert all(t > 0 for t in prof.forward_s + prof.forward_backward_s)
    assert 0.0 <= prof.frozen_cost <= 1.0
    if device == "cpu":
        # Scale saves its input x (4*8 floats); the weight is not an activation.
        assert prof.activation_bytes[0] == 4 * 8 * 4
        # Linear saves its input; GELU saves the linear's output: two 4x8 tensors.
        assert prof.activation_bytes[1] == 2 * 4 * 8 * 4
    else:
        assert all(b > 0 for b in prof.activation_bytes)
    # The caller's blocks are untouched: same device, no gradients, still frozen.
    assert blocks[0].w.grad is None and not blocks[0].w.requires_grad
    assert blocks[1].fc.weight.grad is None and blocks[1].fc.weight.device.type == "cpu"


def test_profile_blocks_cpu() -> None:
    _profile("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_profile_blocks_cuda() -> None:
    _profile("cuda")


def test_profile_blocks_needs_a_hidden_state() -> None:
    class Dict(nn.Module):
        def forward(self, x: torch.Tensor) -> dict:
            return {"h": x}

    with pytest.raises(TypeError, match="output_fn="):
        profile_blocks([Dict()], torch.randn(2, 3), repeats=1, warmup=0)
    prof = profile_blocks([Dict()], torch.randn(2, 3), repeats=1, warmup=0, output_fn=lambda out: out["h"])
    assert len(prof.forward_s) == 1
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        profile_blocks([Dict()], torch.randn(2, 3), repeats=0)
