"""What AutoFreeze checks of the stack it found, and the call order that places ``pre``: no Trainer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipetransformer.freeze.call_order import CallOrderWatch, refine
from lightning_pipetransformer.freeze.stack_checks import check_min_active, choose_embeddings
from lightning_pipetransformer.stack.discovery import find_block_stack


class LM(nn.Module):
    """Embeddings, two blocks and a head; ``tied``: the head holds the embeddings' weight."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 10, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def test_min_active_must_fit_the_stack_and_leave_something_to_train():
    model = LM()
    stack = find_block_stack(model)
    with pytest.raises(ValueError, match="min_active=3 exceeds the 2 blocks of layers; use at most 2"):
        check_min_active(stack, model, 3, include_pre=True)
    check_min_active(stack, model, 0, include_pre=True)  # the head still trains
    model.head.requires_grad_(False)
    with pytest.raises(ValueError, match="min_active=0 would leave nothing to train"):
        check_min_active(stack, model, 0, include_pre=True)
    check_min_active(stack, model, 0, include_pre=False)  # the embeddings stay out of the frozen prefix


def test_embeddings_tied_to_the_head_keep_training_unless_named():
    tied = LM(tied=True)
    stack = find_block_stack(tied)
    kept = choose_embeddings(stack, tied, asked=True, named=False)
    assert not kept.freeze and "embed.weight is head.weight" in (kept.kept_training or "") and kept.warning is None
    named = choose_embeddings(stack, tied, asked=True, named=True)
    assert named.freeze and named.kept_training is None and "that output head stops training too" in (named.warning or "")
    assert choose_embeddings(stack, tied, asked=False, named=False) == choose_embeddings(stack, tied, asked=False, named=True)
    untied = LM()
    assert choose_embeddings(find_block_stack(untied), untied, asked=True, named=False).freeze


def test_the_first_forward_places_a_head_registered_first_after_the_stack():
    class HeadFirst(LM):
        def __init__(self) -> None:
            super().__init__()
            head = self.head
            del self.head, self.embed, self.layers
            self.head, self.embed, self.layers = head, nn.Embedding(10, 4), nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    model = HeadFirst()
    stack = find_block_stack(model)
    assert [p for p, _ in stack.pre] == ["head", "embed"] and stack.provisional  # registration order
    watch, said = CallOrderWatch(), []
    watch.start(model, stack)
    model(torch.tensor([[1, 2]]))
    split = watch.finish(stack)
    assert split is not None and [p for p, _ in split[0]] == ["embed"] and [p for p, _ in split[1]] == ["head"]
    refine(stack, split, said.append)
    assert not stack.provisional and [p for p, _ in stack.pre] == ["embed"]
    assert said == ["AutoFreeze: from the model's call order, head run(s) after the block stack (not frozen with the "
                    "embeddings). Before the stack: embed."]  # fmt: skip
    watch.start(model, stack)  # the order is known: nothing more is watched
    assert watch.finish(stack) is None
