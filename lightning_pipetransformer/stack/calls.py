"""Whether a model can call a block: what ``block(...)`` would run, followed through wrappers.

A container without a ``forward`` of its own (Funnel's blocks are ``nn.ModuleList``s of layers)
raises ``NotImplementedError`` when called, so a model that works never calls it: it walks into it
and calls its layers, and a runner waiting for the block's calls would never see a pass. Reading
the block's *class* (``type(block).forward``) to tell is wrong for wrappers that set ``forward`` on
the instance: ``torch.compile(layer)`` returns an ``OptimizedModule`` whose class has no
``forward`` while the instance's runs the compiled layer. So the call is followed as Python and
``nn.Module.__call__`` follow it: the instance's ``forward`` attribute, through ``functools.wraps``
layers (Dynamo's) to the module or module call it wraps, until a real ``forward`` is reached (the
block is called) or ``nn.Module``'s unimplemented one (a container never called). Anything this
cannot see through counts as called: the engagement report warns when a runner then sees no pass.
"""

from __future__ import annotations

import inspect

from torch import nn

__all__ = ["is_called_block"]

# ``nn.Module.__call__`` is ``_wrapped_call_impl``, which runs ``_call_impl``: each runs ``self.forward``.
_MODULE_CALLS = {nn.Module.__call__, nn.Module._wrapped_call_impl, nn.Module._call_impl}


def is_called_block(block: nn.Module) -> bool:
    """False only when calling ``block`` reaches ``nn.Module``'s unimplemented ``forward`` (a bare container)."""
    module, seen = block, set()
    while id(module) not in seen:
        seen.add(id(module))
        try:
            target = inspect.unwrap(module.forward)
        except ValueError:  # a cycle of __wrapped__: nothing to learn
            return True
        if isinstance(target, nn.Module):  # Dynamo's wrap_inline(module) for torch.nn layers
            module = target
            continue
        owner, function = getattr(target, "__self__", None), getattr(target, "__func__", target)
        if isinstance(owner, nn.Module) and owner is not module and function in (*_MODULE_CALLS, type(owner).__call__):
            module = owner  # the wrapped module's own call (OptimizedModule: _orig_mod.__call__)
            continue
        return function is not nn.Module.forward
    return True
