"""The prefix's code in its fingerprint: another forward (same weights, names and attributes) is another prefix."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from torch import nn
from transformers.models.bert.modeling_bert import BertSelfOutput

from lightning_pipetransformer.cache.code_identity import class_code_lines, package_version
from lightning_pipetransformer.cache.validity import prefix_fingerprint
from lightning_pipetransformer.stack.discovery import BlockStack, find_block_stack
from tests.helpers.models import tiny_bert


def _stack(seed: int = 0) -> BlockStack:
    torch.manual_seed(seed)
    return find_block_stack(tiny_bert(4))


def _halved_residual(self, hidden_states, input_tensor):
    return self.LayerNorm(self.dropout(self.dense(hidden_states)) + 0.5 * input_tensor)


def test_a_patched_forward_changes_the_fingerprint_and_nothing_else_does(monkeypatch):
    # Before: the fingerprint named classes by name only, so the same weights through another forward (an edited
    # model file, a patched method) had the fingerprint of the entries the old code computed.
    base = prefix_fingerprint(_stack(), 2)
    assert prefix_fingerprint(_stack(), 2) == base
    monkeypatch.setattr(BertSelfOutput, "forward", _halved_residual)
    assert prefix_fingerprint(_stack(), 2) != base
    monkeypatch.undo()
    assert prefix_fingerprint(_stack(), 2) == base


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return helper(self.linear(x))


def helper(x):
    return x.relu()


def test_module_level_helpers_the_forward_calls_are_covered(monkeypatch):
    before = class_code_lines([Block()])
    monkeypatch.setattr(sys.modules[__name__], "helper", _tanh)
    assert class_code_lines([Block()]) != before


def _tanh(x):
    return x.tanh()


def test_the_digest_is_the_same_in_another_process_with_another_hash_seed():
    # Frozensets of constants iterate in the string hash's order: a digest must not follow it, or no run would
    # ever find another's entries.
    code = (
        "import torch; from tests.helpers.models import tiny_bert; from lightning_pipetransformer.stack.discovery import "
        "find_block_stack; from lightning_pipetransformer.cache.validity import prefix_fingerprint; torch.manual_seed(0); "
        "print(prefix_fingerprint(find_block_stack(tiny_bert(4)), 2))"
    )
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"  # this process's is random, or set: not this one
    env = {**os.environ, "PYTHONHASHSEED": seed}
    there = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert there == prefix_fingerprint(_stack(), 2) + "\n"


def test_classes_name_their_package_version():
    lines = "\n".join(class_code_lines(_stack().blocks[:1]))
    assert package_version("transformers").startswith("transformers==")
    assert f"BertLayer {package_version('transformers')}" in lines
    assert package_version("tests.helpers.models") == "unversioned"
