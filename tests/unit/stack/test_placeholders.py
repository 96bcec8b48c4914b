"""A stand-in value never reaches a block: every path that runs one refuses a marked placeholder."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipetransformer.pipe.pipeline import Pipeline
from lightning_pipetransformer.stack.interception import call_block
from lightning_pipetransformer.stack.placeholders import PlaceholderError, is_placeholder, make_placeholder
from lightning_pipetransformer.stack.stack_call import StackCall


def test_a_placeholder_is_marked_nan_and_tracks_versions_under_inference_mode():
    with torch.inference_mode():
        placeholder = make_placeholder((2, 3), torch.float32, torch.device("cpu"))
    assert is_placeholder(placeholder) and torch.isnan(placeholder).all()
    assert not placeholder.is_inference()  # its version counter shows in-place changes
    assert not is_placeholder(torch.full((2, 3), float("nan")))  # NaN alone is not the mark


def test_call_block_refuses_a_placeholder_as_hidden_state():
    block = nn.Linear(3, 3)
    with pytest.raises(PlaceholderError, match="placeholder"):
        call_block(block, make_placeholder((2, 3), torch.float32, torch.device("cpu")))
    with pytest.raises(PlaceholderError):
        call_block(block, hidden_states=make_placeholder((2, 3), torch.float32, torch.device("cpu")))
    assert call_block(block, torch.zeros(2, 3)).shape == (2, 3)


@pytest.mark.parametrize("balance, chunks", [((2,), 1), ((1, 1), 2)])
def test_the_pipeline_refuses_a_placeholder_before_cutting_it_into_micro_batches(balance, chunks):
    """Micro-batches are copies, which would lose the mark: the check is at the pass's entry."""
    blocks = [nn.Linear(3, 3), nn.Linear(3, 3)]
    pipeline = Pipeline(blocks, balance, ["cpu"] * len(balance), chunks=chunks)
    placeholder = make_placeholder((4, 3), torch.float32, torch.device("cpu"))
    with pytest.raises(PlaceholderError):
        pipeline.run(StackCall.uniform(placeholder, (), {}, 2))
