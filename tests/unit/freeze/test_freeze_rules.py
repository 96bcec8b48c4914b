"""Freeze rules against hand-computed values."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_pipetransformer.freeze.rules import (
    ExplicitSchedule,
    geometric_num_frozen,
    paper_num_frozen,
    validate_alpha,
)


def test_geometric_schedule_l12_alpha_third():
    # By hand: 12 * (1 - (2/3)^T) = 0, 4, 6.67, 8.44, 9.63, 10.42, 10.95, 11.30 -> ceil.
    assert [geometric_num_frozen(12, 1 / 3, t) for t in range(8)] == [0, 4, 7, 9, 10, 11, 11, 12]


def test_geometric_schedule_half_and_quarter():
    # 12 * (1 - 0.5^T) = 0, 6, 9, 10.5, 11.25 -> 0, 6, 9, 11, 12
    assert [geometric_num_frozen(12, 0.5, t) for t in range(5)] == [0, 6, 9, 11, 12]
    # 6 * (1 - 0.75^T) = 0, 1.5, 2.625, 3.47, 4.10 -> 0, 2, 3, 4, 5
    assert [geometric_num_frozen(6, 0.25, t) for t in range(5)] == [0, 2, 3, 4, 5]


@given(st.integers(1, 48), st.floats(0.01, 0.99), st.integers(0, 30))
def test_geometric_is_monotone_and_bounded(num_blocks, alpha, step):
    a, b = geometric_num_frozen(num_blocks, alpha, step), geometric_num_frozen(num_blocks, alpha, step + 1)
    assert 0 <= a <= b <= num_blocks


def test_paper_rule_gradient_term_wins():
    # Geometric bound from 0 with alpha 1/3 on 12 blocks is 4; smallest norm at block 1 -> freeze 0..1.
    norms = [5.0, 0.5, 3.0, 0.1, 9, 9, 9, 9, 9, 9, 9, 9]
    # block 3 has the smallest norm overall -> candidate 4 = geometric 4
    assert paper_num_frozen(0, 1 / 3, norms) == 4
    norms[1] = 0.01  # now block 1 is the smallest -> 2 < 4
    assert paper_num_frozen(0, 1 / 3, norms) == 2


def test_paper_rule_geometric_term_wins_and_ignores_frozen_norms():
    # F=4, geometric: 4 + (12-4)/3 = 6.67 -> 7. Smallest active norm at block 11 -> 12. min = 7.
    norms = [0.0] * 4 + [5, 5, 5, 5, 5, 5, 5, 0.2]
    assert paper_num_frozen(4, 1 / 3, norms) == 7


def test_paper_rule_freezes_at_least_one_and_stops_at_l():
    assert paper_num_frozen(11, 0.1, [1.0] * 12) == 12  # 11 + 0.1 -> ceil 12
    assert paper_num_frozen(12, 0.5, [1.0] * 12) == 12
    with pytest.raises(ValueError):
        paper_num_frozen(13, 0.5, [1.0] * 12)


@pytest.mark.parametrize("alpha", [0, 1, -0.1, 1.5, True, "0.3", None, math.nan])
def test_bad_alpha(alpha):
    with pytest.raises(ValueError, match="alpha"):
        validate_alpha(alpha)


def test_explicit_dict_schedule_is_a_step_function():
    s = ExplicitSchedule({1: 2, 3: 5})
    assert [s(e) for e in range(5)] == [0, 2, 2, 5, 5]
    s.validate(limit=5, num_epochs=5)
    with pytest.raises(ValueError, match="decreases"):
        ExplicitSchedule({1: 3, 2: 1}).validate(limit=5, num_epochs=None)
    with pytest.raises(ValueError, match="outside"):
        ExplicitSchedule({1: 6}).validate(limit=5, num_epochs=None)


def test_explicit_callable_schedule_checked_over_the_run():
    s = ExplicitSchedule(lambda e: min(e, 3))
    assert [s(e) for e in range(6)] == [0, 1, 2, 3, 3, 3]
    s.validate(limit=3, num_epochs=10)
    with pytest.raises(ValueError, match="outside"):
        s.validate(limit=2, num_epochs=10)
    with pytest.raises(ValueError, match="decreases"):
        ExplicitSchedule(lambda e: 3 - e).validate(limit=5, num_epochs=3)
    with pytest.raises(TypeError):
        ExplicitSchedule(lambda e: 1.5)(0)
