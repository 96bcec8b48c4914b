"""Counters of real block runs: the engagement side of an equivalence test.

Forward pre-hooks fire only when a block computes, so a block served from the cache or skipped
as frozen is not counted; the hooks are marked with :func:`~lightning_pipetransformer.stack.observers.sees_block_runs`
so the strategy does not take them for observers it has to keep whole.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_pipetransformer.stack.discovery import find_block_stack
from lightning_pipetransformer.stack.observers import sees_block_runs


class ForwardRuns(list):
    """Real forward runs per block (``runs[i]``); compares equal to a plain list of counts.

    ``reset()`` sets every count back to zero, ``remove()`` takes the hooks off the blocks.
    """

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        super().__init__([0] * len(blocks))
        self.handles = [block.register_forward_pre_hook(sees_block_runs(lambda *_, i=i: self._count(i))) for i, block in enumerate(blocks)]

    def _count(self, index: int) -> None:
        self[index] += 1

    def reset(self) -> None:
        self[:] = [0] * len(self)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class ForwardRunsPerEpoch(Callback):
    """Real forward runs of each block of ``module``'s stack, per training epoch (``epochs[e][i]``).

    The hooks go on when the counter is made, on the module's own blocks, before the strategy sets up.
    """

    def __init__(self, module: nn.Module) -> None:
        self.blocks = find_block_stack(module).blocks
        self.epochs: list[list[int]] = []
        for index, block in enumerate(self.blocks):
            block.register_forward_pre_hook(sees_block_runs(lambda *_, i=index: self._count(i)))

    def _count(self, index: int) -> None:
        if self.epochs:
            self.epochs[-1][index] += 1

    def on_train_epoch_start(self, trainer, pl_module):
        self.epochs.append([0] * len(self.blocks))


class ForwardBackwardRunsPerEpoch(Callback):
    """Per training epoch and block: real forward runs and real backward runs (``forward[e][i]``, ``backward[e][i]``).

    The hooks go on at ``on_fit_start``, on the strategy's stack once set up (else the module's), so a
    model built in ``configure_model()`` is counted too.
    """

    def __init__(self) -> None:
        self.blocks: list[nn.Module] = []
        self.forward: list[list[int]] = []
        self.backward: list[list[int]] = []

    def on_fit_start(self, trainer, pl_module):
        stack = getattr(trainer.strategy, "stack", None) or find_block_stack(pl_module)
        self.blocks = list(stack.blocks)
        for index, block in enumerate(self.blocks):
            block.register_forward_pre_hook(sees_block_runs(lambda *_, i=index: self._count(self.forward, i)))
            block.register_full_backward_pre_hook(sees_block_runs(lambda *_, i=index: self._count(self.backward, i)))

    def _count(self, table: list[list[int]], index: int) -> None:
        if table:
            table[-1][index] += 1

    def on_train_epoch_start(self, trainer, pl_module):
        self.forward.append([0] * len(self.blocks))
        self.backward.append([0] * len(self.blocks))
