"""Which stack inputs need a gradient: a hook's mark on a frozen embeddings' output does not, a parameter does."""

from __future__ import annotations

import torch
from torch import nn

from lightning_pipetransformer.stack.input_grad import FrozenOutputs, as_marked_input, gradient_leaf, needs_no_gradient


class Embeddings(nn.Module):
    """BERT's shape: word embeddings (where the hook sits), plus positions, then a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.word = nn.Embedding(10, 4)
        self.position = nn.Embedding(5, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.word(ids) + self.position(torch.arange(ids.shape[1])))


def mark_output(module, args, output):  # Hugging Face's enable_input_require_grads
    output.requires_grad_(True)


def embeddings(frozen: bool = True, hook: bool = True) -> Embeddings:
    module = Embeddings()
    if frozen:
        module.requires_grad_(False)
    if hook:
        module.word.register_forward_hook(mark_output)
    return module


IDS = torch.tensor([[1, 2, 3], [4, 5, 6]])


def test_a_hook_marked_output_of_frozen_embeddings_needs_no_gradient():
    module = embeddings()
    tags = FrozenOutputs([module])
    hidden = module(IDS)
    assert hidden.requires_grad and hidden.grad_fn is not None  # it looks like it needs one
    assert needs_no_gradient(hidden) and gradient_leaf(hidden) is None
    tags.remove()
    assert not needs_no_gradient(embeddings()(IDS))  # without the tags nothing can tell


def test_trainable_embeddings_need_their_gradient_and_are_named():
    module = embeddings(frozen=False)
    FrozenOutputs([module])
    hidden = module(IDS)
    assert not needs_no_gradient(hidden)
    assert any(gradient_leaf(hidden) is p for p in module.parameters())


def test_one_trainable_module_before_the_stack_is_enough():
    """BART's layernorm_embedding: registered after the stack, trainable, on the way."""
    module = embeddings()
    module.norm.requires_grad_(True)
    FrozenOutputs([module.word, module.position])
    assert gradient_leaf(module(IDS)) is module.norm.weight or gradient_leaf(module(IDS)) is module.norm.bias


def test_a_users_leaf_needs_its_gradient():
    """inputs_embeds the user wants the gradient of (adversarial training) is not a hook's mark."""
    leaf = torch.randn(2, 3, 4, requires_grad=True)
    assert gradient_leaf(leaf) is leaf and not needs_no_gradient(leaf)
    assert not needs_no_gradient(leaf * 2)


def test_nothing_to_decide_without_requires_grad():
    assert not needs_no_gradient(torch.zeros(2)) and gradient_leaf(torch.zeros(2)) is None


def test_as_marked_input_is_a_fresh_leaf_that_requires_grad():
    x = torch.zeros(2, 3)
    marked = as_marked_input(x)
    assert marked.requires_grad and marked.is_leaf and not x.requires_grad
    y = torch.zeros(2, requires_grad=True)
    assert as_marked_input(y) is y
