"""AutoFreeze's arguments: checked when it is built (each bad one named), frozen, the same list as ``__init__``."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from lightning_pipetransformer import AutoFreeze
from lightning_pipetransformer.config import _field_docs
from lightning_pipetransformer.freeze.config import AutoFreezeConfig
from lightning_pipetransformer.freeze.policies import RULES, FreezeRuleBase, GeometricSchedule, PlasticityRule

DOCS = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"

BAD = [
    ({"alpha": 0}, "alpha must be a number strictly between 0 and 1"),
    ({"alpha": 1.0}, "alpha must be a number strictly between 0 and 1"),
    ({"alpha": True}, "alpha must be a number strictly between 0 and 1"),
    ({"alpha": "third"}, "alpha must be a number strictly between 0 and 1"),
    ({"rule": "median"}, "rule must be 'paper', 'schedule', 'autofreeze', 'plasticity' or a FreezeRule object, got 'median'"),
    ({"freeze_interval": 0}, "freeze_interval as a number of optimizer steps must be >= 1"),
    ({"freeze_interval": 1.5}, r"freeze_interval as a fraction of an epoch must be in \(0, 1\]"),
    ({"freeze_interval": "half"}, "freeze_interval must be an int .optimizer steps. or a float"),
    ({"freeze_interval": True}, "freeze_interval must be an int .optimizer steps. or a float"),
    ({"freeze_interval": 2, "schedule": {1: 1}}, "schedule is a plan per epoch. Pass one of them"),
    ({"freeze_interval": 2, "freeze_every_n_epochs": 2}, "Pass freeze_interval .points inside epochs. or freeze_every_n_epochs, not both"),
    ({"percentile": 0}, r"percentile must be in \(0, 100\)"),
    ({"percentile": 100}, r"percentile must be in \(0, 100\)"),
    ({"freeze_every_n_epochs": 0}, "freeze_every_n_epochs must be a positive int, got 0"),
    ({"freeze_every_n_epochs": True}, "freeze_every_n_epochs must be a positive int, got True"),
    ({"freeze_every_n_epochs": 1.5}, "freeze_every_n_epochs must be a positive int, got 1.5"),
    ({"min_active": -1}, "min_active must be an int >= 0, got -1"),
    ({"min_active": False}, "min_active must be an int >= 0, got False"),
    ({"schedule": {-1: 2}}, "schedule epochs must be >= 0"),
    ({"anneal": "square"}, "anneal must be None, 'linear', 'cosine' or a callable"),
    ({"anneal": lambda t: 2.0}, r"anneal: the curve returned 2.0 at progress 0.0; it must return a number in \[0, 1\]"),
]


@pytest.mark.parametrize("build", [AutoFreezeConfig, AutoFreeze], ids=["config", "callback"])
@pytest.mark.parametrize("kwargs, message", BAD)
def test_each_bad_argument_is_refused_with_its_message_when_built(build, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build(**kwargs)


def test_a_schedule_of_the_wrong_kind_is_a_type_error():
    with pytest.raises(TypeError, match="schedule must be a dict epoch -> num_frozen or a callable"):
        AutoFreezeConfig(schedule=3)  # type: ignore[arg-type]


def test_the_rule_list_in_the_error_is_the_literal_type():
    assert RULES == ("paper", "schedule", "autofreeze", "plasticity")
    for name in RULES:
        assert AutoFreezeConfig(rule=name).rule == name


def test_a_plan_per_epoch_refuses_an_interval_and_a_rule_may_bring_its_own():
    class PerEpoch(FreezeRuleBase):
        name = "per epoch"
        per_epoch = True

    with pytest.raises(ValueError, match="The rule 'per epoch' is a plan per epoch: pass it without freeze_interval"):
        AutoFreezeConfig(rule=PerEpoch(), freeze_interval=2).interval_for(PerEpoch())
    with pytest.raises(ValueError, match="is a plan per epoch"):
        AutoFreeze(rule=PerEpoch(), freeze_interval=2)
    plasticity = PlasticityRule()
    assert AutoFreezeConfig(rule="plasticity").interval_for(plasticity) == 0.0625
    assert AutoFreezeConfig(rule="plasticity", freeze_interval=3).interval_for(plasticity) == 3
    assert AutoFreezeConfig(rule="plasticity", freeze_every_n_epochs=2).interval_for(plasticity) is None
    assert AutoFreezeConfig().interval_for(GeometricSchedule(1 / 3)) is None


def test_the_config_is_frozen_and_keeps_checked_values():
    config = AutoFreezeConfig(alpha=1 / 2, percentile=25, pre=["model.embeddings"], schedule={2: 1})
    assert config.alpha == 0.5 and isinstance(config.percentile, float) and config.pre == ("model.embeddings",)
    assert config.explicit_schedule is not None and config.explicit_schedule(3) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.alpha = 0.25  # type: ignore[misc]
    freeze = AutoFreeze(alpha=0.5, min_active=2, freeze_interval=4)
    assert freeze.config == AutoFreezeConfig(alpha=0.5, min_active=2, freeze_interval=4) and freeze.freeze_interval == 4


def test_the_callbacks_arguments_are_the_configs_fields_with_the_same_defaults():
    """LightningCLI reads AutoFreeze's signature: it must stay the config's field list, in order, with its defaults."""
    parameters = list(inspect.signature(AutoFreeze).parameters.values())
    fields = dataclasses.fields(AutoFreezeConfig)
    assert [p.name for p in parameters] == [f.name for f in fields]
    assert [p.default for p in parameters] == [f.default for f in fields]
    assert [str(p.annotation) for p in parameters] == [str(f.type) for f in fields]


def test_the_field_docstrings_are_the_autofreeze_table_of_the_configuration_docs():
    """What the table generated from the fields (as the strategy's is) will print: the table as it reads today."""
    docs = _field_docs(AutoFreezeConfig)
    section = DOCS.read_text().split("## `AutoFreeze` (callback)")[1].split("\n## ")[0]
    rows = re.findall(r"^\| `(\w+)` \| `[^`]*` \| (.*) \|$", section, flags=re.M)
    assert [name for name, _ in rows] == [f.name for f in dataclasses.fields(AutoFreezeConfig)]
    assert {name: meaning for name, meaning in rows} == docs


def test_the_arguments_stay_readable_on_the_callback_as_before_the_config():
    """User code reads ``autofreeze.min_active`` and the like: each argument stays an attribute, equal to the config's."""
    schedule = {0: 1, 2: 3}
    freeze = AutoFreeze(alpha=0.25, schedule=schedule, min_active=2, percentile=40.0, freeze_every_n_epochs=2, layers="encoder.layer")
    assert (freeze.alpha, freeze.min_active, freeze.percentile, freeze.freeze_every_n_epochs, freeze.layers, freeze.anneal) == (
        0.25, 2, 40.0, 2, "encoder.layer", None,
    )  # fmt: skip
    assert freeze.schedule is freeze.config.explicit_schedule and [freeze.schedule(e) for e in range(4)] == [1, 1, 3, 3]
