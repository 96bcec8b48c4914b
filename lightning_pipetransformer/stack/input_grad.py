"""Whether the stack's input needs a gradient, or only looks like it does.

Hugging Face's ``gradient_checkpointing_enable()`` calls ``enable_input_require_grads()`` for text
models (and PEFT does so for adapters): a forward hook on the input embeddings marks their output
as requiring grad, so that a reentrant checkpoint of the first block has an input that requires
grad and its adapters get gradients. With frozen embeddings nothing trainable is behind that
output: its gradient ends in a tensor made inside the forward, which nobody reads. Taken at face
value, though, it would keep the frozen blocks in the autograd graph (no freeze speed-up) and turn
AutoCache off ("its input requires grad").

:class:`FrozenOutputs` tags the outputs of the modules before the stack that were computed by a
module without trainable parameters from inputs that need no gradient. :func:`needs_no_gradient`
then follows a hidden state's autograd graph: if every leaf it reaches is such a tagged output
(no parameter, no tensor of the user's such as a leaf ``inputs_embeds`` they want the gradient
of), the gradient reaches nothing anyone reads, and the frozen prefix may run without a graph. Its
output is then marked as requiring grad again (:func:`as_marked_input`), so the active blocks see
exactly what the hook meant them to see.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor, nn

__all__ = ["FrozenOutputs", "as_marked_input", "needs_no_gradient"]

_TAG = "_pipetransformer_grad_free"
#: A walk that long is not an embeddings' graph: give up (the gradient is then assumed to be needed).
_MAX_NODES = 256


class FrozenOutputs:
    """Forward hooks on ``modules`` (the modules before the stack, and their submodules) that tag
    outputs computed without trainable parameters from inputs that need no gradient."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        seen: set[int] = set()
        self._handles = []
        for module in modules:
            for sub in module.modules():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    self._handles.append(sub.register_forward_hook(self._tag, with_kwargs=True))

    @staticmethod
    def _tag(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if not isinstance(output, Tensor):
            return
        if any(p.requires_grad for p in module.parameters()):
            return
        if any(isinstance(v, Tensor) and v.requires_grad and not getattr(v, _TAG, False) for v in (*args, *kwargs.values())):
            return
        setattr(output, _TAG, True)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def needs_no_gradient(hidden: Tensor) -> bool:
    """True when ``hidden`` requires grad but its gradient reaches only outputs :class:`FrozenOutputs` tagged.

    False when it does not require grad (nothing to decide), or when its graph reaches a parameter
    or any other leaf (a user's ``inputs_embeds``), or is longer than an embeddings' graph.
    """
    if not hidden.requires_grad:
        return False
    if hidden.grad_fn is None:  # a leaf: tagged, or the user's own tensor
        return bool(getattr(hidden, _TAG, False))
    # Only leaves decide: a module's tagged output may still depend on a tensor it read by other means.
    todo, seen = [hidden.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if len(seen) > _MAX_NODES:
            return False
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf that requires grad
        if variable is not None:
            if not getattr(variable, _TAG, False):
                return False
            continue
        todo.extend(next_node for next_node, _ in node.next_functions)
    return True


def as_marked_input(hidden: Tensor) -> Tensor:
    """``hidden`` as a fresh leaf that requires grad, what a grad-free input stood for at the active blocks."""
    if hidden.requires_grad:
        return hidden
    return hidden.detach().requires_grad_(True)
