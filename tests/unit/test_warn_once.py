"""One warn-once state: each reason said once per owner, each owner on its own."""

from __future__ import annotations

import warnings

from lightning_pipetransformer.warn_once import WarnOnce


def test_each_reason_once_per_owner_and_the_warning_points_at_the_caller():
    first, second = WarnOnce(), WarnOnce()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def feature() -> list[bool]:
            return [first("disk", "disk full"), first("disk", "disk full again"), first("nan", "NaN")]

        said = feature()
        second("disk", "disk full")
    assert said == [True, False, True]
    assert [str(w.message) for w in caught] == ["disk full", "NaN", "disk full"]
    assert caught[0].filename == __file__  # the caller of the feature's warn, not warn_once.py


def test_a_custom_emitter_gets_the_message():
    heard: list[str] = []
    once = WarnOnce(lambda message, stacklevel: heard.append(message))
    once("r", "a"), once("r", "b"), once("s", "c")
    assert heard == ["a", "c"]
