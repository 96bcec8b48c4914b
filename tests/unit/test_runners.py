"""runners.ReturnTo / to_device: a pass's output goes back to the first stage's device whatever its container."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import torch
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

from lightning_pipetransformer import devices as dev
from lightning_pipetransformer.devices import VirtualDevices
from lightning_pipetransformer.runners import ReturnTo, to_device

CPU0, CPU1 = torch.device("cpu", 0), torch.device("cpu", 1)
Pair = namedtuple("Pair", "hidden extra")


def _on_last_stage(*shape: int) -> torch.Tensor:
    t = torch.randn(*shape)
    dev.tag_as(t, CPU1)
    return t


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def test_mappings_and_model_outputs_return_to_the_first_stage_device():
    with VirtualDevices() as virtual:
        outputs = [
            {"hidden": _on_last_stage(2, 3), "nested": [_on_last_stage(2)], "note": "kept"},
            OrderedDict(hidden=_on_last_stage(2, 3)),
            BaseModelOutputWithPoolingAndCrossAttentions(last_hidden_state=_on_last_stage(2, 3), attentions=(_on_last_stage(2, 2),)),
            Pair(_on_last_stage(2, 3), {"mask": _on_last_stage(2)}),
            (_on_last_stage(2, 3), None),
        ]
        for output in outputs:
            back = to_device(output, CPU0)
            assert type(back) is type(output)
            moved = _tensors(back)
            assert moved and all(virtual.device_of(t) == CPU0 for t in moved), type(output)
        model_output = to_device(outputs[2], CPU0)
        assert virtual.device_of(model_output.last_hidden_state) == CPU0  # attribute and item agree
        assert model_output[0] is model_output.last_hidden_state
        assert to_device(outputs[0], CPU0)["note"] == "kept"


def test_return_to_hands_a_model_output_back():
    class LastStageReturnsAModelOutput:
        blocks = ()

        def run(self, call):
            return BaseModelOutputWithPoolingAndCrossAttentions(last_hidden_state=_on_last_stage(2, 3))

    with VirtualDevices() as virtual:
        out = ReturnTo(LastStageReturnsAModelOutput(), CPU0).run(None)
        assert virtual.device_of(out.last_hidden_state) == CPU0
