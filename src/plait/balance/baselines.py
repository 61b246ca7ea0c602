"""Baselines the balancer is measured against, kept out of the stages.

`greedy` is textbook LPT with capacity (tests check `assign` is never worse); `first_fit` is the packing
a per-rank loader does (`plait bench balance` compares against it).
"""

from __future__ import annotations

import numpy as np

from plait.jit import jit

from .driver import Assignment


def greedy(lengths, costs, *, ranks: int, microbatches: int, capacity: int) -> Assignment:
    """The textbook baseline (LPT with capacity, no cap, one rank scan per item): tests compare to it."""
    lengths = np.asarray(lengths, dtype=np.int64)
    costs = np.asarray(costs, dtype=np.float64)
    n, R, M = len(lengths), ranks, microbatches
    rank = np.full(n, -1, dtype=np.int32)
    micro = np.full(n, -1, dtype=np.int32)
    rank_cost = np.zeros(R)
    micro_cost = np.zeros((R, M))
    room = np.full((R, M), capacity, dtype=np.int64)
    for i in np.lexsort((np.arange(n), -costs)):
        ok = room.max(axis=1) >= lengths[i]
        if not ok.any():
            continue
        r = int(np.argmin(np.where(ok, rank_cost, np.inf)))
        m = int(np.argmin(np.where(room[r] >= lengths[i], room[r], capacity + 1)))
        rank[i], micro[i] = r, m
        rank_cost[r] += costs[i]
        micro_cost[r, m] += costs[i]
        room[r, m] -= lengths[i]
    return Assignment(rank, micro, rank_cost, micro_cost, capacity - room)


@jit
def first_fit(rank, lengths, M, capacity, micro):
    """Baseline packing (per-rank loaders): item i, in order, into rank[i]'s first micro-batch with
    room; micro[i] = -1 when none has. Used by `plait bench balance`."""
    R = 1
    for i in range(len(rank)):
        if rank[i] + 1 > R:
            R = rank[i] + 1
    room = np.full((R, M), capacity, dtype=np.int64)
    for i in range(len(lengths)):
        r = rank[i]
        micro[i] = -1
        for j in range(M):
            if room[r, j] >= lengths[i]:
                room[r, j] -= lengths[i]
                micro[i] = j
                break
