"""The driver: `assign()` runs the stages over one global step and returns an `Assignment`.

The objective is the step time: the largest total cost over DP ranks, subject to every micro-batch
holding at most `capacity` tokens. Pure: arrays in, arrays out, deterministic. The stages (see the
package docstring) run in placement order on contiguous arrays; the result is mapped back to the
caller's order at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plait import jit

from . import tuning
from .certificate import lower_bound, pass_ratio, placed_tokens
from .exchange import rebalance
from .capacities import capacities, no_loads
from .lpt import LptRun, PlacementItems
from .microbatches import middle_heavy, pack_micro
from .ordering import scatter_back, sorted_items


@dataclass
class Assignment:
    rank: np.ndarray  # int32 [n]; -1: not placed this step (carried to the next)
    micro: np.ndarray  # int32 [n]; position of the micro-batch in the rank's order
    rank_cost: np.ndarray  # float64 [R]
    micro_cost: np.ndarray  # float64 [R, W]
    micro_tokens: np.ndarray  # int64 [R, W]
    microbatches: np.ndarray | None = None  # int64 [R]: micro-batches of each rank (W for all in equal mode)
    micro_loads: np.ndarray | None = None  # int64 [R, W, K]: each encoder load per micro-batch (None: no loads)

    def __post_init__(self):
        if self.microbatches is None:
            self.microbatches = np.full(len(self.rank_cost), self.micro_cost.shape[1], dtype=np.int64)

    @property
    def placed(self) -> np.ndarray:
        return self.rank >= 0


def assign(
    lengths: np.ndarray,
    costs: np.ndarray,
    *,
    ranks: int,
    microbatches: int,
    capacity: int,
    priority: np.ndarray | None = None,
    mode: str = "equal",
    max_microbatches: int | None = None,
    loads: np.ndarray | None = None,
    load_capacity=None,
) -> Assignment:
    """Place items on (rank, micro-batch) minimising the largest rank cost; see the package docstring.

    Items with `priority` >= 2 (the Planner gives every carried item that: steps waited + 1) are placed
    before all others and are never held back by the cost cap, so nothing is carried twice for balance.

    Multimodal steps: `loads` (int [n, K], or [n] for K = 1: each item's load in each encoder
    capacity, e.g. image patches, video patches, audio frames) and `load_capacity` (int [K]: what one
    micro-batch may hold of each, the encoders' memory) add K capacities; an item fits a micro-batch only
    where its tokens and every load do. A capacity no item of the step uses is left out (it cannot bind);
    with none left (or without both arguments) every stage runs its text-only path. With `loads` alone,
    micro_loads is reported but not limited.
    """
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    costs = np.ascontiguousarray(costs, dtype=np.float64)
    n = len(lengths)
    jit.hint(n)  # a step this large runs compiled from its first call (plait.jit)
    R = int(ranks)
    C = int(capacity)
    loads, used, load_capacity = _encoder_loads(loads, load_capacity, n)
    limited = len(used) > 0
    if mode == "equal":
        W = int(microbatches)
    elif mode == "variable":
        W = int(max_microbatches or 2 * microbatches)
    else:
        raise ValueError(f"unknown balance mode {mode!r} (equal or variable)")
    # Stage 1: work in placement order, so the passes below stream through contiguous arrays.
    order, Ls, Cs = sorted_items(costs, priority, lengths)
    Us = np.zeros(n, dtype=np.bool_) if priority is None else (np.asarray(priority) >= 2)[order]
    items = PlacementItems(Us, Ls, Cs, np.ascontiguousarray(loads[order][:, used]) if limited else no_loads(n))
    caps = capacities(C, load_capacity[used] if limited else None)
    # Stages 2 and 3: LPT passes at cost caps, the best certificate kept.
    first, best, ratio = _lpt_passes(items, costs, R, W, caps)
    if limited and mode == "equal":  # stages 4 and 5 write into the pass; a later rerun resumes from the first's
        best = best._replace(rank=best.rank.copy(), micro=best.micro.copy())
    # Stages 4 and 5: micro-batches re-packed inside each rank, then (equal mode) rebalanced.
    placed = _pack_and_rebalance(items, best, ratio, (R, W, caps), mode)
    if limited and mode == "equal":
        placed = _recap_encoder_bound(items, first, best, placed, (R, W, caps))
    rank_s, micro_s, rank_cost, micro_cost, room, counts = placed
    micro_tokens = C - room
    # Stage 6: the heaviest micro-batches to the middle of each rank's order; back to the caller's order.
    new_pos = np.empty((R, W), dtype=np.int64)
    middle_heavy(micro_cost, counts, new_pos)
    rank = np.empty(n, dtype=np.int32)
    micro = np.empty(n, dtype=np.int32)
    scatter_back(order, rank_s, micro_s, new_pos, rank, micro)
    inv = np.argsort(new_pos, axis=1, kind="stable")
    micro_cost = np.take_along_axis(micro_cost, inv, axis=1)
    micro_tokens = np.take_along_axis(micro_tokens, inv, axis=1)
    if mode == "variable":
        width = max(1, int(counts.max()))
        micro_cost, micro_tokens = micro_cost[:, :width].copy(), micro_tokens[:, :width].copy()
    micro_loads = None
    if loads is not None:
        ok = np.flatnonzero(rank >= 0)
        micro_loads = np.zeros((micro_cost.size, loads.shape[1]), dtype=np.int64)
        np.add.at(micro_loads, rank[ok].astype(np.int64) * micro_cost.shape[1] + micro[ok], loads[ok])
        micro_loads = micro_loads.reshape(micro_cost.shape + (loads.shape[1],))
    return Assignment(rank, micro, rank_cost, micro_cost, micro_tokens, counts, micro_loads)


def _encoder_loads(loads, load_capacity, n):
    """The loads as int64 [n, K] (None: none given), the capacities that limit this step (given, and used
    by some item) and the capacities as int64 [K]."""
    if loads is None:
        return None, np.zeros(0, dtype=np.int64), None
    loads = np.asarray(loads, dtype=np.int64)
    loads = loads.reshape(n, 1) if loads.ndim == 1 else loads
    if loads.ndim != 2 or loads.shape[0] != n:
        raise ValueError(f"loads has shape {loads.shape}, expected ({n}, K) for {n} items")
    if load_capacity is None:
        return loads, np.zeros(0, dtype=np.int64), None
    load_capacity = np.atleast_1d(np.asarray(load_capacity, dtype=np.int64))
    if load_capacity.shape != (loads.shape[1],) or (load_capacity < 1).any():
        raise ValueError(f"load_capacity {load_capacity.tolist()}: expected {loads.shape[1]} capacities >= 1")
    return loads, np.flatnonzero(loads.any(axis=0)), load_capacity


def _lpt_passes(items, costs, R, W, caps):
    """Stages 2 and 3: the LPT pass at a cost cap just above the lower bound, and the passes at other
    caps that may certify better. Returns the first pass (an lpt.LptRun, from which later passes
    resume), the pass kept (an lpt.LptResult) and its certificate (max/LB of the items it placed).

    Tokens may bind before cost: some ranks full of cheap short documents while others hold the
    expensive long ones. The capped pass carries the cheapest leftovers instead of piling them onto the
    expensive ranks. Where it holds nothing back it *is* the plain (uncapped) pass. Where it does, the
    plain pass would have put the first held-back item on top, reaching first_over, and its bound is at
    most the bound of all items: if the capped pass certifies below first_over / LB(all) it wins
    without running the plain one; otherwise both are compared. When carrying lowered the bound itself,
    a pass capped at the new bound follows, kept if it carries at most RECAP_TOKENS more of the step's
    tokens. All passes share their decisions up to the first item where their caps disagree: LptRun
    resumes each later pass from a snapshot of the first.

    Carrying is only worth its delay when it holds the cap. A pass can end above it all the same: an
    item is placed past the cap when it is urgent or when no less loaded rank is too full for it (tokens
    do not bind for it), and the items held back afterwards only keep the other ranks under a cap the
    step already exceeds. Such a pass certifies a little better than the plain one over
    the items it placed, but makes a step no faster than the cap allows while leaving tokens behind: the
    plain pass is kept instead when it places more tokens.
    """
    Us, Ls, Cs, loads = items
    capacity, load_capacity = caps[0], caps[1]
    lb_all = lower_bound(Cs, R)
    total_tokens = int(Ls.sum())
    cap = lower_bound(costs, R) * (1.0 + tuning.CAP_SLACK)  # (summed in the caller's order: same float as always)
    first = LptRun(Us, Ls, Cs, R, W, capacity, cap, loads, load_capacity)
    best = first.result
    ratio = pass_ratio(best.rank, best.rank_cost, Cs, R)
    plain = None  # the uncapped pass, run only when a comparison needs it
    if best.skipped and ratio > best.first_over / lb_all:
        plain = first.rerun(np.inf)
        ratio_plain = pass_ratio(plain.rank, plain.rank_cost, Cs, R)
        if ratio_plain <= ratio:
            best, ratio = plain, ratio_plain
    if best.skipped and ratio > 1.0 + tuning.RECAP_ABOVE:
        recap = lower_bound(Cs[best.rank >= 0], R) * (1.0 + tuning.CAP_SLACK)
        again = first.rerun(recap)
        lost = placed_tokens(best.rank, Ls) - placed_tokens(again.rank, Ls)
        ratio_again = pass_ratio(again.rank, again.rank_cost, Cs, R)
        if ratio_again < ratio and lost <= tuning.RECAP_TOKENS * total_tokens:
            best, ratio = again, ratio_again
    if best.skipped and float(best.rank_cost.max()) > cap:  # held items back in vain (see above)
        plain = plain if plain is not None else first.rerun(np.inf)
        if placed_tokens(plain.rank, Ls) > placed_tokens(best.rank, Ls):
            best, ratio = plain, pass_ratio(plain.rank, plain.rank_cost, Cs, R)
    return first, best, ratio


def _pack_and_rebalance(items, best, ratio, shape, mode):
    """Stages 4 and 5 on the pass kept: rank, micro, rank_cost, micro_cost, room (tokens) and counts
    (micro-batches per rank). The pass's arrays are modified in place."""
    R, W, caps = shape
    rank_s, micro_s, rank_cost, micro_cost, room, proom = (best.rank, best.micro, best.rank_cost,
                                                          best.micro_cost, best.room, best.proom)
    counts = np.full(R, W, dtype=np.int64)
    pack_micro(items, rank_s, micro_s, micro_cost, (room, proom), caps, mode == "variable", counts)
    if mode == "equal" and R > 1 and len(rank_s) and ratio > 1.0 + tuning.RECAP_ABOVE:
        rank_cost = rebalance(items, rank_s, micro_s, micro_cost, (room, proom), caps,
                              int(tuning.REBALANCE_TOKENS * int(items.lengths.sum())))
    return rank_s, micro_s, rank_cost, micro_cost, room, counts


def _recap_encoder_bound(items, first, best, placed, shape):
    """When an encoder capacity, not the cost cap, left items out: a pass capped at the placed ones' bound.

    The first pass's cap is the bound of *all* the step's items. When the encoder's capacity binds (the
    micro-batches full of patches while the step still has items), a large part of the step fits nowhere
    and the bound of what did fit is lower: the cap is too loose to even the ranks out, the expensive
    items fill some ranks' patch room early and the cheap ones cannot make up for it (video: max/LB 1.07
    after stage 5). Only then - items left out beyond those the cap held back, and the step still above
    1 + ENCODER_RECAP_ABOVE after stages 4 and 5 - the pass capped just above the bound of the placed
    items runs through stages 4 and 5 too, and is kept if it certifies better while carrying at most
    ENCODER_RECAP_TOKENS more of the step's tokens (more than RECAP_TOKENS: a step whose encoder binds
    leaves a large part of itself for the next one anyway; so the step must be clearly off balance,
    above RECAP_ABOVE, for the delay to pay). Steps that certify well are never touched."""
    R = shape[0]
    rank_s, rank_cost = placed[0], placed[2]
    if int((best.rank < 0).sum()) <= best.skipped:
        return placed
    ratio = pass_ratio(rank_s, rank_cost, items.costs, R)
    if ratio <= 1.0 + tuning.ENCODER_RECAP_ABOVE:
        return placed
    recap = lower_bound(items.costs[rank_s >= 0], R) * (1.0 + tuning.CAP_SLACK)
    again = first.rerun(recap)
    if not again.skipped:
        return placed
    ratio_again = pass_ratio(again.rank, again.rank_cost, items.costs, R)
    other = _pack_and_rebalance(items, again, ratio_again, shape, "equal")
    lost = placed_tokens(rank_s, items.lengths) - placed_tokens(other[0], items.lengths)
    if lost > tuning.ENCODER_RECAP_TOKENS * int(items.lengths.sum()):
        return placed
    if pass_ratio(other[0], other[2], items.costs, R) < ratio:
        return other
    return placed
