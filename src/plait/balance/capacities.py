"""The encoder capacities of a micro-batch beside its tokens (image patches, video patches, audio frames):
their weights, and the tests every stage makes on them.

An item has a load in each of the K capacities (`loads` int64 [n, K]) and fits a micro-batch only where
its tokens and every load fit. Kernels loop over the K capacities: K = 0 is text, and one code path
serves one capacity or several.
"""

from __future__ import annotations

import math

import numpy as np

from plait.jit import jit

def no_loads(n: int) -> np.ndarray:
    """The loads of n items without encoder capacities: [n, 0]."""
    return np.zeros((n, 0), dtype=np.int64)


def capacities(capacity: int, load_capacity=None) -> tuple:
    """The kernels' caps: (token capacity, load capacities int64 [K], weights float64 [K + 1]).

    weights[0] weighs a token and weights[1 + k] a unit of load k so that a full micro-batch weighs the
    same in every capacity: fractions of capacity compared in one number (best fit, and the rounds' "every
    rank has room" test). They are the integers prod(capacities) / capacity when those stay exact in a
    float64 (with one encoder capacity: the patch capacity for a token and the token capacity for a
    patch - exactly the integer arithmetic of the two-capacity kernels before), else 1 / capacity."""
    load_capacity = np.zeros(0, dtype=np.int64) if load_capacity is None else \
        np.ascontiguousarray(load_capacity, dtype=np.int64).reshape(-1)
    caps = [int(capacity)] + [int(c) for c in load_capacity]
    prod = math.prod(caps)
    exact = (len(caps) * prod) < 2**53
    weights = np.array([prod // c if exact else 1.0 / c for c in caps], dtype=np.float64)
    return int(capacity), load_capacity, weights


@jit
def lacking(pbest, r, P):
    """The first encoder capacity in which rank r has no micro-batch with room for loads P (-1: none)."""
    for k in range(len(P)):
        if pbest[k, r] < P[k]:
            return k
    return -1


@jit
def best_fit_loads(room, proom, r, L, P, weights):
    """Rank r's fullest micro-batch with room for L tokens and loads P (-1: none): the least room left
    after it, tokens and each load weighed as a fraction of its capacity (ties: the first)."""
    m = -1
    mr = 0.0
    for j in range(room.shape[1]):
        if room[r, j] < L:
            continue
        left = (room[r, j] - L) * weights[0]
        for k in range(len(P)):
            if proom[r, j, k] < P[k]:
                left = -1.0
                break
            left += (proom[r, j, k] - P[k]) * weights[1 + k]
        if left >= 0.0 and (m < 0 or left < mr):
            mr = left
            m = j
    return m


@jit
def need(L, P, weights):
    """The fit an item of L tokens and loads P needs (see LptState.fit)."""
    v = L * weights[0]
    for k in range(len(P)):
        v = max(v, P[k] * weights[1 + k])
    return v


@jit
def fits(room, proom, g, L, P):
    """Whether micro-batch g (flat index into room [G] / proom [G, K]) has room for L tokens and loads P."""
    if room[g] < L:
        return False
    for k in range(len(P)):
        if proom[g, k] < P[k]:
            return False
    return True
