"""Dynamic CP, stage 3: the splitting lower bound and the certificate (docs/long-context.md).

With documents shared over groups of up to `cap` ranks, no plan of a step over `pool` ranks has a slowest
rank below
    LB = max(sum(cost) / pool, max over documents of min over k <= cap of (cost / k + traffic(k))):
the work is conserved (traffic only adds), and a document runs on some group of k <= cap ranks, each of
which carries its share and its traffic (inside a node where k allows: the cheapest). Without traffic the
second term is max(cost) / cap. max(rank cost) / LB >= 1 certifies how far from optimal a plan is at most.
"""

from __future__ import annotations

import numpy as np

from .cp_degrees import CommTable, member_cost, vocabulary

CHUNK = 256  # documents per vectorised look (the walk stops early)


def splitting_lower_bound(lengths: np.ndarray, costs: np.ndarray, *, pool: int, cap: int, pow2: bool,
                          comm: CommTable | None = None) -> float:
    """LB above (0.0: no documents). Documents are visited costliest first and the walk stops at the first
    whose cost is below the best term so far (its term, at most its cost, cannot win)."""
    costs = np.asarray(costs, dtype=np.float64)
    if not len(costs):
        return 0.0
    comm = comm or CommTable.free(cap)
    sizes = np.unique(vocabulary(cap, pow2))
    best = float(costs.sum()) / pool
    order = np.argsort(-costs, kind="stable")
    for start in range(0, len(order), CHUNK):
        part = order[start:start + CHUNK]
        part = part[costs[part] > best]
        if not len(part):
            break
        terms = member_cost(np.asarray(lengths)[part][:, None], costs[part][:, None], sizes[None, :], comm).min(axis=1)
        best = max(best, float(terms.max()))
    return best


def max_over_lb(rank_cost: np.ndarray, lower_bound: float) -> float:
    """The certificate: the slowest rank over LB (1.0 when LB is 0)."""
    return float(np.max(rank_cost, initial=0.0)) / lower_bound if lower_bound > 0 else 1.0
