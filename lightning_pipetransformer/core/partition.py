"""Balanced contiguous partition of a block stack: the exact min-max solution.

A pipeline runs as fast as its slowest stage, so AutoPipe wants the contiguous split of the
per-block costs into ``k`` stages whose largest stage cost is as small as possible. The paper
used a greedy heuristic; the exact answer is a small dynamic programme (``O(k n^2)`` for ``n``
blocks, microseconds for Transformer depths), so there is no reason to approximate.

A partition is written as a *balance*, as in torchgpipe: the number of blocks per stage,
e.g. ``(4, 4, 4)`` for 12 blocks on 3 stages.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["optimal_partition", "stage_costs", "boundaries", "compress_pipe_len"]

Balance = tuple[int, ...]


def optimal_partition(costs: Sequence[float], k: int) -> Balance:
    """Split ``costs`` into ``k`` non-empty contiguous stages minimising the largest stage sum.

    Ties are broken towards putting more blocks in *later* stages, so the first device (which
    also holds the embeddings and any frozen prefix) gets the lighter share.

    Raises:
        ValueError: ``k`` is not in ``1..len(costs)`` or a cost is negative.
    """
    n = len(costs)
    if k < 1:
        raise ValueError(f"The number of stages must be at least 1, got {k}.")
    if k > n:
        raise ValueError(
            f"Cannot split {n} blocks into {k} non-empty stages: use a pipeline length of at most {n}."
        )
    if any(c < 0 for c in costs):
        raise ValueError(f"Block costs must be non-negative, got {list(costs)}.")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    inf = float("inf")
    # best[j][i]: the smallest possible largest-stage cost for the first i blocks in j stages.
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for s in range(j - 1, i):  # the last stage holds blocks s..i-1
                value = max(best[j - 1][s], prefix[i] - prefix[s])
                # '<=' keeps the largest s on ties: later stages take more blocks.
                if value <= best[j][i]:
                    best[j][i] = value
                    cut[j][i] = s
    balance: list[int] = []
    i = n
    for j in range(k, 0, -1):
        s = cut[j][i]
        balance.append(i - s)
        i = s
    return tuple(reversed(balance))


def boundaries(balance: Sequence[int]) -> tuple[int, ...]:
    """Block index where each stage starts, plus the total: ``(4, 4, 4) -> (0, 4, 8, 12)``."""
    out = [0]
    for size in balance:
        out.append(out[-1] + size)
    return tuple(out)


def stage_costs(costs: Sequence[float], balance: Sequence[int]) -> tuple[float, ...]:
    """The summed cost of each stage of ``balance``."""
    if sum(balance) != len(costs) or any(b < 1 for b in balance):
        raise ValueError(f"Balance {tuple(balance)} does not split {len(costs)} blocks into non-empty stages.")
    edges = boundaries(balance)
    return tuple(float(sum(costs[a:b])) for a, b in zip(edges[:-1], edges[1:]))


def compress_pipe_len(
    costs: Sequence[float],
    pipe_len: int,
    devices_per_node: int,
    budget: float,
) -> int:
    """AutoPipe's compression rule: halve the pipeline while it still fits the budget.

    Starting from ``pipe_len``, try ``K -> K/2`` repeatedly while ``K/2`` is a whole number that
    divides ``devices_per_node`` and the optimal partition's largest stage at ``K/2`` costs no
    more than ``budget`` (the paper uses the largest stage cost at the start of training, so a
    shorter pipeline is never slower per micro-batch than the initial one).

    ``costs`` are the per-block costs *after* weighting frozen blocks.
    """
    if pipe_len < 1 or devices_per_node % pipe_len != 0:
        raise ValueError(
            f"The pipeline length {pipe_len} must divide the {devices_per_node} devices per node."
        )
    k = pipe_len
    while k % 2 == 0:
        half = k // 2
        if devices_per_node % half != 0 or half > len(costs):
            break
        if max(stage_costs(costs, optimal_partition(costs, half))) > budget * (1 + 1e-9):
            break
        k = half
    return k
