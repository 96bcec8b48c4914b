"""Which hooks observe the blocks, and how they are silenced (stack/observers.py), without a Trainer."""

from __future__ import annotations

import torch
import transformers as T
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

from lightning_pipetransformer import sees_block_runs
from lightning_pipetransformer.stack.interception import install_pipeline, interception_stats, remove_pipeline
from lightning_pipetransformer.stack.observers import BlockHooks, block_modules, find_observers, silenced
from lightning_pipetransformer.stack.stack_call import StackCall


def blocks():
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3))


def test_a_users_hooks_are_observers_marked_and_own_ones_are_not():
    stack = blocks()
    stack[1].register_forward_pre_hook(lambda m, a: None)
    stack[2][0].register_forward_hook(lambda m, a, o: None)
    stack[0].register_forward_hook(sees_block_runs(lambda m, a, o: None))
    found = find_observers(block_modules(stack))
    assert [(o.where, o.kind) for o in found] == [("block 1", "forward pre-hook"), ("block 2 (0)", "forward hook")]
    assert "<lambda> on block 1" in found[0].describe()


def test_a_global_module_hook_observes_every_block():
    stack = blocks()
    handle = register_module_forward_hook(lambda m, a, o: None)
    try:
        found = BlockHooks(block_modules(stack)).observers()
        assert [(o.where, o.kind) for o in found] == [("every module", "global forward hook")]
    finally:
        handle.remove()
    assert BlockHooks(block_modules(stack)).observers() == []


def test_transformers_recorders_observe_only_while_they_record():
    """Installed once a forward asked for hidden states; inactive (not observers) in a forward that does not."""
    model = T.BertModel(T.BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16))
    x = torch.randint(0, 20, (2, 5))
    named = block_modules(model.encoder.layer)
    seen = []
    probe = model.encoder.layer[0].register_forward_pre_hook(sees_block_runs(lambda m, a: seen.append(len(find_observers(named)))))
    model(input_ids=x, output_hidden_states=True)  # installs the recorders, which record in this forward
    model(input_ids=x)  # the recorders are installed but record nothing
    probe.remove()
    assert seen[0] >= 2 and seen[1] == 0, seen  # recorders on both blocks, then none active
    assert find_observers(named) == []  # outside any forward


def test_the_input_grad_hook_of_gradient_checkpointing_reads_nothing_and_is_no_observer():
    """transformers' enable_input_require_grads() (gradient checkpointing, PEFT) only marks the embeddings' output."""
    model = T.BertModel(T.BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16))
    model.enable_input_require_grads()
    embeddings = list(model.embeddings.named_modules())
    assert any(m._forward_hooks for _, m in embeddings)  # what makes this test meaningful
    assert find_observers(embeddings) == []
    model.embeddings.register_forward_hook(lambda m, a, o: None)  # a user's hook still is one
    assert [o.kind for o in find_observers(embeddings)] == ["forward hook"]


def test_silenced_hooks_do_not_fire_and_come_back_in_order():
    stack = blocks()
    calls = []
    stack[0].register_forward_hook(lambda m, a, o: calls.append("a"))
    stack[0].register_forward_hook(sees_block_runs(lambda m, a, o: calls.append("marked")))
    stack[0].register_forward_hook(lambda m, a, o: calls.append("b"))
    x = torch.randn(2, 4)
    with silenced(stack):
        stack[0](x)
    assert calls == ["marked"]  # a marked hook sees every run, the probe's too
    with silenced(stack, every=True):
        stack[0](x)
    assert calls == ["marked"]  # the self-check's reference run: no hook but the package's own
    calls.clear()
    stack[0](x)
    assert calls == ["a", "marked", "b"]


class Recorder:
    """A runner that records the passes it gets."""

    def __init__(self, stack):
        self.blocks = tuple(stack)
        self.calls: list[StackCall] = []

    def run(self, call):
        self.calls.append(call)
        h = call.hidden
        for block in self.blocks:
            h = block(h)
        return h


def test_the_interception_hands_observers_to_the_runner_and_silences_them_in_the_probe():
    stack = blocks()
    fired = []
    stack[1].register_forward_hook(lambda m, a, o: fired.append(a[0].shape[0]))
    runner = Recorder(stack)
    install_pipeline(stack, runner)
    try:
        x = torch.randn(5, 4, requires_grad=True)
        h = x
        for block in stack:  # the first pass: the probe runs each block once, without the user's hook
            h = block(h)
        assert [c.observed[0].where for c in runner.calls] == ["block 1"]
        assert fired == [5]  # once: the runner's run, not the probe's
        assert interception_stats(stack).observed == 1
    finally:
        remove_pipeline(stack)
