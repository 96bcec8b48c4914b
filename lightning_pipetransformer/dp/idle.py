"""What a shadow rank's loop runs on: stand-in batches and a loss without model work.

Lightning starts one process per device. With pipe length K only G/K processes per node drive a
pipeline replica ("active"); the others are *shadow ranks*: they stay in Lightning's fit loop in
lock-step with the active ones (same number of batches, same ``global_step``, same callback
decisions) but do no model work and load no data.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


class IdleBatch:
    """What a shadow rank's loaders yield: a placeholder that is never moved, read or stepped on.

    Not ``None``: Lightning's training loop treats a ``None`` batch as a user error.
    """

    def __repr__(self) -> str:
        return "IdleBatch()"


IDLE_BATCH = IdleBatch()


class IdleLoader:
    """Stands in for a DataLoader on a shadow rank: the same length, no data loaded.

    The length is that of the real loader over an active replica's share (``len`` of a
    DataLoader only asks its sampler), so every rank runs the same number of batches.
    """

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[IdleBatch]:
        return (IDLE_BATCH for _ in range(self.length))


def stand_in_loader(dataloader: Any) -> IdleLoader:
    """A shadow rank's loader: as many stand-in batches as ``dataloader`` has over an active replica's share."""
    if not hasattr(dataloader, "__len__"):
        raise ValueError(
            "strategy='pipetransformer' with several processes needs loaders with a length (a map-style "
            f"dataset): idle processes stand in with the same number of batches. Got {type(dataloader).__name__} without len()."
        )
    return IdleLoader(len(dataloader))


def is_idle_batch(batch: Any) -> bool:
    return isinstance(batch, IdleBatch)


def idle_loss(device: torch.device) -> torch.Tensor:
    """A shadow rank's training-step output: Lightning (world size > 1) wants a loss that requires grad."""
    return torch.zeros((), device=device, requires_grad=True)
