"""The seam between AutoFreeze and a strategy that follows its freeze points, both ways, typed.

AutoFreeze sits on a lower floor than the pipeline strategy (it works under any DDP-family
strategy too), so it cannot import the strategy: it asks ``isinstance(strategy, FreezeFollower)``
and calls what the protocol declares. The strategy and AutoDP's state transfer, in turn, read the
callback through :class:`FreezeSource` only. ``tests/unit/test_layout.py`` checks that every name
the callback calls on the strategy is declared here and implemented by the strategy, and that no
module reaches another floor by ``getattr(obj, "name")``, which an import check cannot see.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import nn

    from lightning_pipetransformer.stack.discovery import BlockStack

__all__ = ["FreezeFollower", "FreezeSource"]


@runtime_checkable
class FreezeSource(Protocol):
    """What the strategy and the state transfer read of AutoFreeze."""

    #: The block stack it freezes (None until found: a model built in ``configure_model``).
    stack: BlockStack | None
    #: Leading blocks frozen now.
    num_frozen: int
    #: Whether the modules before the stack freeze with the first block (the cache's key depends on it).
    freeze_embeddings: bool

    @property
    def max_frozen(self) -> int:
        """The most blocks that may ever freeze (``len(stack) - min_active``)."""
        ...

    def most_frozen(self, num_epochs: int | None) -> int:
        """The most blocks this run will freeze, as far as known before it (an explicit plan says)."""
        ...

    def find_stack(self, pl_module: nn.Module, trainer: Any = None) -> BlockStack:
        """The stack, found (and checked) the first time it is asked for."""
        ...

    def decision_state(self) -> dict[str, Any]:
        """What another process needs to take this one's decisions (AutoDP's agree message)."""
        ...

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take a checkpoint's, or another process's, state; the frozen blocks freeze here too."""
        ...


@runtime_checkable
class FreezeFollower(Protocol):
    """A strategy that follows AutoFreeze's freeze points itself (``strategy="pipetransformer"``).

    Without it AutoFreeze re-wraps DDP after a freeze on its own, and every process decides.
    """

    @property
    def autofreeze_decides_here(self) -> bool:
        """Whether the rule decides on this process (with several: global rank 0 alone; the others
        take its decision with the plan)."""
        ...

    def on_freeze_point(self, trainer: Any, autofreeze: FreezeSource, epoch_start: bool) -> None:
        """At every freeze point, on every process, decided or not, right after the decision: the
        strategy brings its plan in line with ``autofreeze.num_frozen`` (also when no parameter
        changed: blocks that had none trainable still move the plan)."""
        ...
