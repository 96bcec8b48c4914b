"""Partition algorithms: the exact min-max split against brute force, the halving rule, the greedy."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipetransformer.pipe.partition import (
    active_balance,
    boundaries,
    compress_pipe_len,
    optimal_partition,
    paper_greedy_partition,
    stage_costs,
)
from tests.helpers.partitions import all_balances, brute_min_max, sums

cost_lists = st.lists(st.integers(min_value=0, max_value=30), min_size=1, max_size=9)


@settings(max_examples=300, deadline=None)
@given(costs=cost_lists, data=st.data())
def test_optimal_matches_brute_force(costs: list[int], data: st.DataObject) -> None:
    k = data.draw(st.integers(min_value=1, max_value=len(costs)))
    balance = optimal_partition(costs, k)
    assert len(balance) == k and all(b >= 1 for b in balance) and sum(balance) == len(costs)
    best = brute_min_max(costs, k)
    assert max(sums(costs, balance)) == best
    # Among the min-max optima it is the evenest (least sum of squares).
    evenest = min(sum(s * s for s in sums(costs, b)) for b in all_balances(len(costs), k) if max(sums(costs, b)) == best)
    assert sum(s * s for s in sums(costs, balance)) == evenest


@settings(max_examples=100, deadline=None)
@given(
    costs=st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1, max_size=8),
    data=st.data(),
)
def test_optimal_matches_brute_force_on_floats(costs: list[float], data: st.DataObject) -> None:
    k = data.draw(st.integers(min_value=1, max_value=len(costs)))
    got = max(sums(costs, optimal_partition(costs, k)))
    assert got == pytest.approx(brute_min_max(costs, k), rel=1e-9, abs=1e-9)


def test_ties_put_more_blocks_in_later_stages() -> None:
    assert optimal_partition([1, 1, 1], 2) == (1, 2)
    assert optimal_partition([1.0] * 12, 8) == (1, 1, 1, 1, 2, 2, 2, 2)
    # A heavy first block (embeddings): the rest is spread evenly, not dumped on the last stage.
    assert optimal_partition([4.0] + [1.0] * 11, 8) == (1, 1, 1, 1, 2, 2, 2, 2)


def test_optimal_partition_bad_input() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        optimal_partition([1, 2], 0)
    with pytest.raises(ValueError, match="at most 2"):
        optimal_partition([1, 2], 3)
    with pytest.raises(ValueError, match="non-negative"):
        optimal_partition([1, -2], 1)


def test_boundaries_and_stage_costs() -> None:
    assert boundaries((4, 4, 4)) == (0, 4, 8, 12)
    assert boundaries((1,)) == (0, 1)
    assert stage_costs([1, 2, 3, 4, 5], (2, 3)) == (3.0, 12.0)
    with pytest.raises(ValueError, match="does not split"):
        stage_costs([1, 2, 3], (1, 1))
    with pytest.raises(ValueError, match="non-empty"):
        stage_costs([1, 2, 3], (3, 0))


@pytest.mark.parametrize(
    ("budget", "expected"),
    [(2.0, 8), (2.9, 8), (3.0, 4), (5.9, 4), (6.0, 2), (11.9, 2), (12.0, 1), (100.0, 1)],
)
def test_compress_pipe_len_equal_blocks(budget: float, expected: int) -> None:
    # 12 equal blocks: the best largest stage is 2 at K=8, 3 at K=4, 6 at K=2, 12 at K=1.
    assert compress_pipe_len([1.0] * 12, 8, 8, budget) == expected


def test_compress_pipe_len_keeps_a_divisor() -> None:
    # 6 devices per node: 6 -> 3, and 3 cannot halve.
    assert compress_pipe_len([1.0] * 12, 6, 6, 100.0) == 3
    # 12 devices, start at 4: 4 -> 2 -> 1.
    assert compress_pipe_len([1.0] * 12, 4, 12, 100.0) == 1
    with pytest.raises(ValueError, match="must divide"):
        compress_pipe_len([1.0] * 12, 3, 8, 1.0)


@settings(max_examples=150, deadline=None)
@given(
    costs=st.lists(st.integers(min_value=0, max_value=20), min_size=1, max_size=9),
    k0=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(min_value=0, max_value=100),
)
def test_compress_pipe_len_against_brute_force(costs: list[int], k0: int, budget: int) -> None:
    if k0 > len(costs):
        return
    k = compress_pipe_len(costs, k0, 8, budget)
    # Every halving taken fits the budget; the next one (if there is one) does not.
    level = k0
    while level > k:
        level //= 2
        assert brute_min_max(costs, level) <= budget
    if k > 1:
        assert brute_min_max(costs, k // 2) > budget


def test_paper_greedy_by_hand() -> None:
    # Equal costs: variance 0, mean 2; stage 0 stops when load + next < 2 fails, after 1 block.
    assert paper_greedy_partition([1, 1, 1, 1], 2) == (1, 3)
    # mean 20/2 = 10, var = pvar([2,8,2,8]) / 2 = 4.5: stage 0 takes 2, 8, 2 (12 < 14.5), not 8.
    assert paper_greedy_partition([2, 8, 2, 8], 2) == (3, 1)
    # A heavy first block: mean 8/3, var = pvar([4,1,1,1,1]) / 3 = 0.48, and 4 >= 3.15, so stage 0
    # stays empty (an idle device); stage 1: 4 < 4 + 0.72, 5 not; stage 2 takes the rest.
    assert paper_greedy_partition([4, 1, 1, 1, 1], 3) == (0, 1, 4)
    # Frozen prefix: pinned on stage 0 at 1/6 of its cost (12/6 = 2); active mean = 3/2, var 0.
    assert paper_greedy_partition([6, 6, 1, 1, 1], 2, num_frozen=2) == (2, 3)


@settings(max_examples=150, deadline=None)
@given(costs=cost_lists, data=st.data())
def test_paper_greedy_never_beats_optimal(costs: list[int], data: st.DataObject) -> None:
    k = data.draw(st.integers(min_value=1, max_value=len(costs)))
    f = data.draw(st.integers(min_value=0, max_value=len(costs)))
    weighted = [c / 6 if i < f else float(c) for i, c in enumerate(costs)]
    greedy = paper_greedy_partition(costs, k, num_frozen=f, frozen_cost=1 / 6)
    assert len(greedy) == k and sum(greedy) == len(costs) and greedy[0] >= f
    assert max(sums(weighted, greedy)) >= max(sums(weighted, optimal_partition(weighted, k))) - 1e-9


def test_paper_greedy_bad_input() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        paper_greedy_partition([1, 2], 0)
    with pytest.raises(ValueError, match="num_frozen"):
        paper_greedy_partition([1, 2], 1, num_frozen=3)
    with pytest.raises(ValueError, match="frozen_cost"):
        paper_greedy_partition([1, 2], 1, frozen_cost=2.0)


def test_active_balance_drops_emptied_stages():
    assert active_balance((3, 1), 3) == ((1,), (1,))
    assert active_balance((2, 2, 2), 3) == ((1, 2), (1, 2))
    assert active_balance((4,), 0) == ((4,), (0,))
