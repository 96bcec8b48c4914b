"""AutoFreeze's watch of the first training forward: what really runs before the block stack.

Discovery's ``pre``/``post`` are provisional (registration order); what AutoFreeze freezes with
the first block must be what runs before it. :class:`CallOrderWatch` hooks one training forward
(:class:`~lightning_pipetransformer.stack.execution.CallOrderObserver`: the forward the loop makes
anyway), reads the split after it, before backward, and :func:`refine` puts the modules where they
ran, saying what moved. Unlike the strategy's watch for a run without AutoFreeze
(:class:`~lightning_pipetransformer.stack.execution.OrderWatch`), a module that runs on both sides
of the stack is refused here: freezing it with the prefix would freeze what runs after.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from lightning_pipetransformer.stack.discovery import BlockStack, BlockStackError
from lightning_pipetransformer.stack.execution import CallOrderObserver, split_by_order

__all__ = ["CallOrderWatch", "Split", "refine"]

#: ``pre`` and ``post`` as (attribute path, module) pairs.
Split = tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]


class CallOrderWatch:
    """Watches training forwards while the stack's ``pre``/``post`` are provisional, until one runs the stack."""

    def __init__(self) -> None:
        self._observer: CallOrderObserver | None = None
        self._root: nn.Module | None = None

    def start(self, root: nn.Module, stack: BlockStack) -> None:
        """At a training batch start: hook this forward, unless the order is known or hooked already."""
        if stack.provisional and self._observer is None:
            self._root, self._observer = root, CallOrderObserver(root, stack)

    def finish(self, stack: BlockStack) -> Split | None:
        """After the forward (before backward and any optimizer step): the split it observed, or None.

        None when nothing was watched, when the order arrived meanwhile (an AutoDP rank takes rank 0's
        state), or when the forward ran no block (an idle AutoDP rank's stand-in step): the next one is
        watched then.
        """
        observer, self._observer = self._observer, None
        if observer is None:
            return None
        order = observer.finish()
        if not stack.provisional:
            return None
        if not order.saw_stack:
            assert self._root is not None
            self._observer = CallOrderObserver(self._root, stack)
            return None
        try:
            return split_by_order(stack, order)
        except BlockStackError as err:
            raise BlockStackError(f"AutoFreeze: {err}") from None

    def remove(self) -> None:
        """At teardown: the hooks go with the fit."""
        if self._observer is not None:
            self._observer.remove()
            self._observer = None


def refine(stack: BlockStack, split: Split, say: Callable[[str], None]) -> None:
    """Put ``pre``/``post`` where they ran (observed now, or in the run a checkpoint came from), and ``say``
    which modules moved across the stack."""
    pre, post = split
    before = [p for p, _ in stack.pre]
    stack.refine(pre, post)
    now = {q for q, _ in pre}
    moved_in = [p for p, _ in pre if p not in before]
    moved_out = [p for p in before if p not in now]
    if moved_in or moved_out:
        say(
            "AutoFreeze: from the model's call order, "
            + "; ".join(_moved(moved_out, "after the block stack (not frozen with the embeddings)")
                        + _moved(moved_in, "before it (frozen with the embeddings)"))
            + f". Before the stack: {', '.join(p for p, _ in pre) or 'nothing'}."
        )  # fmt: skip


def _moved(paths: Sequence[str], where: str) -> list[str]:
    return [f"{', '.join(paths)} run(s) {where}"] if paths else []
