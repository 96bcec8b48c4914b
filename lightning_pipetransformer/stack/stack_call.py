"""One pass over the block stack, as every runner sees it: the call types the parts share.

The interception (:mod:`~.interception`) turns the model's own loop over its blocks into a
:class:`StackCall`: the first block's input and every block's own arguments (:data:`BlockArgs`).
The pipeline, the chunk tuner, the cache and the self-check all take that one value, run it (a
:class:`Runner`), and read the hidden state out of each block's output with :func:`hidden_of`.
They live here, apart from the interception's machinery, so that a part that only runs passes
imports what a pass is and nothing of how one is caught.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor, nn

from lightning_pipetransformer.stack.observers import Observer

__all__ = ["Args", "BlockArgs", "InterceptionError", "Kwargs", "Runner", "StackCall", "hidden_of"]

Args = tuple[Any, ...]
Kwargs = dict[str, Any]
#: One block call's arguments after the hidden state.
BlockArgs = tuple[Args, Kwargs]


class InterceptionError(RuntimeError):
    """The model's loop does something with the block stack that a pipeline or a cache cannot reproduce."""


@dataclass(frozen=True)
class StackCall:
    """One pass of the model's loop over the stack: the first block's input and every block's arguments."""

    hidden: Tensor
    #: Per block, in order: its positional arguments after the hidden state, and its keyword arguments.
    calls: tuple[BlockArgs, ...]
    #: Called by an executor with ``(block index, output)`` for the first micro-batch of each block.
    observe: Callable[[int, Any], None] | None = field(default=None, compare=False)
    #: Wraps a hidden state into what the last block returns (a tensor, or e.g. BLOOM's tuple), for a
    #: runner that produces the last hidden state without running the last block (all blocks cached).
    as_output: Callable[[Tensor], Any] = field(default=lambda hidden: hidden, compare=False)
    #: Hooks that observe the blocks in this pass (:mod:`~.observers`): a runner must then run each
    #: block once on the whole batch (one micro-batch, no cache), so that they see the plain loop's calls.
    observed: tuple[Observer, ...] = field(default=(), compare=False)

    @classmethod
    def uniform(cls, hidden: Tensor, args: Args, kwargs: Kwargs, num_blocks: int) -> StackCall:
        """A pass where every block gets the same arguments (a plain ``for block in blocks`` loop)."""
        return cls(hidden, ((tuple(args), dict(kwargs)),) * num_blocks)

    def __len__(self) -> int:
        return len(self.calls)

    def part(self, start: int, stop: int | None = None, hidden: Tensor | None = None) -> StackCall:
        """The pass over blocks ``start..stop-1`` (block indices of :attr:`observe` shift with it)."""
        observe = self.observe
        shifted = None if observe is None else (lambda i, out: observe(i + start, out))
        return StackCall(self.hidden if hidden is None else hidden, self.calls[start:stop], shifted, self.as_output, self.observed)


class Runner(Protocol):
    """What is installed in place of the stack: it runs a whole pass and returns the last block's output."""

    blocks: tuple[nn.Module, ...]

    def run(self, call: StackCall) -> Any: ...


def hidden_of(output: Any) -> Tensor:
    """The hidden state inside a block's output, to feed the next block.

    A tensor is itself; a tuple or list (older Hugging Face layers, BLOOM, Swin) and a
    ``ModelOutput``-like object (anything with ``to_tuple``) give their first element.
    """
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    if hasattr(output, "to_tuple"):
        return output.to_tuple()[0]
    raise TypeError(
        f"Cannot find the hidden state in a block output of type {type(output).__name__}: it is the output itself "
        "(a tensor) or the first element of a tuple, list or ModelOutput. A pipeline or cache cannot run this model's "
        "blocks: use pipe_len=1, chunks=1 and cache=False for it."
    )

