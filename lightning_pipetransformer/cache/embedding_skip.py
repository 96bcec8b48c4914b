"""Skip the embeddings while the frozen prefix is served from the cache.

Once AutoCache holds a sample's activation at the frozen boundary, the embeddings' output is
not needed for it at all. But the embeddings run inside the model's own forward, before the
block stack (``embedding_output = self.embeddings(...)``, then ``self.encoder(embedding_output,
...)``), and a forward pre-hook cannot skip a module. So :class:`EmbeddingSkipper` replaces
the first module before the stack with a *lazy* forward for as long as it is attached:

- it records the module's inputs and returns a **placeholder** of the right shape, dtype and
  device, filled with NaN (never uninitialised memory: arithmetic on it shows NaN; a comparison
  would silently give False, which is why the placeholder must reach the stack unchanged and
  skipping is armed only for models seen to pass the output straight through);
- the stack (``CachedStack``) receives the placeholder, looks the samples up, and calls
  :meth:`Skipped.rows` to run the real embeddings only for batches with rows it must compute
  (misses, and the first hits it verifies); all-hit batches never run them.

It skips only when all of these hold, otherwise the module runs normally:

- ``may_skip()`` (AutoCache: a cached runner is installed, the cache serves its boundary and
  the embeddings' output was seen to reach the stack *as the same tensor*, not modified in
  place (same version counter), in an earlier forward, so nothing transforms it on the way);
- the call happens inside the forward of the smallest module holding both the embeddings
  and the stack (``BertModel``), not in a user's own call of the embeddings, and it is the
  first call of the embeddings in that forward (later ones, if any, run for real);
- no hook but this package's own observes the module or a module inside it (a user's forward hook
  on the embeddings, global module hooks: :mod:`~lightning_pipetransformer.stack.observers`): it
  would see the placeholder where the plain loop shows it the embeddings' output. The embeddings
  then run for every batch (the blocks are still served), said once;
- no parameter of the module requires grad, no tensor argument requires grad (a trainable
  soft prompt in ``inputs_embeds``), and an earlier real call with inputs of the same shapes,
  in the same grad and autocast mode, showed the output's shape and that its gradient reaches
  no parameter (it does not require grad, or only because a hook such as
  ``enable_input_require_grads`` marked it: the placeholder is marked the same way, and the
  cached stack marks the active blocks' input again, :mod:`~lightning_pipetransformer.stack.input_grad`). The
  shape map is per input signature, so length buckets cost one real call each.

And it fails loudly: a placeholder that does not reach the stack as the same tensor, that was
modified in place on the way, or that the stack never consumes before the enclosing forward
returns, raises :class:`SkipError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipetransformer.cache.rows import take_rows
from lightning_pipetransformer.stack.input_grad import needs_no_gradient
from lightning_pipetransformer.stack.observers import BlockHooks
from lightning_pipetransformer.stack.placeholders import make_placeholder
from lightning_pipetransformer.warn_once import WarnOnce

__all__ = ["EmbeddingSkipper", "SkipError", "Skipped", "input_versions", "version_of"]


def version_of(value: Any) -> int | None:
    """A tensor's version counter (bumped by in-place ops); ``None`` if it has none (inference tensors)."""
    if not isinstance(value, Tensor) or value.is_inference():
        return None
    return value._version


def input_versions(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[int | None, ...]:
    """The version counters of a call's tensor arguments: a change means one was modified in place since."""
    return tuple(version_of(v) for v in (*args, *kwargs.values()) if isinstance(v, Tensor))


class SkipError(RuntimeError):
    """The skipped embeddings' placeholder did not reach the block stack unchanged."""


@dataclass
class Skipped:
    """One skipped call: the recorded inputs, the placeholder returned, and the real forward."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    placeholder: Tensor
    forward: Callable[..., Any]
    version: int = 0  # the placeholder's version counter when it was returned
    inputs: tuple[int | None, ...] = ()  # the arguments' version counters then

    def rows(self, mask: Tensor | None = None) -> Tensor:
        """The real embeddings of the rows in ``mask`` (a ``[B]`` bool tensor; ``None``: all rows).

        Runs the whole batch and then selects: cutting the inputs instead would also cut a
        tensor shared by all rows whose length happens to equal the batch size (a 1-D
        ``position_ids`` of length S == B). The embeddings cost a few % of a block.
        """
        with torch.no_grad():
            out = self.forward(*self.args, **self.kwargs)
        return out if mask is None else take_rows(out, mask)


class EmbeddingSkipper:
    """Installs the lazy forward on ``module`` (the first module before the stack); see the module docstring.

    Args:
        module: the embeddings.
        scope: the smallest module whose forward calls both ``module`` and the stack.
        may_skip: asked at every call inside ``scope``; AutoCache's decision.
    """

    def __init__(self, module: nn.Module, scope: nn.Module, may_skip: Callable[[], bool]) -> None:
        self.module = module
        self.scope = scope
        self.may_skip = may_skip
        self._depth = 0
        self._calls = 0  # calls of the module in the current forward of ``scope``
        # Input signature -> output (shape, dtype, device, requires_grad) of outputs whose gradient reaches no
        # parameter (requires_grad: a hook such as enable_input_require_grads marked them).
        self._shapes: dict[Any, tuple[torch.Size, torch.dtype, torch.device, bool]] = {}
        self._skipped: Skipped | None = None
        name = type(module).__name__
        self._observers = BlockHooks((f"{name}.{path}" if path else name, m) for path, m in module.named_modules())
        self._say = WarnOnce()
        self._own_forward = module.__dict__.get("forward")
        self._real = module.forward
        module.forward = self._forward  # type: ignore[method-assign]
        self._hooks = [
            scope.register_forward_pre_hook(self._enter),
            scope.register_forward_hook(self._leave, always_call=True),
        ]

    @classmethod
    def for_stack(cls, root: nn.Module, pre: nn.Module, container: nn.Module, may_skip: Callable[[], bool]) -> EmbeddingSkipper | None:
        """The skipper for ``pre`` before ``container`` inside ``root``; ``None`` if no common scope is found."""
        names = {id(m): name for name, m in root.named_modules()}
        if id(pre) not in names or id(container) not in names:
            return None
        pre_path, stack_path = names[id(pre)].split("."), names[id(container)].split(".")
        common: list[str] = []
        for a, b in zip(pre_path, stack_path):
            if a != b:
                break
            common.append(a)
        scope = root.get_submodule(".".join(common)) if common else root
        return cls(pre, scope, may_skip)

    def detach(self) -> None:
        """Restore the module's forward and remove the hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._own_forward is not None:
            self.module.forward = self._own_forward  # type: ignore[method-assign]
        else:
            self.module.__dict__.pop("forward", None)
        self._skipped = None

    def take(self, hidden: Tensor) -> Skipped | None:
        """What the stack receives instead of the embeddings' output, if this forward skipped them.

        Raises:
            SkipError: a placeholder was returned but ``hidden`` is another tensor (something
                between the embeddings and the stack changed it).
        """
        skipped, self._skipped = self._skipped, None
        if skipped is None:
            return None
        if input_versions(skipped.args, skipped.kwargs) != skipped.inputs:
            raise SkipError(
                f"AutoCache skipped {type(self.module).__name__} but its inputs were modified in place before the "
                "block stack ran. Pass cache_skip_embeddings=False to the strategy (or cache=False)."
            )
        if skipped.placeholder is not hidden or skipped.placeholder._version != skipped.version:
            how = "modified in place" if skipped.placeholder is hidden else "replaced (the stack got another tensor)"
            raise SkipError(
                f"AutoCache skipped {type(self.module).__name__} but its output was {how} before it reached the "
                "block stack. This model cannot skip its embeddings: pass cache_skip_embeddings=False to the "
                "strategy (or cache=False)."
            )
        return skipped

    # ------------------------------------------------------------------ hooks

    def _enter(self, module: nn.Module, args: Any) -> None:
        if self._depth == 0:
            self._calls = 0
        self._depth += 1

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and self._skipped is not None:
            self._skipped = None
            raise SkipError(
                f"AutoCache skipped {type(self.module).__name__} but the block stack never received its output in "
                f"this forward of {type(self.scope).__name__}. Pass cache_skip_embeddings=False to the strategy."
            )

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        first = self._calls == 0
        self._calls += 1
        signature = self._signature(args, kwargs) if self._depth > 0 else None
        known = self._shapes.get(signature) if signature is not None else None
        if known is not None and first and self._frozen() and self.may_skip() and not self._observed():
            shape, dtype, device, marked = known
            batch = signature[0]
            # Marked: every path that runs a block refuses it (stack/placeholders.py).
            placeholder = make_placeholder((batch, *shape), dtype, device)
            if marked:  # what the real output would be: the active blocks' input is marked again from it
                placeholder.requires_grad_(True)
            self._skipped = Skipped(args, kwargs, placeholder, self._real, placeholder._version, input_versions(args, kwargs))
            return placeholder
        output = self._real(*args, **kwargs)
        if (
            signature is not None and isinstance(output, Tensor) and output.is_floating_point()
            and output.dim() > 0 and output.shape[0] == signature[0]
            and (not output.requires_grad or needs_no_gradient(output))
        ):
            self._shapes[signature] = (output.shape[1:], output.dtype, output.device, output.requires_grad)
        return output

    def _observed(self) -> bool:
        """Whether a hook observes the embeddings now: they then run, so that it sees their real output."""
        observers = self._observers.observers()
        if observers:
            self._say(
                observers[0].describe(),
                f"AutoCache runs {type(self.module).__name__} for every batch instead of skipping them on cached ones: "
                f"{observers[0].describe()} observes them, and a skipped call would show it a NaN placeholder instead of "
                "their output. The frozen blocks are still served. Remove the hook while training to skip them too.",
                stacklevel=3,
            )
        return bool(observers)

    def _frozen(self) -> bool:
        return not any(p.requires_grad for p in self.module.parameters())

    @staticmethod
    def _signature(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...] | None:
        """``(batch, per-argument description)``: equal signatures give equal output shapes; ``None``: do not skip."""
        parts: list[Any] = []
        batch: int | None = None
        autocast: Any = None
        grad = torch.is_grad_enabled()
        for name, value in [*enumerate(args), *sorted(kwargs.items())]:
            if isinstance(value, Tensor):
                if grad and value.requires_grad:
                    return None  # gradient must flow through the real embeddings (e.g. a trainable soft prompt)
                if batch is None and value.dim() > 0:
                    batch = int(value.shape[0])
                    kind = value.device.type
                    autocast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
                parts.append((name, tuple(value.shape), value.dtype, value.device))
            elif value is None or isinstance(value, (bool, int, float, str)):
                parts.append((name, value))
            else:
                return None  # something we cannot compare cheaply: run the real forward
        if batch is None:
            return None
        return (batch, autocast, grad, tuple(parts))
