"""The custom-rule example of docs/autofreeze.md runs, decides as written, and drives a real fit."""

from __future__ import annotations

import re
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_pipetransformer import AutoFreeze
from lightning_pipetransformer.freeze.policies import FreezePoint, FreezeRule
from tests.helpers.models import TextClassifier, loader, text_dataset

DOC = Path(__file__).resolve().parents[3] / "docs" / "autofreeze.md"


def example() -> dict:
    """The docs' example, executed: its namespace."""
    text = DOC.read_text()
    match = re.search(r"<!-- example: custom-rule -->\s*```python\n(.*?)```", text, re.S)
    assert match, "docs/autofreeze.md lost its custom-rule example"
    namespace: dict = {}
    exec(compile(match.group(1), str(DOC), "exec"), namespace)
    return namespace


def test_the_example_rule_decides_from_synthetic_norms():
    rule = example()["FreezeQuietBlocks"](threshold=0.01)
    assert isinstance(rule, FreezeRule)
    rule.norms.add(torch.tensor([0.001, 0.002, 0.5, 0.001]))
    rule.norms.add(torch.tensor([0.003, 0.004, 0.5, 0.001]))
    # Means 0.002, 0.003, 0.5, 0.001: blocks 0 and 1 are quiet, block 2 is not (block 3 is, but after it).
    assert rule.decide(FreezePoint(1, 1, 0, 4, 3)) == 2
    assert rule.decide(FreezePoint(2, 2, 2, 4, 3)) == 2  # no step since: nothing to go on
    rule.norms.add(torch.tensor([0.0, 0.0, 0.5, 0.1]))
    restored = example()["FreezeQuietBlocks"](threshold=0.01)
    restored.load_state_dict(rule.state_dict(), None)
    assert restored.norms.mean() == rule.norms.mean()


def fit(threshold: float) -> AutoFreeze:
    freeze = AutoFreeze(rule=example()["FreezeQuietBlocks"](threshold=threshold))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, callbacks=[freeze], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(TextClassifier(num_layers=4), loader(text_dataset(16)))
    return freeze


def test_the_example_rule_freezes_under_autofreeze():
    everything = fit(threshold=float("inf"))  # every block is quiet: all but min_active=1 freeze at epoch 1
    assert everything.history == [(1, 3)] and everything.rule == "quiet blocks"
    nothing = fit(threshold=0.0)  # no block is quiet: nothing freezes
    assert nothing.history == [] and nothing.num_frozen == 0
