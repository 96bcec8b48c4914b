"""``nn.TransformerEncoder``'s nested-tensor fast path, taken where the model as written takes it: in eval mode.

With ``enable_nested_tensor=True`` (torch's default) the encoder turns a padded batch into a nested
tensor before its layers (padding dropped) and pads the last layer's output back with zeros, when
``layers[0]`` is in eval mode, no gradient is needed at its input or weights and a
``src_key_padding_mask`` is given (``TransformerEncoder.forward``). In the model as written
``layers[0]`` has the encoder's mode, so that happens in validation and prediction only. Freezing
puts ``layers[0]`` alone in eval mode while the layers above it train: the encoder then hands a
nested tensor to training layers, whose attention has no nested path (an ``AssertionError`` at the
first frozen step). :func:`guard_nested_tensor` makes the encoder decide from its own mode, as the
unfrozen model does: dense while training (what every layer computed before the freeze), nested in
eval mode (what the user's validation computes, zeros at the padded positions included).
"""

from __future__ import annotations

from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_pipetransformer.stack.discovery import BlockStack

__all__ = ["NestedTensorGuard", "guard_nested_tensor"]


class NestedTensorGuard:
    """A forward pre-hook on one encoder: ``use_nested_tensor`` as set at construction, in eval mode only.

    :meth:`remove` takes the hook off and gives the encoder back its own ``use_nested_tensor``.
    """

    def __init__(self, encoder: nn.TransformerEncoder) -> None:
        self.encoder = encoder
        self.enabled = bool(encoder.use_nested_tensor)
        self._handle: RemovableHandle | None = encoder.register_forward_pre_hook(self._before)

    def _before(self, encoder: nn.Module, args: object) -> None:
        encoder.use_nested_tensor = self.enabled and not encoder.training

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
            self.encoder.use_nested_tensor = self.enabled


def guard_nested_tensor(root: nn.Module, stack: BlockStack) -> NestedTensorGuard | None:
    """Guard the ``nn.TransformerEncoder`` in ``root`` whose layers are ``stack``'s blocks, when it may go nested.

    None when the stack is not such an encoder's layers, or the encoder never takes the fast path
    (``enable_nested_tensor=False``, or a layer that torch's own check rules out).
    """
    for module in root.modules():
        if isinstance(module, nn.TransformerEncoder) and module.layers is stack.container:
            return NestedTensorGuard(module) if module.use_nested_tensor else None
    return None
