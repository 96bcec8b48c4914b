"""What a newcomer meets first: the use_cache notice, the strategy's CLI help, ``timeout`` as a
timedelta, and where the cache's folders go (and that empty ones do not stay behind)."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest

from lightning_pipetransformer import PipeTransformerStrategy
from tests.helpers.families import FamilyModule, family_data


@pytest.mark.parametrize(("family", "said"), [("bert", False), ("llama", True)])
def test_the_notice_only_where_a_kv_cache_exists(family: str, said: bool, caplog) -> None:
    module = FamilyModule(family)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=PipeTransformerStrategy(pipe_len=2), max_epochs=1, limit_train_batches=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    with caplog.at_level(logging.INFO):
        trainer.fit(module, family_data(family))
    notices = [r.getMessage() for r in caplog.records if "config.use_cache" in r.getMessage()]
    assert bool(notices) == said, notices
    if said:
        assert "Not AutoCache" in notices[0]
    assert module.model.config.use_cache is True  # restored after fit either way
