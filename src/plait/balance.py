"""Balancing: assign each document (chunk) of a global step to a (DP rank, micro-batch).

The objective is the step time: the largest total cost over DP ranks, subject to every micro-batch
holding at most `capacity` tokens. This module is pure: arrays in, arrays out, deterministic.

Lower bound (the certificate reported with every step): no assignment can beat
    LB = max(sum(cost) / ranks, max(cost)).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Assignment:
    rank: np.ndarray  # int32 [n]; -1: not placed this step (carried to the next)
    micro: np.ndarray  # int32 [n]; position of the micro-batch in the rank's order
    rank_cost: np.ndarray  # float64 [R]
    micro_cost: np.ndarray  # float64 [R, M]
    micro_tokens: np.ndarray  # int64 [R, M]

    @property
    def placed(self) -> np.ndarray:
        return self.rank >= 0


def lower_bound(costs: np.ndarray, ranks: int) -> float:
    if len(costs) == 0:
        return 0.0
    return max(float(costs.sum()) / ranks, float(costs.max()))


def middle_heavy_order(micro_cost: np.ndarray) -> np.ndarray:
    """For each rank, a permutation of its micro-batches placing the heaviest in the middle.

    Pipeline parallelism's warm-up and cool-down phases then run the light ones. Returns new_pos[r, m].
    """
    R, M = micro_cost.shape
    order = np.argsort(micro_cost, axis=1, kind="stable")  # lightest first
    # Slots from the outside in: 0, M-1, 1, M-2, ...
    slots = np.empty(M, dtype=np.int64)
    slots[0::2] = np.arange((M + 1) // 2)
    slots[1::2] = M - 1 - np.arange(M // 2)
    new_pos = np.empty((R, M), dtype=np.int64)
    np.put_along_axis(new_pos, order, np.broadcast_to(slots, (R, M)), axis=1)
    return new_pos


def assign(
    lengths: np.ndarray,
    costs: np.ndarray,
    *,
    ranks: int,
    microbatches: int,
    capacity: int,
    priority: np.ndarray | None = None,
) -> Assignment:
    """Largest-cost-first onto the least-loaded rank that has a micro-batch with room.

    Items with higher `priority` (e.g. carried from an earlier step) are placed first. Inside the
    chosen rank the item goes to the fullest micro-batch it fits in (best fit). Items that fit nowhere stay
    unplaced (rank -1).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    costs = np.asarray(costs, dtype=np.float64)
    n = len(lengths)
    R, M = ranks, microbatches
    if priority is None:
        priority = np.zeros(n, dtype=np.int64)
    # Largest cost first; chunks that already waited two steps jump the queue so nothing starves.
    urgent = (np.asarray(priority) >= 2).astype(np.int64)
    order = np.lexsort((np.arange(n), -costs, -urgent))
    rank = np.full(n, -1, dtype=np.int32)
    micro = np.full(n, -1, dtype=np.int32)
    rank_cost = np.zeros(R)
    micro_cost = np.zeros((R, M))
    room = np.full((R, M), capacity, dtype=np.int64)
    best_room = np.full(R, capacity, dtype=np.int64)
    for i in order:
        L = lengths[i]
        ok = best_room >= L
        if not ok.any():
            continue
        r = int(np.argmin(np.where(ok, rank_cost, np.inf)))
        fits = room[r] >= L
        m = int(np.argmin(np.where(fits, room[r], capacity + 1)))  # best fit: keep big holes for big items
        rank[i], micro[i] = r, m
        rank_cost[r] += costs[i]
        micro_cost[r, m] += costs[i]
        room[r, m] -= L
        best_room[r] = room[r].max()
    micro_tokens = capacity - room
    new_pos = middle_heavy_order(micro_cost)
    placed = rank >= 0
    micro[placed] = new_pos[rank[placed], micro[placed]]
    inv = np.argsort(new_pos, axis=1)
    micro_cost = np.take_along_axis(micro_cost, inv, axis=1)
    micro_tokens = np.take_along_axis(micro_tokens, inv, axis=1)
    return Assignment(rank, micro, rank_cost, micro_cost, micro_tokens)
