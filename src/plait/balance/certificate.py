"""The certificate reported with every step, and the measures passes are compared by.

No assignment of a step's items to `ranks` ranks can have a largest rank cost below
    LB = max(sum(cost) / ranks, max(cost)),
so max(rank cost) / LB >= 1 certifies how far from optimal an assignment is at most. Passes that hold
items back (the cost cap, stage 3) are compared by this ratio over the items they placed, and by the
tokens they placed.
"""

from __future__ import annotations

import numpy as np

from plait.jit import jit

def lower_bound(costs: np.ndarray, ranks: int) -> float:
    """max(sum / ranks, max) of the costs: no assignment's largest rank cost is lower (0.0: no items)."""
    if len(costs) == 0:
        return 0.0
    return max(float(costs.sum()) / ranks, float(costs.max()))


def pass_ratio(rank, rank_cost, costs, R) -> float:
    """max(rank cost) / LB of the placed items (rank >= 0) of a pass; 1.0 when LB is 0."""
    lb = lower_bound(costs[rank >= 0], R)  # numpy's pairwise sum: more exact than a running one
    return float(rank_cost.max()) / lb if lb > 0 else 1.0


@jit
def placed_tokens(rank, lengths):
    """Tokens of the placed items (rank >= 0)."""
    total = 0
    for i in range(len(rank)):
        if rank[i] >= 0:
            total += lengths[i]
    return total


def capacity_lower_bound(lengths, costs, loads=None, *, ranks: int, microbatches: int, capacity: int,
                         load_capacity=None) -> float:
    """A lower bound on the largest rank cost of any assignment of all these items that respects the
    capacities; at least lower_bound(costs, ranks). microbatches: the most a rank may run (variable mode:
    max_microbatches).

    loads [n, K] (or [n]) and load_capacity [K]: the encoder capacities (see assign), each a floor too.

    Proof. A rank holds at most T = microbatches * capacity tokens (and Q_k = microbatches *
    load_capacity[k] of each load k). Take any h of the R ranks: the other R - h hold at most (R - h) T tokens,
    so these h hold at least N - (R - h) T of the N tokens (likewise patches). Take a class of k items
    (the long ones: (j + 1) * L > capacity, j = 1, 2, 3, or the same in a load - what cannot be split
    evenly over ranks when tokens bind) and k = q R + s (0 <= s < R): the h ranks holding the most of
    them hold at least G(h) = h q + min(h, s). (If the h-th of them holds >= q + 1, they hold >= h (q + 1);
    else the other R - h hold <= q each, so these hold >= k - (R - h) q = h q + s.) So for those h ranks
    the union S of their items satisfies the covering constraints  sum_S a_u >= rhs_u  (a_u: lengths,
    loads, or the class indicator; rhs_u: the floors above and G(h)). For any multipliers theta_u >= 0,
    with y_i = max(0, sum_u theta_u a_ui - c_i) >= 0:
        cost(S) = sum_S c_i >= sum_S (sum_u theta_u a_ui - y_i) >= sum_u theta_u rhs_u - sum_all y_i
    (weak LP duality: c_i >= theta . a_i - y_i, y_i >= 0, theta_u >= 0). The largest of the h rank costs
    is at least cost(S) / h, for every theta >= 0 and every h. The bound takes h in {1, s, R/4, R/2,
    3R/4}, the multipliers by a few rounds of coordinate ascent (each coordinate maximised exactly: a
    concave piecewise linear function of it; any choice is valid), and lowers the value by 1e-12
    relative, so rounding never lifts it over an optimum it equals. Costs must be finite.
    """
    costs = np.asarray(costs, dtype=np.float64)
    best = lower_bound(costs, ranks)
    R = int(ranks)
    if len(costs) == 0 or R < 2:
        return best
    floors = [(np.asarray(lengths, dtype=np.float64), float(microbatches) * capacity)]
    if loads is not None and load_capacity is not None:
        loads = np.asarray(loads, dtype=np.float64).reshape(len(costs), -1)
        for k, cap_k in enumerate(np.atleast_1d(load_capacity)):
            floors.append((np.ascontiguousarray(loads[:, k]), float(microbatches) * float(cap_k)))
    totals = [float(a.sum()) for a, _ in floors]
    classes = []
    for a, T in floors:
        for j in (1, 2, 3):
            cls = (j + 1) * a > T / microbatches
            k = int(cls.sum())
            if k > 0 and not any(k == kk and np.array_equal(cls, cc) for cc, kk in classes):
                classes.append((cls, k))
    for cls, k in classes + [(None, 0)]:
        q, s = divmod(k, R)
        for h in sorted({1, s, R // 4, R // 2, 3 * R // 4} - {0}):
            cols, rhs = [], []
            for (a, T), N in zip(floors, totals):
                if N - (R - h) * T > 0:
                    cols.append(a)
                    rhs.append(N - (R - h) * T)
            if cls is not None:
                cols.append(cls.astype(np.float64))
                rhs.append(float(h * q + min(h, s)))
            if cols:
                best = max(best, _dual_bound(costs, np.stack(cols), np.asarray(rhs)) / h * (1.0 - 1e-12))
    return best


def _dual_bound(c, A, rhs, rounds: int = 3) -> float:
    """max over theta >= 0 (coordinate ascent) of theta . rhs - sum_i max(0, theta . A[:, i] - c_i)."""
    K = len(rhs)
    theta = np.zeros(K)
    for _ in range(rounds if K > 1 else 1):
        for q in range(K):
            rest = c - (theta @ A - theta[q] * A[q])
            theta[q] = _best_multiplier(A[q], rest, rhs[q])
    return float(theta @ rhs - np.maximum(0.0, theta @ A - c).sum())


def _best_multiplier(a, b, rhs) -> float:
    """argmax over x >= 0 of x * rhs - sum_i max(0, x * a_i - b_i) (a_i >= 0): the smallest breakpoint
    b_i / a_i where the covered a reaches rhs (0.0 if none: then the term cannot help)."""
    on = a > 0
    if not on.any() or float(a[on].sum()) < rhs:
        return 0.0
    brk = b[on] / a[on]
    order = np.argsort(brk, kind="stable")
    k = int(np.searchsorted(np.cumsum(a[on][order]), rhs, side="left"))
    return max(0.0, float(brk[order[min(k, len(order) - 1)]]))


def max_over_capacity_lb(assignment, lengths, costs, loads=None, *, microbatches: int, capacity: int,
                         load_capacity=None) -> float:
    """max(rank cost) / capacity_lower_bound of the items the assignment placed (1.0 when it is 0)."""
    ok = assignment.rank >= 0
    lb = capacity_lower_bound(np.asarray(lengths)[ok], np.asarray(costs)[ok],
                              None if loads is None else np.asarray(loads)[ok], ranks=len(assignment.rank_cost),
                              microbatches=microbatches, capacity=capacity, load_capacity=load_capacity)
    return float(assignment.rank_cost.max()) / lb if lb > 0 else 1.0
