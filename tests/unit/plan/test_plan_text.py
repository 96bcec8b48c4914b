"""A printed plan says what its numbers are: costs with their unit, no bare floats."""

from __future__ import annotations

import re

from lightning_pipetransformer.plan import Plan


def test_str_of_a_plan_names_its_units() -> None:
    plan = Plan(num_frozen=2, pipe_len=2, chunks=4, partition=(4, 2), devices=(("cuda:0", "cuda:1"),), active_ranks=(0,),
                stage_costs=(441578.67, 220000.0), budget=668544.0)  # fmt: skip
    text = str(plan)
    assert text.startswith("Plan: 2 of 6 blocks frozen; pipe length 2 (blocks per stage (4, 2)); 4 micro-batch(es) per batch")
    assert "stage costs 441,579 / 220,000 weighted parameters" in text and "budget 668,544" in text
    assert not re.search(r"\d\.\d", text), text  # no unexplained floats such as 441578.67
    assert repr(plan).startswith("Plan(num_frozen=2, pipe_len=2")  # the fields, as before
    bare = Plan(num_frozen=0, pipe_len=1, chunks=1, partition=(6,), devices=(("cpu",),), active_ranks=(0,))
    assert str(bare) == "Plan: 0 of 6 blocks frozen; pipe length 1 (blocks per stage (6,)); 1 micro-batch(es) per batch; 1 replica(s) on rank(s) 0."
