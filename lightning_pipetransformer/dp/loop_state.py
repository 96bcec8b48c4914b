"""What a joining replica needs besides the weights: optimizer, LR-scheduler and loss-scaler state.

Plain functions over the objects themselves (optimizers, schedulers, the precision plugin's
scaler), so that the strategy hands them in and no part of dp/ reaches into the trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_pipetransformer import devices as dev
from lightning_pipetransformer.dp.state_transfer import without_state_of

__all__ = ["load_replica_state", "replica_state"]


def replica_state(
    optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any], scaler: Any, frozen: Sequence[nn.Parameter],
) -> dict[str, Any]:
    """Rank 0's loop state for the ranks that join. The optimizer state of ``frozen`` parameters is
    left out: they never thaw, so it is never read again (rank 0, which writes checkpoints, keeps it)."""
    return {
        "optimizers": [without_state_of(o.state_dict(), o, frozen) for o in optimizers],
        "schedulers": [s.state_dict() for s in schedulers],
        # 16-mixed: replicas must unscale by the same factor, or they diverge silently.
        "scaler": scaler.state_dict() if scaler is not None else None,
    }


def load_replica_state(
    state: dict[str, Any], optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any], scaler: Any,
) -> None:
    """Load :func:`replica_state`'s output on a joining rank; optimizer state follows its parameters' devices."""
    for optimizer, optimizer_state in zip(optimizers, state["optimizers"]):
        optimizer.load_state_dict(optimizer_state)
    dev.optimizer_state_to_param_devices(optimizers)
    for scheduler, scheduler_state in zip(schedulers, state["schedulers"]):
        scheduler.load_state_dict(scheduler_state)
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
