"""Which block stack a LightningModule declares: the one rule the callback and the strategy share.

Order of precedence: an explicit ``layers`` argument, then the module's own
``configure_block_stack()`` hook, then automatic discovery over the whole LightningModule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from lightning_pipetransformer.stack.calls import is_called_block
from lightning_pipetransformer.stack.discovery import (
    BlockStack,
    BlockStackError,
    find_block_stack,
    resolve_block_stack,
)
from lightning_pipetransformer.stack.shared_depth import shared_depth, shared_depth_message

__all__ = ["block_stack_of", "refuse_uncalled_blocks", "stack_for_strategy", "BLOCK_STACK_HOOK"]

#: Name of the optional LightningModule hook. It returns the attribute path of the block
#: container (``"model.encoder.layer"``), the container itself, or a ready ``BlockStack``.
BLOCK_STACK_HOOK = "configure_block_stack"


def block_stack_of(
    module: nn.Module, layers: str | nn.Module | BlockStack | None = None, pre: Sequence[str] | None = None
) -> BlockStack:
    """Resolve the block stack of ``module`` (a LightningModule) as described above."""
    spec = layers
    if spec is None:
        hook = getattr(module, BLOCK_STACK_HOOK, None)
        if callable(hook):
            spec = hook()
            if spec is None:
                raise BlockStackError(
                    f"{type(module).__name__}.{BLOCK_STACK_HOOK}() returned None; return the attribute path "
                    "of the block container (e.g. 'model.encoder.layer'), the container, or a BlockStack."
                )
    if pre is not None:
        if not (spec is None or isinstance(spec, str)):
            raise BlockStackError("`pre` can only be combined with `layers` given as an attribute path (or None).")
        return find_block_stack(module, spec, pre=pre)
    return resolve_block_stack(module, spec)


def stack_for_strategy(module: nn.Module, layers: str | None, asked: Sequence[str], warn: Callable[[str], None]) -> BlockStack | None:
    """The stack the pipeline strategy plans over: :func:`block_stack_of`, or None when the model has none.

    ``asked``: the strategy's arguments that need a stack (``"pipe_len=2"``, ...). With any of them,
    a missing stack is an error that names them; without, the caller trains the model as written,
    and ``warn`` says so.
    """
    try:
        return block_stack_of(module, layers)
    except BlockStackError as err:
        if asked:
            raise BlockStackError(f"{', '.join(asked)} needs a block stack to pipeline or cache. {err}") from None
    warn(
        f"PipeTransformer: {type(module).__name__} has no stack of repeated blocks, so there is nothing to freeze, "
        "pipeline or cache: it trains as under the plain strategy. To use the pipeline, name the block container "
        "with PipeTransformerStrategy(layers='model.encoder.layer') or define configure_block_stack() on the module."
    )
    return None


def refuse_uncalled_blocks(stack: BlockStack, asked: Sequence[str]) -> None:
    """Before training: blocks the model does not call once each per pass cannot be pipelined or cached.

    The pipeline and the cache take over the model's *calls* of the blocks; Funnel's blocks are
    ``nn.ModuleList``s of layers that its loop walks into, so no call ever reaches them and the
    runner would never see a pass (found only after an epoch). ``asked``: what needs the calls.
    Blocks wrapped by ``torch.compile(layer)`` are called (:func:`~.calls.is_called_block`). ALBERT's
    layer groups are called several times per pass (:mod:`~.shared_depth`).
    """
    shared = shared_depth(stack.container, stack.path)
    if shared is not None and asked:
        raise BlockStackError(shared_depth_message(shared, ", ".join(asked)))
    uncalled = sorted({type(b).__name__ for b in stack.blocks if not is_called_block(b)})
    if not uncalled or not asked:
        return
    inner = [f"'{stack.path}.{name}'" for name, _ in list(stack.container.named_children())[:3]]
    raise BlockStackError(
        f"{', '.join(asked)}: the blocks of '{stack.path}' are {'/'.join(uncalled)} containers, which the model never "
        "calls (it walks into them and calls their layers), so the pipeline and the cache would never see a pass. Name "
        f"a stack of layers the model calls one by one, e.g. layers={inner[0]} (the stacks inside: {', '.join(inner)}), "
        "or train without pipe_len/cache (AutoFreeze alone freezes these blocks as they are)."
    )
