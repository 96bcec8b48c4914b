"""Balanced contiguous partition of a block stack: the exact min-max solution.

A pipeline runs as fast as its slowest stage, so AutoPipe wants the contiguous split of the
per-block costs into ``k`` stages whose largest stage cost is as small as possible. The paper
used a greedy heuristic (kept here as :func:`paper_greedy_partition`, for comparison); the exact
answer is a small dynamic programme (``O(k n^2)`` for ``n`` blocks, milliseconds for Transformer
depths), so there is no reason to approximate.

A partition is written as a *balance*, as in torchgpipe: the number of blocks per stage,
e.g. ``(4, 4, 4)`` for 12 blocks on 3 stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from statistics import pvariance

from lightning_pipetransformer.plan import boundaries

__all__ = [
    "active_balance",
    "optimal_partition",
    "paper_greedy_partition",
    "stage_costs",
    "compress_pipe_len",
]

Balance = tuple[int, ...]


def optimal_partition(costs: Sequence[float], k: int) -> Balance:
    """Split ``costs`` into ``k`` non-empty contiguous stages minimising the largest stage sum.

    Among the splits that reach that minimum, the one with the smallest sum of squared stage
    costs is returned: the pipeline's speed only depends on its slowest stage, but the evener
    split leaves slack everywhere when the cost proxy is off. Remaining ties put more blocks in
    *later* stages, so the first device (which also holds the embeddings and any frozen prefix)
    gets the lighter share.

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

    # Pass 1: the smallest achievable largest-stage cost.
    bottleneck = _min_max(prefix, k)
    # Pass 2: among splits whose every stage fits the bottleneck, the least sum of squares.
    # The slack absorbs the rounding of prefix differences against pass 1's value.
    limit = bottleneck * (1 + 1e-9) + 1e-12
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for s in range(j - 1, i):  # the last stage holds blocks s..i-1
                stage = prefix[i] - prefix[s]
                if stage > limit or best[j - 1][s] == inf:
                    continue
                value = best[j - 1][s] + stage * stage
                # '<' keeps the smallest s on ties: the last stage is as long as allowed, so
                # later stages take more blocks and the first stage stays light.
                if value < best[j][i] * (1 - 1e-12):
                    best[j][i] = value
                    cut[j][i] = s
    balance: list[int] = []
    i = n
    for j in range(k, 0, -1):
        s = cut[j][i]
        balance.append(i - s)
        i = s
    return tuple(reversed(balance))


def _min_max(prefix: Sequence[float], k: int) -> float:
    """The exact min-max value of splitting the costs behind ``prefix`` into ``k`` stages."""
    n = len(prefix) - 1
    inf = float("inf")
    # best[j][i]: the smallest possible largest-stage cost for the first i blocks in j stages.
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            best[j][i] = min(max(best[j - 1][s], prefix[i] - prefix[s]) for s in range(j - 1, i))
    return best[k][n]


def paper_greedy_partition(
    costs: Sequence[float],
    k: int,
    *,
    num_frozen: int = 0,
    frozen_cost: float = 1 / 6,
) -> Balance:
    """The PipeTransformer paper's greedy ``load_balance`` (Algorithm 1), for comparison only.

    Re-implemented from the paper and its official code: the ``num_frozen`` leading blocks are
    pinned to stage 0 where they weigh ``frozen_cost`` times their cost; then stage ``j`` takes
    the next blocks while its load plus the next block stays below ``mean + var``, where
    ``mean`` is the remaining *active* cost over the ``k - j`` stages left and ``var`` is the
    population variance of the remaining costs over ``k - j``; the last stage takes the rest.
    ``costs`` are raw (unweighted). The threshold adds a variance to a mean, so the result
    depends on the unit of the costs (the official code used millions of parameters).

    Being greedy it can overfill early stages and even leave a stage empty (a 0 in the balance,
    an idle device); :func:`optimal_partition` never does.
    """
    n = len(costs)
    if k < 1:
        raise ValueError(f"The number of stages must be at least 1, got {k}.")
    if not 0 <= num_frozen <= n:
        raise ValueError(f"num_frozen must be in 0..{n}, got {num_frozen}.")
    if not 0.0 <= frozen_cost <= 1.0:
        raise ValueError(f"frozen_cost must be in [0, 1], got {frozen_cost}.")
    sizes = [0] * k
    loads = [0.0] * k
    sizes[0] = num_frozen
    loads[0] = frozen_cost * float(sum(costs[:num_frozen]))
    assigned = num_frozen
    remaining = float(sum(costs[num_frozen:]))
    for stage in range(k):
        left = k - stage
        mean = remaining / left
        var = pvariance([float(c) for c in costs[assigned:]]) / left if assigned < n else 0.0
        while assigned < n:
            c = float(costs[assigned])
            if stage == k - 1 or loads[stage] + c < mean + var:
                loads[stage] += c
                sizes[stage] += 1
                assigned += 1
                remaining -= c
            else:
                break
    return tuple(sizes)


def stage_costs(costs: Sequence[float], balance: Sequence[int]) -> tuple[float, ...]:
    """The summed cost of each stage of ``balance``."""
    if sum(balance) != len(costs) or any(b < 1 for b in balance):
        raise ValueError(f"Balance {tuple(balance)} does not split {len(costs)} blocks into non-empty stages.")
    edges = boundaries(balance)
    return tuple(float(sum(costs[a:b])) for a, b in zip(edges[:-1], edges[1:]))


def active_balance(partition: Sequence[int], num_frozen: int) -> tuple[Balance, tuple[int, ...]]:
    """The partition of the active blocks once the frozen prefix is served from the cache.

    Returns ``(balance, stage_indices)``: stages left empty by removing the first ``num_frozen``
    blocks are dropped (their devices idle while the cache serves the prefix), and
    ``stage_indices`` says which original stages (hence devices) the remaining ones are.
    """
    balance: list[int] = []
    stages: list[int] = []
    left = num_frozen
    for index, size in enumerate(partition):
        take = min(left, size)
        left -= take
        if size - take > 0:
            balance.append(size - take)
            stages.append(index)
    return tuple(balance), tuple(stages)


def compress_pipe_len(
    costs: Sequence[float],
    pipe_len: int,
    devices_per_node: int,
    budget: float,
    *,
    partition: Callable[[Sequence[float], int], Balance] = optimal_partition,
) -> int:
    """AutoPipe's compression rule: halve the pipeline while it still fits the budget.

    Starting from ``pipe_len``, try ``K -> K/2`` repeatedly while ``K/2`` is a whole number that
    divides ``devices_per_node`` and the optimal partition's largest stage at ``K/2`` costs no
    more than ``budget`` (the paper uses the largest stage cost at the start of training, so a
    shorter pipeline is never slower per micro-batch than the initial one).

    ``costs`` are the per-block costs *after* weighting frozen blocks. ``partition`` replaces the
    optimal partition (the cost model passes the paper's greedy to replay the paper's code); a
    stage it leaves empty costs 0.
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
        edges = boundaries(partition(costs, half))
        if max(float(sum(costs[a:b])) for a, b in zip(edges[:-1], edges[1:])) > budget * (1 + 1e-9):
            break
        k = half
    return k
