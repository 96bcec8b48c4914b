"""The use_cache notice is for models that build a key-value cache: decoders yes, BERT-family encoders no."""

from __future__ import annotations

import pytest

from lightning_pipetransformer.stack.kv_cache import builds_kv_cache
from lightning_pipetransformer.stack.model_flags import turn_off_kv_cache
from tests.helpers.families import FamilyModule


@pytest.mark.parametrize(("family", "builds"), [("bert", False), ("roberta", False), ("llama", True), ("gpt2", True), ("opt", True)])
def test_decoders_build_a_kv_cache_and_encoders_do_not(family: str, builds: bool) -> None:
    module = FamilyModule(family)
    configs = turn_off_kv_cache(module)
    assert configs, "every one of these configs has use_cache on by default"
    assert [builds_kv_cache(module, c) for c in configs] == [builds]


def test_a_bert_configured_as_a_decoder_builds_one() -> None:
    module = FamilyModule("bert")
    config = module.model.config
    assert not builds_kv_cache(module, config)
    config.is_decoder = True
    assert builds_kv_cache(module, config)
