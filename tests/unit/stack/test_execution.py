"""What runs before and after the block stack is read from one observed forward, not from registration order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipetransformer.stack.discovery import find_block_stack
from lightning_pipetransformer.stack.execution import CallOrderError, CallOrderObserver, split_by_order


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear(h) + (0 if bias is None else bias)


class Encoder(nn.Module):
    """Registers its blocks first, then a bias it computes before them (MPNet), then a weight it only reads."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.bias = nn.Linear(1, 4)
        self.shared = nn.Embedding(1, 4)  # read, never called (DeBERTa's rel_embeddings.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        bias = self.bias(torch.ones(1, 1)) + self.shared.weight
        for layer in self.layers:
            h = layer(h, bias)
        return h


class HeadFirst(nn.Module):
    """A task head registered before the backbone (transformers 5.x XLMRobertaForSequenceClassification)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 2)
        self.embed = nn.Linear(3, 4)
        self.encoder = Encoder()
        self.unused = nn.Linear(4, 4)  # never called: stays outside the prefix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)))


def observed(root, forward):
    stack = find_block_stack(root)
    observer = CallOrderObserver(root, stack)
    forward()
    return stack, observer.finish()


def paths(entries):
    return [p for p, _ in entries]


def test_the_call_order_puts_a_head_registered_first_after_the_stack_and_a_later_module_before_it():
    model = HeadFirst()
    stack, order = observed(model, lambda: model(torch.randn(2, 3)))
    assert paths(stack.pre) == ["head", "embed"] and stack.provisional  # registration order: wrong
    pre, post = split_by_order(stack, order)
    # In the order they ran: the embedding first (the cache keys on pre[0]), then the bias, then the weight read.
    assert paths(pre) == ["embed", "encoder.bias", "encoder.shared"]
    assert set(paths(post)) == {"head", "unused"}
    stack.refine(pre, post)
    assert not stack.provisional and paths(stack.pre) == paths(pre)
    # The hooks are gone: a second forward records nothing.
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_refine_tells_its_listeners_once_each():
    model = HeadFirst()
    stack, order = observed(model, lambda: model(torch.randn(2, 3)))
    seen = []
    listener = lambda: seen.append(paths(stack.pre))  # noqa: E731
    stack.when_refined(listener)
    stack.when_refined(listener)
    stack.refine(*split_by_order(stack, order))
    assert seen == [["embed", "encoder.bias", "encoder.shared"]]


def test_a_step_that_runs_the_model_twice_still_places_each_module():
    """Between two passes a call says nothing: the head ran after the first pass, the embedding before the second."""
    model = HeadFirst()

    def step():
        model(torch.randn(2, 3))
        model(torch.randn(2, 3))

    stack, order = observed(model, step)
    pre, post = split_by_order(stack, order)
    assert paths(pre) == ["embed", "encoder.bias", "encoder.shared"] and "head" in paths(post)


def test_a_module_outside_the_model_called_by_the_step_is_placed_by_the_step_order():
    class Lightning(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(4, 2)
            self.stem = nn.Linear(3, 4)
            self.blocks = nn.ModuleList(Block() for _ in range(2))

    root = Lightning()

    def step():  # a training_step that runs the loop itself: the root is never called
        h = root.stem(torch.randn(2, 3))
        for block in root.blocks:
            h = block(h)
        root.head(h)

    stack, order = observed(root, step)
    pre, post = split_by_order(stack, order)
    assert paths(pre) == ["stem"] and paths(post) == ["head"]


def test_a_module_run_before_and_after_the_stack_is_refused_by_name():
    class Shared(nn.Module):
        """Input embeddings that the output reads again (a decoder's shared embeddings)."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(4, 4)
            self.blocks = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x)
            for block in self.blocks:
                h = block(h)
            return self.embed(h)

    model = Shared()
    stack, order = observed(model, lambda: model(torch.randn(2, 4)))
    with pytest.raises(CallOrderError, match=r"'embed' runs both before the block stack 'blocks' and after it.*AutoFreeze\(pre=\['embed'\]\)"):
        split_by_order(stack, order)
    # Where nothing freezes the prefix (no AutoFreeze), it stays outside it instead.
    pre, post = split_by_order(stack, order, mixed_after=True)
    assert paths(pre) == [] and paths(post) == ["embed"]


def test_a_forward_that_runs_no_block_tells_nothing():
    model = HeadFirst()
    stack, order = observed(model, lambda: model.embed(torch.randn(2, 3)))
    assert not order.saw_stack


def test_transformers_modules_registered_after_the_layers_that_run_before_them_join_the_prefix():
    """BART's layernorm_embedding and Llama's rotary_emb are registered after the layers and run before them."""
    import transformers as T

    torch.manual_seed(0)
    bart = T.BartModel(T.BartConfig(vocab_size=40, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                                    decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32))
    llama = T.LlamaModel(T.LlamaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                       num_key_value_heads=1, intermediate_size=32, max_position_embeddings=32))
    ids = torch.randint(3, 40, (2, 6))
    for model, layers, moved in ((bart.encoder, "layers", "layernorm_embedding"), (llama, "layers", "rotary_emb")):
        stack = find_block_stack(model, layers)
        assert moved in paths(stack.post)  # registration order
        observer = CallOrderObserver(model, stack)
        model(input_ids=ids)
        pre, post = split_by_order(stack, observer.finish())
        assert moved in paths(pre) and paths(pre)[0] == "embed_tokens" and moved not in paths(post)


def test_a_module_without_parameters_run_on_both_sides_stays_outside_the_prefix():
    """T5 applies one dropout to the embeddings and after the last block: nothing to freeze, and eval mode would
    change its use after the stack."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(4, 4)
            self.drop = nn.Dropout(0.0)
            self.blocks = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.drop(self.embed(x))
            for block in self.blocks:
                h = block(h)
            return self.drop(h)

    model = Model()
    stack, order = observed(model, lambda: model(torch.randn(2, 4)))
    pre, post = split_by_order(stack, order)
    assert paths(pre) == ["embed"] and paths(post) == ["drop"]


def test_gemma3n_altup_projections_run_before_the_layers_and_its_unembedding_after():
    import transformers as T

    torch.manual_seed(0)
    config = T.Gemma3nTextConfig(
        vocab_size=40, vocab_size_per_layer_input=40, hidden_size=32, hidden_size_per_layer_input=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64, laurel_rank=4, altup_num_inputs=2,
        num_kv_shared_layers=0, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        activation_sparsity_pattern=[0.0, 0.0],
    )
    model = T.Gemma3nForCausalLM(config)
    stack, order = observed(model, lambda: model(input_ids=torch.randint(0, 40, (2, 5))))
    assert "model.altup_projections" in paths(stack.post)  # registered after the layers
    pre, post = split_by_order(stack, order)
    assert paths(pre)[0] == "model.embed_tokens" and "model.altup_projections" in paths(pre)
    assert {"model.altup_unembed_projections", "model.norm", "lm_head"} <= set(paths(post))
