"""lightning-pipetransformer: PipeTransformer (ICML 2021) for PyTorch Lightning.

Public API:

* :class:`AutoFreeze` - a callback that freezes a model's leading blocks progressively
  (works under single-device, DDP and the ``"pipetransformer"`` strategy).
* :class:`PipeTransformerStrategy` - ``strategy="pipetransformer"``: the block stack runs as a
  pipeline that shrinks as AutoFreeze freezes blocks; ``trainer.strategy.plan`` is the current
  :class:`Plan`.
* :class:`PipeTransformerTimeline` - a callback that prints and saves, per epoch, the frozen
  blocks, the plan, the cache's hits, the throughput and the metric (any strategy).
* :func:`find_block_stack` / :class:`BlockStack` - how the package sees a model: ``pre``
  modules, a stack of repeated blocks, ``post`` modules.
* :func:`sees_block_runs` - mark a hook on a block that should see every real block run
  (micro-batches included); unmarked hooks see each block once per pass with the whole batch.
"""

from lightning_pipetransformer.freeze.callback import AutoFreeze
from lightning_pipetransformer.pipe.planner import Plan
from lightning_pipetransformer.stack.discovery import (
    BlockStack,
    BlockStackError,
    find_block_stack,
)
from lightning_pipetransformer.stack.observers import sees_block_runs
from lightning_pipetransformer.strategy import (
    PipeTransformerStrategy,  # registers "pipetransformer"
)
from lightning_pipetransformer.timeline import PipeTransformerTimeline

__all__ = ["AutoFreeze", "BlockStack", "BlockStackError", "Plan", "PipeTransformerStrategy", "PipeTransformerTimeline", "find_block_stack", "sees_block_runs"]
__version__ = "0.1.0.dev0"
