"""Brute-force references for the partition and planner tests: every contiguous split, tried."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence


def all_balances(n: int, k: int) -> Iterator[tuple[int, ...]]:
    """Every split of n blocks into k non-empty contiguous stages."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = (0, *cuts, n)
        yield tuple(b - a for a, b in zip(edges[:-1], edges[1:]))


def sums(costs: Sequence[float], balance: Sequence[int]) -> list[float]:
    """The cost of each stage of ``balance``."""
    out, i = [], 0
    for b in balance:
        out.append(float(sum(costs[i : i + b])))
        i += b
    return out


def brute_min_max(costs: Sequence[float], k: int) -> float:
    """The smallest possible cost of the most expensive of k contiguous stages."""
    return min(max(sums(costs, b)) for b in all_balances(len(costs), k))
