"""A plain PyTorch loop that freezes by hand: the reference AutoFreeze runs are compared with."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_pipetransformer.stack.discovery import find_block_stack
from tests.helpers.models import TextClassifier, loader


def freeze_by_hand(module: TextClassifier, num_frozen: int) -> None:
    """requires_grad off and eval mode for the embeddings and the first ``num_frozen`` blocks."""
    stack = find_block_stack(module)
    frozen = ([m for _, m in stack.pre] if num_frozen else []) + list(stack.blocks[:num_frozen])
    for part in frozen:
        part.eval()
        for p in part.parameters():
            p.requires_grad_(False)


def train_reference(
    dataset, schedule: Callable[[int], int], epochs: int, batch_size: int, num_layers: int = 4, seed: int = 0
) -> dict[str, torch.Tensor]:
    module = TextClassifier(num_layers=num_layers, seed=seed)
    module.train()
    optimizer = module.configure_optimizers()
    for epoch in range(epochs):
        freeze_by_hand(module, schedule(epoch))
        for ids, labels in loader(dataset, batch_size):
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(module(ids), labels)
            loss.backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}
