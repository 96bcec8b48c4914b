"""Does a batch fit the cache's memory budget: the one rule, and the measure that applies it before the first store.

The store refuses a batch larger than a positive budget when it stores one (:func:`check_batch_fits`).
That can be epochs into a fit (the first freeze), so :class:`BatchBytes` measures what a batch's
entries will take from the first forward on, and the strategy applies the same rule after the first
training step (:func:`~lightning_pipetransformer.cache.hooks.check_budget`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lightning_pipetransformer.cache.arguments import entry_bytes

__all__ = ["BatchBytes", "CacheConfigError", "check_batch_fits"]


class CacheConfigError(ValueError):
    """The cache cannot work as configured (directory not writable, budget below one batch)."""


def check_batch_fits(memory_budget: int, nbytes: int) -> None:
    """Raise :class:`CacheConfigError` if one batch of ``nbytes`` cannot fit in a positive ``memory_budget``."""
    if 0 < memory_budget < nbytes:
        raise CacheConfigError(
            f"The cache's memory budget ({memory_budget:,} bytes: cache_memory= on the strategy, divided by the "
            f"processes of a node, or memory_budget= on the store) is smaller than one batch of activations "
            f"({nbytes:,} bytes). Raise it to at least {nbytes:,} bytes per process (a whole epoch needs batches x "
            "that), or set it to 0 to keep the cache on disk only."
        )


class BatchBytes:
    """Measures, from the first block's inputs, the largest batch of entries a forward would store.

    A pipeline calls the block per micro-batch: the measure is then a lower bound, and the store's
    own check at the first store stays the exact one.
    """

    def __init__(self) -> None:
        self._largest = 0
        self._hook: Any = None

    def watch(self, first_block: nn.Module) -> None:
        """Measure from the next forward of ``first_block`` on (forgetting what was measured before)."""
        self.stop()
        self._largest = 0
        self._hook = first_block.register_forward_pre_hook(self._measure, with_kwargs=True)

    def _measure(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if args and isinstance(args[0], Tensor) and args[0].dim() > 0 and args[0].shape[0] > 0:
            per_sample = entry_bytes(args[0], args[1:], kwargs)
            if per_sample is not None:
                self._largest = max(self._largest, per_sample * args[0].shape[0])

    def take(self) -> int | None:
        """The bytes measured (0: nothing seen), and stop measuring; ``None`` once stopped."""
        if self._hook is None:
            return None
        self.stop()
        return self._largest

    def stop(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
