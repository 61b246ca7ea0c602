"""The certificate reported with every step, and the measures passes are compared by.

No assignment of a step's items to `ranks` ranks can have a largest rank cost below
    LB = max(sum(cost) / ranks, max(cost)),
so max(rank cost) / LB >= 1 certifies how far from optimal an assignment is at most. Passes that hold
items back (the cost cap, stage 3) are compared by this ratio over the items they placed, and by the
tokens they placed.
"""

from __future__ import annotations

import numpy as np

from ._jit import jit


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
