"""What AutoFreeze checks of the block stack it found, before anything freezes (no Lightning).

Two questions with an answer in the model alone: whether ``min_active`` leaves something to
train, and whether the embeddings may freeze with the first block when an output head shares
their weights (GPT-2's ``lm_head``): freezing them would freeze the head, so, unless ``pre=``
names them, they keep training and the user is told why.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_pipetransformer.freeze.apply import frozen_parameters, tied_outside
from lightning_pipetransformer.stack.discovery import BlockStack

__all__ = ["EmbeddingsChoice", "check_min_active", "choose_embeddings", "pre_trainable"]


def check_min_active(stack: BlockStack, root: nn.Module, min_active: int, include_pre: bool) -> None:
    """Refuse a ``min_active`` above the stack's length, or 0 when every trainable parameter is in the stack or before it."""
    if min_active > len(stack):
        raise ValueError(f"min_active={min_active} exceeds the {len(stack)} blocks of {stack.path}; use at most {len(stack)}.")
    if min_active == 0:
        covered = {id(p) for p in frozen_parameters(stack, len(stack), include_pre)}
        if not any(p.requires_grad and id(p) not in covered for p in root.parameters()):
            raise ValueError(
                "min_active=0 would leave nothing to train: every trainable parameter is in the block stack "
                "(or before it). Use min_active >= 1."
            )


def pre_trainable(stack: BlockStack) -> bool:
    """Whether a parameter before the stack (embeddings, a cls token) still requires grad."""
    return any(p.requires_grad for _, m in stack.pre for p in m.parameters()) or any(p.requires_grad for _, p in stack.pre_params)


@dataclass(frozen=True)
class EmbeddingsChoice:
    """Whether the modules before the stack freeze with the first block, and what to say about it."""

    #: They freeze with the first block.
    freeze: bool
    #: Why they keep training although ``freeze_embeddings=True`` was asked (tied to the head); None otherwise.
    kept_training: str | None = None
    #: ``pre=`` names embeddings tied to the head: both freeze, as asked, with this warning.
    warning: str | None = None


def choose_embeddings(stack: BlockStack, root: nn.Module, asked: bool, named: bool) -> EmbeddingsChoice:
    """Input embeddings tied to a module after the stack keep training unless ``pre=`` names them (``named``)."""
    tied = tied_outside(stack, root) if asked else []
    if not tied:
        return EmbeddingsChoice(asked)
    listed = ", ".join(f"{a} is {b}" for a, b in tied[:3])
    if named:  # asked for by name: freeze them, and the head with them
        return EmbeddingsChoice(True, warning=(
            f"AutoFreeze(pre=[...]) freezes the embeddings with the first block, but they are tied to a module after "
            f"the stack ({listed}): that output head stops training too, as asked. To keep the head training, leave "
            "the tied module out of pre=; to freeze the embeddings alone, untie the weights (tie_word_embeddings=False)."
        ))  # fmt: skip
    return EmbeddingsChoice(False, kept_training=(
        f"the input embeddings are tied to the output head ({listed}): freezing them would freeze the head, so they "
        "keep training, the frozen blocks still run backward for them (without weight gradients of their own) and "
        "AutoCache stands aside. For the cache, untie them (tie_word_embeddings=False: the head gets its own copy of "
        "the weights, which then trains alone while the embeddings freeze with the first block); to freeze the head "
        "with the embeddings, name them in AutoFreeze(pre=[...])"
    ))  # fmt: skip
