"""Dynamic CP: one step's plan from its documents -- degrees (cp_degrees.py), waves (cp_waves.py), the
splitting bound (cp_bound.py). Pure: arrays in, arrays out, deterministic.

How many waves. A step draws as many tokens as `waves` x pool slots hold, but documents differ in cost
per token (attention is quadratic): the ranks of a long document's group reach the mean rank cost with
few tokens, so the others would need more tokens than their slots hold. The plan therefore tries the asked
number of waves and then more (up to 2 x waves + 1: each rank runs more, smaller micro-batches, never more
than its slot), keeping the first within WAVE_TARGET of the bound, else the best; only then, if still
above, does it carry cheap documents to the next step (cp_waves.py's capped fill).

Promotion. Degrees by cost leave a group's members up to a mean rank's cost, and a rank may run two such
groups in two waves. When the best plan is still above WAVE_TARGET, the costliest document on the
slowest rank whose next larger degree lowers what its members carry gets that degree, and the step is
planned again at the best plan's waves (at most PROMOTIONS times, and only while each round helps)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .cp_bound import max_over_lb, splitting_lower_bound
from .cp_degrees import CommTable, CPLayout, cp_degrees, member_cost, vocabulary
from .cp_waves import CAP_SLACKS, WaveAssignment, place_waves

WAVE_TARGET = 1.03  # max rank / bound at which more waves (and promotions) are not tried
PROMOTIONS = 6


@dataclass
class DynamicCPPlan:
    assignment: WaveAssignment
    lower_bound: float  # over the placed documents

    @property
    def max_over_lb(self) -> float:
        return max_over_lb(self.assignment.rank_cost, self.lower_bound)


def plan_dynamic_cp(lengths: np.ndarray, costs: np.ndarray, layout: CPLayout, comm: CommTable, *,
                    priority: np.ndarray | None = None, minimal: np.ndarray | None = None) -> DynamicCPPlan:
    """Degrees by cost, group micro-batches in waves, and the bound over what was placed. `minimal` marks
    documents that keep the least degree their tokens allow (media)."""
    degrees = cp_degrees(lengths, costs, layout, comm, minimal)
    lengths, costs = np.asarray(lengths, dtype=np.int64), np.asarray(costs, dtype=np.float64)
    every = splitting_lower_bound(lengths, costs, pool=layout.pool, cap=layout.cap, pow2=layout.pow2, comm=comm)
    place = dict(bound=every, priority=priority, asked=layout.waves, score=lambda a: _score(a, costs, every),
                 whole=minimal)
    best, best_ratio = _fewest_waves(lengths, costs, degrees, layout, comm, place)
    best_degrees, tried = degrees.copy(), best
    for _ in range(PROMOTIONS):  # each round at the best plan's waves; stops at the first that does not help
        if best_ratio <= WAVE_TARGET or not _promote(tried, (lengths, costs, minimal), degrees, layout, comm):
            break
        tried = place_waves(lengths, costs, degrees, replace(layout, waves=best.waves), comm, bound=every,
                            priority=priority, slacks=(np.inf,), whole=minimal)
        ratio = place["score"](tried)
        if ratio >= best_ratio - 1e-12:
            break
        best, best_ratio, best_degrees = tried, ratio, degrees.copy()
    assignment = best
    if best_ratio > 1 + CAP_SLACKS[0]:
        assignment = place_waves(lengths, costs, best_degrees, replace(layout, waves=best.waves), comm, bound=every,
                                 priority=priority, whole=minimal)
    placed = assignment.item_group >= 0
    bound = splitting_lower_bound(lengths[placed], costs[placed], pool=layout.pool, cap=layout.cap,
                                  pow2=layout.pow2, comm=comm)
    return DynamicCPPlan(assignment, bound)


def _fewest_waves(lengths, costs, degrees, layout: CPLayout, comm: CommTable, place: dict):
    """The plan with the fewest waves from layout.waves on (at most 2 x asked + 1) within WAVE_TARGET of
    the bound, else the best one; and its ratio."""
    best, best_ratio = None, np.inf
    start = layout.waves
    for waves in range(start, max(start, 2 * place["asked"] + 1) + 1):
        tried = place_waves(lengths, costs, degrees, replace(layout, waves=waves), comm, bound=place["bound"],
                            priority=place["priority"], slacks=(np.inf,), whole=place["whole"])
        ratio = place["score"](tried)
        if best is None or ratio < best_ratio - 1e-12:
            best, best_ratio = tried, ratio
        if ratio <= WAVE_TARGET:
            break
    return best, best_ratio


def _score(plan: WaveAssignment, costs: np.ndarray, bound: float) -> float:
    """A plan's slowest rank over the step's bound, per unit of the step's work it places: a plan that
    carries work to the next step scores that much worse (it delivers less for its time)."""
    placed, total = float(costs[plan.item_group >= 0].sum()), float(costs.sum())
    return max_over_lb(plan.rank_cost, bound) * (total / placed if placed > 0 else (1.0 if total <= 0 else np.inf))


def _promote(plan: WaveAssignment, docs_of_step, degrees, layout: CPLayout, comm: CommTable) -> bool:
    """Give the costliest document on the slowest rank the next degree of the vocabulary, when that lowers
    what its members carry (module docstring); False when no document qualifies. Changes `degrees`.
    `docs_of_step`: (lengths, costs, whole); a `whole` document (media) is never promoted."""
    lengths, costs, whole = docs_of_step
    slowest = int(np.argmax(plan.rank_cost))
    groups = np.flatnonzero((plan.first <= slowest) & (slowest < plan.first + plan.size))
    in_groups = np.isin(plan.item_group, groups)
    if whole is not None:
        in_groups &= ~np.asarray(whole, dtype=bool)
    docs = np.flatnonzero(in_groups)
    if not len(docs):
        return False
    sizes = np.unique(vocabulary(layout.cap, layout.pow2))
    now = degrees[docs]
    carried = member_cost(lengths[docs], costs[docs], now, comm)
    larger = member_cost(lengths[docs][:, None], costs[docs][:, None], sizes[None, :], comm)
    better = (sizes[None, :] > now[:, None]) & (larger < carried[:, None])
    ok = better.any(axis=1)
    if not ok.any():
        return False
    idx = np.flatnonzero(ok)
    j = idx[np.argmax(costs[docs[idx]])]
    degrees[docs[j]] = sizes[np.argmax(better[j])]  # the smallest larger size that lowers it
    return True
