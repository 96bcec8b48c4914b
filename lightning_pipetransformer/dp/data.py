"""AutoDP's rules for the training data: checked before the first batch, with what to change.

The data is split over the active replicas, whose number changes as the pipeline shrinks, so the
loader must be one Lightning can re-split (a map-style dataset under its distributed sampler),
an int ``val_check_interval`` must fit the shortest epoch reachable, and ``batch_policy="global"``
needs a batch size that divides by every replica count. Free functions over the loader's
attributes and plain numbers; the strategy calls them from ``process_dataloader``.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DistributedSampler

__all__ = ["check_train_loader", "check_val_check_interval", "per_replica_batch_size"]


def check_train_loader(dataloader: Any, num_replicas: int) -> None:
    """The training loader must carry Lightning's distributed sampler over ``num_replicas`` replicas."""
    sampler = getattr(dataloader, "sampler", None)
    if not isinstance(sampler, DistributedSampler) or sampler.num_replicas != num_replicas:
        raise ValueError(
            "strategy='pipetransformer' with several processes splits the training data over the active replicas, "
            "which change as the pipeline shrinks: it needs a DataLoader over a map-style dataset and Lightning's "
            "distributed sampler (Trainer(use_distributed_sampler=True), the default, and no DistributedSampler of "
            f"your own). Got sampler {type(sampler).__name__}."
        )


def check_val_check_interval(interval: int, dataloader: Any, most_replicas: int, limit_train_batches: int | float) -> None:
    """batch_policy='replica' shortens the epoch as replicas join: an int ``val_check_interval`` must
    fit the epoch at ``most_replicas`` (the most the planner can reach), or Lightning refuses it epochs later."""
    sampler, batch_size = dataloader.sampler, dataloader.batch_size
    if batch_size is None:
        return
    size = len(sampler.dataset)
    samples = size // most_replicas if sampler.drop_last else -(-size // most_replicas)
    batches = samples // batch_size if dataloader.drop_last else -(-samples // batch_size)
    limit = limit_train_batches
    batches = min(batches, limit) if isinstance(limit, int) else int(batches * limit)
    if interval > batches:
        raise ValueError(
            f"val_check_interval={interval} batches, but with batch_policy='replica' an epoch shrinks as replicas "
            f"join: with the {most_replicas} replicas AutoFreeze can reach it has {batches} batches, and Lightning "
            f"would refuse the interval then. Use val_check_interval <= {batches}, a float (a fraction of each "
            "epoch), or batch_policy='global' (epochs keep their length)."
        )


def per_replica_batch_size(batch_size: int | None, world_size: int, num_replicas: int) -> int:
    """batch_policy='global': the loader's batch size is the global batch; each of the replicas gets its share."""
    if batch_size is None or batch_size % world_size:
        raise ValueError(
            f"batch_policy='global' splits the DataLoader's batch_size over up to {world_size} replicas: it must "
            f"be a multiple of {world_size} (got {batch_size}; a custom batch_sampler cannot be split). Change the "
            "batch size, or use batch_policy='replica'."
        )
    return batch_size // num_replicas
