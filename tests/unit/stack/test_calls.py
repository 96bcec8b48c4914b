"""Whether a model can call a block, followed through wrappers (issue 45: torch.compile by replacement)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_pipetransformer.stack.calls import is_called_block


def test_a_bare_container_is_not_called_and_a_layer_is():
    assert not is_called_block(nn.ModuleList([nn.Linear(2, 2)]))
    assert is_called_block(nn.Linear(2, 2)) and is_called_block(nn.Sequential(nn.Linear(2, 2)))


def test_a_layer_compiled_by_replacement_is_called_and_a_compiled_container_is_not():
    """The wrapper's class has no forward (the old check read only the class); its instance runs the layer's call."""
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    compiled = torch.compile(layer, backend="eager")
    assert type(compiled).forward is nn.Module.forward  # what the old check read: it said "never called"
    assert is_called_block(compiled)
    assert is_called_block(torch.compile(nn.Linear(2, 2), backend="eager"))  # torch.nn layers: Dynamo's wrap_inline
    assert not is_called_block(torch.compile(nn.ModuleList([nn.Linear(2, 2)]), backend="eager"))
    layer.compile(backend="eager")  # in place: the class keeps its forward
    assert is_called_block(layer)


def test_a_module_held_under_the_name_forward_is_still_not_called():
    """``self.forward = module`` registers a child: the call still reaches nn.Module's unimplemented forward."""

    class Holder(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.forward = inner

    assert not is_called_block(Holder(nn.Linear(2, 2)))
