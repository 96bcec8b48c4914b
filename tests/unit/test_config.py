"""The strategy's configuration: validated on construction, frozen, documented from its fields."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from lightning_pipetransformer import PipeTransformerStrategy
from lightning_pipetransformer.config import CacheConfig, PipeTransformerConfig, argument_table

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"pipe_len": 0}, "pipe_len must be a positive int"),
        ({"pipe_len": True}, "pipe_len must be a positive int"),
        ({"chunks": "many"}, "chunks must be a positive int or 'auto'"),
        ({"chunks": 0}, "chunks must be a positive int or 'auto'"),
        ({"frozen_cost": 2.0}, r"frozen_cost must be in \[0, 1\]"),
        ({"frozen_cost": "cheap"}, r"frozen_cost must be in \[0, 1\]"),
        ({"timeout": 0}, "timeout must be a positive number"),
        ({"batch_policy": "local"}, "batch_policy must be 'replica' or 'global'"),
        ({"layers": 3}, "layers must be an attribute path"),
        ({"cache": "yes"}, "cache must be False, True or 'auto'"),
        ({"cache_key": "hash"}, "cache_key must be 'content' or 'index'"),
        ({"cache_memory": -1}, "cache_memory must be a number of bytes"),
        ({"cache_memory": 1.5}, "cache_memory must be a number of bytes"),
    ],
)
def test_the_strategy_refuses_bad_arguments_when_it_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PipeTransformerStrategy(**kwargs)


def test_the_strategy_keeps_its_arguments_in_a_frozen_config():
    strategy = PipeTransformerStrategy(pipe_len=2, chunks="auto", cache="auto", cache_key="index", cache_memory=0, frozen_cost=0)
    config = strategy.config
    assert config == PipeTransformerConfig(
        pipe_len=2, chunks="auto", frozen_cost=0.0, cache=CacheConfig(mode="auto", key="index", memory=0)
    )
    assert config.cache.enabled and config.pipelines_or_caches and isinstance(config.frozen_cost, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.pipe_len = 4  # type: ignore[misc]
    assert not PipeTransformerConfig().pipelines_or_caches


def test_every_field_has_a_docstring_and_the_docs_hold_the_generated_table():
    table = argument_table()
    rows = table.splitlines()[2:]
    fields = [f.name for f in dataclasses.fields(PipeTransformerConfig) if f.name != "cache"] + [
        f.name for f in dataclasses.fields(CacheConfig)
    ]
    assert len(rows) == len(fields) and all(row.count("|") == 4 and not row.endswith("|  |") for row in rows)
    # The strategy's keyword arguments, in the table under the names users pass.
    names = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    import inspect

    accepted = set(inspect.signature(PipeTransformerStrategy).parameters)
    assert set(names) <= accepted and "cache_memory" in names and "pipe_len" in names
    text = DOCS.read_text()
    begin, end = "<!-- config:begin -->\n", "<!-- config:end -->"
    assert begin in text and end in text, "docs/configuration.md lost its markers"
    assert text.split(begin)[1].split(end)[0] == table + "\n", (
        "docs/configuration.md is stale: regenerate it with "
        "python -c 'from lightning_pipetransformer.config import write_docs; write_docs()'"
    )


def test_the_arguments_are_the_configs_fields_and_the_error_and_the_help_list_every_one():
    """The argument lists are written from the config: an argument missing from the error's text, from the class
    docstring's ``Args`` or from the config (a value that never reaches it) fails here."""
    import inspect

    from lightning_pipetransformer.config import LIGHTNING_ARGUMENTS, strategy_arguments

    own = strategy_arguments()
    assert sorted(n for n in inspect.signature(PipeTransformerStrategy).parameters if n != "lightning") == sorted(own)
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) \['pipe_length'\]") as error:
        PipeTransformerStrategy(pipe_length=2)
    assert [n for n in [*own, *LIGHTNING_ARGUMENTS] if not re.search(rf"\b{n}\b", str(error.value))] == []
    assert [n for n in own if f"\n        {n}: " not in (PipeTransformerStrategy.__doc__ or "")] == []
    given = {
        "pipe_len": 2, "chunks": 3, "frozen_cost": 0.5, "layers": "model.layers", "process_group_backend": "gloo",
        "timeout": 5.0, "batch_policy": "global", "self_check": False, "cache": True, "cache_key": "index",
        "cache_dir": "/tmp/cache", "cache_memory": 7, "cache_skip_embeddings": False, "cache_frozen_eval": True,
        "cache_keep": True, "cache_keep_bytes": 9,
    }  # fmt: skip
    assert sorted(given) == sorted(own)
    assert PipeTransformerStrategy(**given).config == PipeTransformerConfig(
        pipe_len=2, chunks=3, frozen_cost=0.5, layers="model.layers", process_group_backend="gloo", timeout=5.0,
        batch_policy="global", self_check=False,
        cache=CacheConfig(mode=True, key="index", dir="/tmp/cache", memory=7, skip_embeddings=False, frozen_eval=True, keep=True, keep_bytes=9),
    )  # fmt: skip
