"""Resuming with frozen blocks does not raise Lightning's "modules in eval mode" warning (issue 32).

Frozen blocks run in eval mode on purpose (no dropout in a prefix whose outputs are cached or
must not change); restored from a checkpoint, they are in eval mode when Lightning checks at the
start of training. A user's own module left in eval mode is still reported.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy
from tests.helpers.lightning_models import Classifier, data_for

EVAL_WARNING = "module(s) in eval mode at the start of training"


def fit(tmp_path, max_epochs: int, ckpt_path=None, module=None) -> list[str]:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=PipeTransformerStrategy(pipe_len=2), max_epochs=max_epochs,
        callbacks=[AutoFreeze(schedule={1: 2}), ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)],
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module or Classifier("bert"), data_for("bert"), ckpt_path=ckpt_path)
    assert trainer.strategy.plan.num_frozen == 2
    return [str(w.message) for w in caught]


def test_no_eval_mode_warning_for_restored_frozen_blocks(tmp_path):
    fit(tmp_path, max_epochs=2)
    caught = fit(tmp_path, max_epochs=3, ckpt_path=str(tmp_path / "last.ckpt"))
    assert not [w for w in caught if EVAL_WARNING in w], caught


def test_a_users_module_in_eval_mode_is_still_reported(tmp_path):
    fit(tmp_path, max_epochs=2)
    module = Classifier("bert")
    head = next(m for name, m in module.named_modules() if name.endswith("classifier"))
    head.eval()  # not frozen by AutoFreeze: Lightning's warning is the user's to see
    caught = fit(tmp_path, max_epochs=3, ckpt_path=str(tmp_path / "last.ckpt"), module=module)
    assert [w for w in caught if f"Found 1 {EVAL_WARNING}" in w], caught
