"""Applying a frozen prefix to a block stack: requires_grad off, eval mode, no stale gradients.

Frozen blocks must stop changing *and* become a pure function of their input (eval mode, so no
dropout), because AutoCache later replaces them by stored activations. Their parameters stay in
the optimizer: rebuilding parameter groups would change the optimizer's state layout and break
resuming from a checkpoint; an optimizer skips parameters whose ``grad`` is ``None``.
"""

from __future__ import annotations

from torch import nn

from lightning_pipetransformer.stack.discovery import BlockStack

__all__ = [
    "apply_freeze", "ensure_frozen_eval", "frozen_modules", "frozen_parameters", "in_frozen_prefix", "tied_outside", "untrainable_prefix",
]  # fmt: skip


def frozen_modules(stack: BlockStack, num_frozen: int, include_pre: bool) -> list[nn.Module]:
    """Modules covered by freezing ``num_frozen`` leading blocks (and ``pre`` when asked)."""
    if not 0 <= num_frozen <= len(stack):
        raise ValueError(f"Cannot freeze {num_frozen} blocks of a stack of {len(stack)}.")
    modules: list[nn.Module] = []
    if include_pre and num_frozen > 0:
        modules.extend(m for _, m in stack.pre)
    modules.extend(stack.blocks[:num_frozen])
    return modules


def frozen_parameters(stack: BlockStack, num_frozen: int, include_pre: bool) -> list[nn.Parameter]:
    """Parameters covered by freezing ``num_frozen`` leading blocks (and ``pre`` when asked)."""
    params = [p for m in frozen_modules(stack, num_frozen, include_pre) for p in m.parameters()]
    if include_pre and num_frozen > 0:
        params.extend(p for _, p in stack.pre_params)
    return params


def apply_freeze(stack: BlockStack, num_frozen: int, include_pre: bool) -> int:
    """Freeze the leading ``num_frozen`` blocks; return how many parameters changed state.

    Gradients of newly frozen parameters are dropped (set to ``None``): an optimizer called with
    ``zero_grad(set_to_none=False)`` would otherwise keep applying weight decay and momentum to
    zero-filled gradients of parameters that should not move.
    """
    changed = 0
    for param in frozen_parameters(stack, num_frozen, include_pre):
        if param.requires_grad:
            param.requires_grad_(False)
            changed += 1
        param.grad = None
    ensure_frozen_eval(stack, num_frozen, include_pre)
    return changed


def ensure_frozen_eval(stack: BlockStack, num_frozen: int, include_pre: bool) -> None:
    """Put frozen modules back in eval mode (a user's ``model.train()`` call flips them)."""
    for module in frozen_modules(stack, num_frozen, include_pre):
        if module.training:
            module.eval()


def untrainable_prefix(stack: BlockStack) -> int:
    """How many leading blocks have no parameter that requires grad (frozen before fit, or no adapter).

    They train no more than frozen blocks do, so the plan counts them as frozen from the start: the
    pipeline packs the rest and AutoCache may serve them (PEFT adapters on the upper layers only).
    """
    count = 0
    for block in stack.blocks:
        if any(p.requires_grad for p in block.parameters()):
            break
        count += 1
    return count


def tied_outside(stack: BlockStack, root: nn.Module) -> list[tuple[str, str]]:
    """``(pre parameter, other name)`` for parameters before the stack that a module after it also holds.

    GPT-2 and many decoders tie the input embeddings to the output head: freezing the embeddings
    then freezes the head too.
    """
    pre_names = {id(p): f"{path}.{name}" for path, module in stack.pre for name, p in module.named_parameters()}
    pre_ids = {id(m) for _, module in stack.pre for m in module.modules()}
    found: list[tuple[str, str]] = []
    for path, module in root.named_modules():
        if id(module) in pre_ids:
            continue
        for name, param in module.named_parameters(recurse=False):
            if id(param) in pre_names:
                found.append((pre_names[id(param)], f"{path}.{name}" if path else name))
    return found


def in_frozen_prefix(stack: BlockStack, module: nn.Module) -> bool:
    """Whether ``module`` belongs to the frozen prefix as it is now (the leading blocks without a trainable parameter,
    and the embeddings without one): such modules are in eval mode on purpose."""
    frozen = list(stack.blocks[: untrainable_prefix(stack)])
    frozen += [m for _, m in stack.pre if not any(p.requires_grad for p in m.parameters())]
    return any(module is inner for outer in frozen for inner in outer.modules())
