"""Balancing: assign each document (chunk) of a global step to a (DP rank, micro-batch).

The objective is the step time: the largest total cost over DP ranks, subject to every micro-batch
holding at most `capacity` tokens. This module is pure: arrays in, arrays out, deterministic.

Lower bound (the certificate reported with every step): no assignment can beat
    LB = max(sum(cost) / ranks, max(cost)).

The algorithm, in passes over arrays (compiled with numba when it is installed; the very same
Python functions run uncompiled otherwise, so results never depend on it):

1. **LPT with capacity.** Items in order of decreasing cost (items carried before go first, so nothing
   starves) each go to the least-loaded rank that still has a micro-batch with room for them, into the
   fullest micro-batch they fit (best fit keeps big holes for big items). Two heaps make this
   O(n log R): ranks by cost, and ranks that are currently too full by their largest hole, so a rank
   returns as soon as items become small enough for it. Items that fit nowhere stay unplaced (rank -1).
   Speed (a step of 2.6M documents over 4096 ranks plans in about 0.2 s on one core): the order is a
   radix sort (of the lengths when cost is an increasing function of length, as for text); the many
   small items at the end (each at most LB / ROUND_ITEM) go in rounds while every rank still has room
   for them - ranks sorted by cost once a round, each taking the next item, the least loaded the
   largest, a round ending where LPT would serve a rank twice: exactly LPT's choices without a heap
   operation per item - and back to the heaps as soon as some rank is too full.
2. **Cost cap.** When tokens bind before cost (a rank holding a 128k-token chunk is "full" at far more
   than the mean cost, while ranks of short documents are full at less), the pass is repeated with
   every rank's cost capped just above the lower bound: while some ranks are too full for an item, the
   cheap leftovers that would push a rank past the cap are carried to the next step instead of piling
   onto the expensive ranks. The capped result is kept when it certifies better; a second capped pass
   at the new (lower) bound may follow if it carries at most 2% more of the step's tokens. Carried
   items go first in the next step, uncapped, so nothing waits more than a step for this. Passes at
   different caps make the same decisions up to the first item one of them holds back: the first pass
   keeps snapshots of its state and the others resume from the last one before that item (exactly the
   result of a full pass, tested).
3. **Micro-batches.** Inside each rank the items are re-packed cost-first onto the least costly
   micro-batch with room (balanced micro-batch costs shorten pipeline bubbles), keeping the best-fit
   packing if that does not fit or is not more even.
4. **Whole micro-batches** (equal mode, when the step still certifies worse than 1 + RECAP_ABOVE). Any
   two micro-batches fit anywhere, so swapping them between ranks keeps capacity: the costliest rank
   repeatedly swaps one with one of the lightest ranks while that lowers the pair's maximum. Then items
   move between a micro-batch of the costliest rank and one of the lightest (long documents cost more
   per token: the light side takes long ones and gives back as many tokens of short ones), and the
   swaps run again. When tokens
   bind (128k micro-batches full of tokens, a long chunk costing several micro-batches of short
   documents) ranks differ by how many long chunks they hold; then the costliest long item of the
   costliest rank is carried, one at a time with swaps after each, up to REBALANCE_TOKENS of the step's
   tokens, keeping the best state seen (never an urgent item: nothing waits more than a step for this).
   Finally the heaviest micro-batches go to the middle of each rank's order.

Modes: `equal` gives every rank exactly `microbatches` micro-batches (some may be empty when a step
holds too few items). `variable` lets a rank use up to `max_microbatches` (default 2x) micro-batches:
ranks of short documents take more tokens, ranks of long ones fewer, so costs can balance even when
tokens cannot. Per-rank token counts then differ: a trainer must normalise its loss by the step's
global label tokens (StepPlan.stats()["global_label_tokens"]), not per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

try:  # numba compiles the hot loops; without it the same functions run as plain Python (slow).
    from numba import njit as _numba_njit

    def _jit(fn):
        return _numba_njit(cache=True, nogil=True)(fn)
except ImportError:  # pragma: no cover - numba is a core dependency

    def _jit(fn):
        return fn


@dataclass
class Assignment:
    rank: np.ndarray  # int32 [n]; -1: not placed this step (carried to the next)
    micro: np.ndarray  # int32 [n]; position of the micro-batch in the rank's order
    rank_cost: np.ndarray  # float64 [R]
    micro_cost: np.ndarray  # float64 [R, W]
    micro_tokens: np.ndarray  # int64 [R, W]
    microbatches: np.ndarray | None = None  # int64 [R]: micro-batches of each rank (W for all in equal mode)

    def __post_init__(self):
        if self.microbatches is None:
            self.microbatches = np.full(len(self.rank_cost), self.micro_cost.shape[1], dtype=np.int64)

    @property
    def placed(self) -> np.ndarray:
        return self.rank >= 0


def lower_bound(costs: np.ndarray, ranks: int) -> float:
    if len(costs) == 0:
        return 0.0
    return max(float(costs.sum()) / ranks, float(costs.max()))


def middle_heavy_order(micro_cost: np.ndarray, counts: np.ndarray | None = None) -> np.ndarray:
    """For each rank, a permutation of its micro-batches placing the heaviest in the middle.

    Pipeline parallelism's warm-up and cool-down phases then run the light ones. Returns new_pos[r, m].
    With `counts`, only the first counts[r] micro-batches of rank r take part (the rest keep their slot).
    """
    micro_cost = np.asarray(micro_cost, dtype=np.float64)
    R, M = micro_cost.shape
    if counts is None:
        counts = np.full(R, M, dtype=np.int64)
    new_pos = np.empty((R, M), dtype=np.int64)
    _middle_heavy(micro_cost, np.asarray(counts, dtype=np.int64), new_pos)
    return new_pos


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
) -> Assignment:
    """Place items on (rank, micro-batch) minimising the largest rank cost; see the module docstring.

    Items with `priority` >= 2 (the Planner gives every carried item that: steps waited + 1) are placed
    before all others and are never held back by the cost cap, so nothing is carried twice for balance.
    """
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    costs = np.ascontiguousarray(costs, dtype=np.float64)
    n = len(lengths)
    R = int(ranks)
    if mode == "equal":
        W = int(microbatches)
    elif mode == "variable":
        W = int(max_microbatches or 2 * microbatches)
    else:
        raise ValueError(f"unknown balance mode {mode!r} (equal or variable)")
    # Work in placement order: the passes below then stream through contiguous arrays.
    order, Ls, Cs = _sorted_items(costs, priority, lengths)
    Us = np.zeros(n, dtype=np.bool_) if priority is None else (np.asarray(priority) >= 2)[order]
    lb_all = lower_bound(Cs, R)
    total_tokens = int(Ls.sum())
    cap = lower_bound(costs, R) * (1.0 + CAP_SLACK)  # (summed in the caller's order: same float as always)
    # Tokens may bind before cost: some ranks full of cheap short documents while others hold the
    # expensive long ones. The capped pass carries the cheapest leftovers instead of piling them onto
    # the expensive ranks. Where it holds nothing back it *is* the plain pass. Where it does, the plain
    # pass would have put the first held-back item on top, reaching first_over, and its bound is at
    # most the bound of all items: if the capped pass certifies below first_over / LB(all) it wins
    # without running the plain one; otherwise both are compared.
    # All passes share their decisions up to the first item where their caps disagree: the first pass
    # keeps snapshots of its state, and every later pass resumes from the last one before that item.
    first = _LptRun(Us, Ls, Cs, R, W, int(capacity), cap)
    state = first.result
    ratio = _ratio(state, Cs, R)
    if state[5] and ratio > state[6] / lb_all:
        plain = first.rerun(np.inf)
        ratio_plain = _ratio(plain, Cs, R)
        if ratio_plain <= ratio:
            state, ratio = plain, ratio_plain
    if state[5] and ratio > 1.0 + RECAP_ABOVE:
        # Carrying lowered the bound itself: cap again at the new bound, if that carries at most
        # RECAP_TOKENS more of the step's tokens.
        recap = lower_bound(Cs[state[0] >= 0], R) * (1.0 + CAP_SLACK)
        again = first.rerun(recap)
        lost = _placed_tokens(state[0], Ls) - _placed_tokens(again[0], Ls)
        ratio_again = _ratio(again, Cs, R)
        if ratio_again < ratio and lost <= RECAP_TOKENS * total_tokens:
            state, ratio = again, ratio_again
    rank_s, micro_s, rank_cost, micro_cost, room = state[:5]
    counts = np.full(R, W, dtype=np.int64)
    _pack_micro(Ls, Cs, rank_s, micro_s, micro_cost, room, int(capacity), mode == "variable", counts)
    if mode == "equal" and R > 1 and n and ratio > 1.0 + RECAP_ABOVE:
        rank_cost, _ = _rebalance(Ls, Cs, Us, rank_s, micro_s, micro_cost, room, R, W, int(capacity),
                                  int(REBALANCE_TOKENS * total_tokens))
    micro_tokens = int(capacity) - room
    new_pos = np.empty((R, W), dtype=np.int64)
    _middle_heavy(micro_cost, counts, new_pos)
    rank = np.empty(n, dtype=np.int32)
    micro = np.empty(n, dtype=np.int32)
    _scatter_back(order, rank_s, micro_s, new_pos, rank, micro)
    inv = np.argsort(new_pos, axis=1, kind="stable")
    micro_cost = np.take_along_axis(micro_cost, inv, axis=1)
    micro_tokens = np.take_along_axis(micro_tokens, inv, axis=1)
    if mode == "variable":
        width = max(1, int(counts.max()))
        micro_cost, micro_tokens = micro_cost[:, :width].copy(), micro_tokens[:, :width].copy()
    return Assignment(rank, micro, rank_cost, micro_cost, micro_tokens, counts)


CAP_SLACK = 0.002  # the capped pass allows rank costs this far above the lower bound
RECAP_ABOVE = 0.005  # a second capped pass runs when the first certifies worse than 1 + this
EXCHANGE = True  # stage 2 exchanges items between micro-batches of the costliest and lightest ranks
SWAP_SCAN = 256  # stage 2 swaps: the costliest rank tries this many of the lightest ranks
CARRY_PATIENCE = 32  # stage 2 stops after this many carried items (beyond the top ranks) without progress
REBALANCE_TOKENS = 0.01  # stage 2 carries at most this fraction of the step's tokens
RECAP_TOKENS = 0.02  # ... and is kept if it carries at most this fraction of the step's tokens more


SNAPSHOTS = 16  # the first LPT pass keeps this many snapshots of its state for later passes to resume


class _LptRun:
    """The first LPT pass, with snapshots of its state, and later passes at other caps resumed from them.

    Two passes make the same decisions until the first item that one cap holds back and the other does
    not: for a larger cap that is the first pass's first held-back item (a snapshot is taken right
    there); for a smaller cap it is the first item whose "rank cost + item cost" (recorded by the first
    pass while the slower heap had ranks) exceeds that cap. Resuming from the last snapshot before it
    gives exactly the result of a full pass, without redoing the shared prefix.
    """

    def __init__(self, urgent, lengths, costs, R, W, capacity, cap):
        n = len(lengths)
        self.args = (urgent, lengths, costs, R, W, capacity)
        self.cap = float(cap)
        self.switch = _round_start(urgent, costs, R)
        if n < SNAPSHOT_MIN:  # small steps: passes are cheap, snapshots and their bookkeeping are not
            self.snap_at = None
            self.result = self._plain(self.cap)
            return
        every = max(1024, -(-n // SNAPSHOTS))
        K = n // every + 2  # periodic snapshots, then the one at the first held-back item
        self.snap_at = np.full(K, -1, dtype=np.int64)
        self.snaps = (np.empty((K, R)), np.empty((K, R, W)), np.empty((K, R, W), dtype=np.int64),
                      np.empty((K, R), dtype=np.int64), np.empty((K, R)), np.empty((K, R), dtype=np.int64),
                      np.empty((K, R), dtype=np.int64), np.empty((K, 5), dtype=np.int64), np.empty((K, 1)))
        self.trig = np.full(n, -np.inf)
        st = _fresh_state(n, R, W, capacity)
        _lpt(urgent, lengths, costs, R, W, capacity, self.cap, 0, self.switch, *st, every, self.snap_at, *self.snaps,
             self.trig)
        self.result = _result(st)

    def rerun(self, cap: float):
        """The result of a full pass at `cap`, resumed from the latest snapshot that all passes share."""
        urgent, lengths, costs, R, W, capacity = self.args
        cap = float(cap)
        n = len(lengths)
        if self.snap_at is None:
            return self._plain(cap)
        first_skip = int(self.snap_at[-1])
        if n == 0:
            return tuple(x.copy() if isinstance(x, np.ndarray) else x for x in self.result)
        if first_skip < 0 and cap >= self.cap:
            return tuple(x.copy() if isinstance(x, np.ndarray) else x for x in self.result)
        limit = first_skip if first_skip >= 0 else n
        diverge = limit
        if cap < self.cap:
            over = np.flatnonzero(self.trig[:limit] > cap)
            if len(over):
                diverge = int(over[0])
        taken = self.snap_at[:-1]
        if first_skip >= 0 and diverge == first_skip:
            k = len(self.snap_at) - 1
        else:
            k = int(np.flatnonzero((taken >= 0) & (taken <= diverge))[-1])
        start = int(self.snap_at[k])
        st = _fresh_state(n, R, W, capacity)
        rank, micro = st[0], st[1]
        rank[:start] = self.result[0][:start]
        micro[:start] = self.result[1][:start]
        for dst, snap in zip(st[2:], self.snaps):
            dst[...] = snap[k]
        _lpt(urgent, lengths, costs, R, W, capacity, cap, start, self.switch, *st, 0, self.snap_at[:0], *self.snaps,
             self.trig[:0])
        return _result(st)

    def _plain(self, cap: float):
        """A whole pass from the first item, without snapshots (one compiled call)."""
        urgent, lengths, costs, R, W, capacity = self.args
        n = len(lengths)
        rank = np.full(n, -1, dtype=np.int32)
        micro = np.full(n, -1, dtype=np.int32)
        rank_cost = np.zeros(R)
        micro_cost = np.zeros((R, W))
        room = np.full((R, W), capacity, dtype=np.int64)
        skipped, first_over = _lpt_plain(urgent, lengths, costs, R, W, capacity, float(cap), self.switch, rank, micro,
                                         rank_cost, micro_cost, room)
        return rank, micro, rank_cost, micro_cost, room, int(skipped), float(first_over)


SNAPSHOT_MIN = 8192  # steps with fewer items run every LPT pass from the start


@_jit
def _lpt_plain(urgent, lengths, costs, R, W, capacity, cap, switch, rank, micro, rank_cost, micro_cost, room):
    """_lpt over all items from a fresh state, no snapshots; returns (skipped, first_over)."""
    best = np.full(R, capacity, dtype=np.int64)
    neg_best = np.zeros(R)
    heap = np.arange(R, dtype=np.int64)
    full = np.empty(R, dtype=np.int64)
    ints = np.zeros(5, dtype=np.int64)
    ints[0] = R
    flts = np.zeros(1)
    snap_at = np.empty(0, dtype=np.int64)
    s1 = np.empty((0, R))
    s2 = np.empty((0, R, W))
    s3 = np.empty((0, R, W), dtype=np.int64)
    s4 = np.empty((0, R), dtype=np.int64)
    s5 = np.empty((0, 5), dtype=np.int64)
    s6 = np.empty((0, 1))
    trig = np.empty(0)
    _lpt(urgent, lengths, costs, R, W, capacity, cap, 0, switch, rank, micro, rank_cost, micro_cost, room, best,
         neg_best, heap, full, ints, flts, 0, snap_at, s1, s2, s3, s4, s1, s4, s4, s5, s6, trig)
    return ints[2], flts[0]


ROUND_ITEM = 32  # items costing at most LB / ROUND_ITEM are placed in rounds ...
ROUND_MIN = 4  # ... when at least ROUND_MIN x ranks of them remain ...
ROUND_RANKS = 64  # ... and there are at least this many ranks (with few, a heap operation is cheap)
ROUND_SHORT = 8  # a round of fewer ranks hands the rest of the items back to the heaps


def _round_start(urgent, costs, R) -> int:
    """Index from which LPT places items in rounds instead of one heap operation each (see _lpt)."""
    n = len(costs)
    if R < ROUND_RANKS or n < ROUND_MIN * R:
        return n
    return _first_small(urgent, costs, R, ROUND_ITEM, ROUND_MIN * R)


@_jit
def _first_small(urgent, costs, R, item_frac, min_left):
    """The first non-urgent item costing at most LB / item_frac, if at least min_left items remain from
    it; else n. Also n when a cost is negative or NaN (rounds sort non-negative costs). Non-urgent items
    come in decreasing cost, so the small ones are a suffix: found by bisection."""
    n = len(costs)
    total = 0.0
    top = 0.0
    nu = 0
    for i in range(n):
        c = costs[i]
        if not c >= 0.0:
            return n
        total += c
        if c > top:
            top = c
        if urgent[i]:
            nu += 1
    limit = max(total / R, top) / item_frac
    lo = nu
    hi = n
    while lo < hi:  # the first index in [nu, n) with cost <= limit
        mid = (lo + hi) // 2
        if costs[mid] <= limit:
            hi = mid
        else:
            lo = mid + 1
    return lo if n - lo >= min_left else n


def _fresh_state(n, R, W, capacity):
    """rank, micro, rank_cost, micro_cost, room, best (largest hole), neg_best, heap, full, ints (heap size,
    full size, skipped, phase, whether a round ran), flts (first_over): the state of an LPT pass before
    its first item."""
    return (np.full(n, -1, dtype=np.int32), np.full(n, -1, dtype=np.int32), np.zeros(R), np.zeros((R, W)),
            np.full((R, W), capacity, dtype=np.int64), np.full(R, capacity, dtype=np.int64), np.zeros(R),
            np.arange(R, dtype=np.int64), np.empty(R, dtype=np.int64), np.array([R, 0, 0, 0, 0], dtype=np.int64),
            np.zeros(1))


def _result(st):
    rank, micro, rank_cost, micro_cost, room = st[:5]
    ints, flts = st[9], st[10]
    return rank, micro, rank_cost, micro_cost, room, int(ints[2]), float(flts[0])


def _ratio(state, costs, R) -> float:
    lb = lower_bound(costs[state[0] >= 0], R)  # numpy's pairwise sum: more exact than a running one
    return float(state[2].max()) / lb if lb > 0 else 1.0


@_jit
def _placed_tokens(rank, lengths):
    total = 0
    for i in range(len(rank)):
        if rank[i] >= 0:
            total += lengths[i]
    return total


@_jit
def _gather(order, lengths, costs):
    n = len(order)
    Ls = np.empty(n, dtype=np.int64)
    Cs = np.empty(n)
    for t in range(n):
        Ls[t] = lengths[order[t]]
        Cs[t] = costs[order[t]]
    return Ls, Cs


@_jit
def _scatter_back(order, rank_s, micro_s, new_pos, rank, micro):
    """From placement order back to the caller's order, micro-batches renumbered by new_pos."""
    for t in range(len(order)):
        i = order[t]
        r = rank_s[t]
        rank[i] = r
        micro[i] = new_pos[r, micro_s[t]] if r >= 0 else -1


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


def warmup() -> float:
    """Compile (or load from numba's on-disk cache) the kernels; returns the seconds it took."""
    import time

    t = time.perf_counter()
    lengths = np.array([5, 3, 3, 2, 9], dtype=np.int64)
    for mode in ("equal", "variable"):
        assign(lengths, lengths * 1.5, ranks=2, microbatches=2, capacity=10, mode=mode,
               priority=np.array([0, 2, 0, 1, 0]))
    middle_heavy_order(np.ones((2, 3)))
    many = np.tile(lengths, 8)  # enough small items for the round phase of LPT
    assign(many, many * 1.5, ranks=2, microbatches=8, capacity=10)
    # Tokens binding with long chunks: the second stage (swaps, exchanges, carries).
    bound = np.concatenate([np.full(4, 100), np.full(80, 5), np.full(20, 3)]).astype(np.int64)
    assign(bound, bound + bound**2 / 10.0, ranks=3, microbatches=2, capacity=100)
    # Enough items for the length-order sort, the rounds (>= ROUND_RANKS ranks) and the snapshots of a
    # capped pass that carries (tokens bind), with the passes resumed from them.
    C, R = 1024, 512
    docs = np.clip(np.random.default_rng(0).lognormal(np.log(C / 20), 1.5, size=40000), 4, 10 * C).astype(np.int64)
    docs = docs[: int(np.searchsorted(np.cumsum(docs), R * 4 * C)) + 1]
    pieces = -(-docs // C)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    chunks = np.minimum(C, np.repeat(docs, pieces) - (np.arange(int(pieces.sum())) - first) * C).astype(np.int64)
    for mode in ("equal", "variable"):
        assign(chunks, chunks + chunks**2 / (C / 2.65), ranks=R, microbatches=4, capacity=C, mode=mode)
    first_fit(np.zeros(2, dtype=np.int64), lengths[:2], 2, 10, np.empty(2, dtype=np.int64))
    return time.perf_counter() - t


def _order(costs: np.ndarray, priority: np.ndarray | None, lengths: np.ndarray | None = None) -> np.ndarray:
    """Placement order: urgent items first, then by decreasing cost; ties by index."""
    return _sorted_items(costs, priority, lengths)[0]


def _sorted_items(costs, priority, lengths):
    """The placement order (see _order), and lengths and costs in that order.

    A stable radix sort on the costs' bit patterns (monotone for non-negative floats): the same order on
    every machine and numpy version, unlike an unstable quicksort on tied costs. Text costs are an
    increasing function of length: then a radix sort of the lengths gives the same order faster, with
    the sorted lengths and costs for free (checked on the data; any other cost model takes the first way).
    """
    n = len(costs)
    positive = bool((costs > 0).all())
    order = Ls = Cs = None
    if lengths is not None and n > 4096 and positive:
        order = np.empty(n, dtype=np.int64)
        Ls = np.empty(n, dtype=np.int64)
        Cs = np.empty(n)
        if not _length_order(lengths, costs, order, Ls, Cs):
            order = Ls = Cs = None
    if order is None:
        c = costs if positive else np.where(costs > 0, costs, 0.0)  # also turns -0.0 and NaN into 0.0
        order = _radix_desc(c.view(np.int64))
    if priority is not None:
        urgent = (np.asarray(priority) >= 2)[order]
        if urgent.any():
            order = np.concatenate([order[urgent], order[~urgent]])
            Ls = Cs = None
    if Ls is None and lengths is not None:
        Ls, Cs = _gather(order, lengths, costs)
    return order, Ls, Cs


# ----- kernels (numba) ---------------------------------------------------------------------------
# Heaps hold rank ids ordered by (key[rank], rank): ties break by rank id, so results are deterministic.


@_jit
def _before(key, a, b):
    return key[a] < key[b] or (key[a] == key[b] and a < b)


@_jit
def _sift_down(heap, n, key, i):
    while True:
        c = 2 * i + 1
        if c >= n:
            return
        if c + 1 < n and _before(key, heap[c + 1], heap[c]):
            c += 1
        if _before(key, heap[c], heap[i]):
            heap[c], heap[i] = heap[i], heap[c]
            i = c
        else:
            return


@_jit
def _push(heap, n, key, r):
    i = n
    heap[i] = r
    while i > 0:
        p = (i - 1) // 2
        if _before(key, heap[i], heap[p]):
            heap[p], heap[i] = heap[i], heap[p]
            i = p
        else:
            break
    return n + 1


@_jit
def _pop(heap, n, key):
    r = heap[0]
    n -= 1
    heap[0] = heap[n]
    _sift_down(heap, n, key, 0)
    return r, n


@_jit
def _snapshot(k, i, snap_at, rank_cost, micro_cost, room, best, neg_best, heap, full, ints, flts,
              s_rank_cost, s_micro_cost, s_room, s_best, s_neg_best, s_heap, s_full, s_ints, s_flts):
    snap_at[k] = i
    s_rank_cost[k] = rank_cost
    s_micro_cost[k] = micro_cost
    s_room[k] = room
    s_best[k] = best
    s_neg_best[k] = neg_best
    s_heap[k] = heap
    s_full[k] = full
    s_ints[k] = ints
    s_flts[k] = flts


@_jit
def _lpt(urgent, lengths, costs, R, W, capacity, cap, start, switch, rank, micro, rank_cost, micro_cost, room, best,
         neg_best, heap, full, ints, flts, every, snap_at, s_rank_cost, s_micro_cost, s_room, s_best, s_neg_best,
         s_heap, s_full, s_ints, s_flts, trig):
    """LPT from item `start` on, from the given state, in up to three phases (ints[3] says which):

    0. items before `switch`: each to the least loaded rank with room (heap: ranks by cost; full: ranks
       too full for the current item, by largest hole);
    1. from `switch` on (many small items), while every rank still has room for the item: in rounds,
       ranks sorted by cost once a round and each taking the next item in turn (the least loaded the
       largest; a round holds only ranks LPT itself would serve in that order). The same choices as
       the heaps, at a fraction of a heap operation per item;
    2. once some rank is too full: heaps again, rebuilt from the state (the least-loaded rank *with
       room* and the cap below need them).

    An item that would lift its rank past `cap` while some rank is too full for it is carried (skipped).
    With every > 0 the state is snapshotted at the first item of each `every`-block (at a round start in
    phase 1) and before the first skipped item (last slot), and trig[i] is recorded (see _LptRun).
    """
    n = len(lengths)
    i = start
    if ints[3] == 0:
        i = _lpt_heap(urgent, lengths, costs, R, W, capacity, cap, i, min(switch, n), rank, micro, rank_cost,
                      micro_cost, room, best, neg_best, heap, full, ints, flts, every, snap_at, s_rank_cost,
                      s_micro_cost, s_room, s_best, s_neg_best, s_heap, s_full, s_ints, s_flts, trig)
        if i < n:
            ints[3] = 1  # the heaps stay as they are (ints[0:2]) until a round runs (ints[4])
    if ints[3] == 1 and i < n:
        i = _lpt_rounds(lengths, costs, R, W, capacity, i, rank, micro, rank_cost, micro_cost, room, best, neg_best,
                        heap, full, ints, flts, every, snap_at, s_rank_cost, s_micro_cost, s_room, s_best,
                        s_neg_best, s_heap, s_full, s_ints, s_flts)
        if i < n:
            if ints[4] == 1:
                # Rounds ran (their order overwrote the heaps). Every rank had room for every item they
                # placed, so the heaps' "too full" side would be empty here, all ranks in the cost heap:
                # rebuild exactly that; the heap loop then moves ranks that are too full for item i.
                hn = 0
                for r in range(R):
                    hn = _push(heap, hn, rank_cost, r)
                ints[0] = hn
                ints[1] = 0
            ints[3] = 2
    if ints[3] == 2 and i < n:
        _lpt_heap(urgent, lengths, costs, R, W, capacity, cap, i, n, rank, micro, rank_cost, micro_cost, room,
                  best, neg_best, heap, full, ints, flts, every, snap_at, s_rank_cost, s_micro_cost, s_room, s_best,
                  s_neg_best, s_heap, s_full, s_ints, s_flts, trig)
    return ints[2]


@_jit
def _lpt_heap(urgent, lengths, costs, R, W, capacity, cap, start, stop, rank, micro, rank_cost, micro_cost, room,
              best, neg_best, heap, full, ints, flts, every, snap_at, s_rank_cost, s_micro_cost, s_room, s_best,
              s_neg_best, s_heap, s_full, s_ints, s_flts, trig):
    """Phases 0 and 2 of _lpt over items [start, stop); returns stop."""
    hn = ints[0]
    fn = ints[1]
    skipped = ints[2]
    first_over = flts[0]
    last = len(snap_at) - 1
    due = start if every > 0 else stop  # the next item that may start a snapshot block
    for i in range(start, stop):
        if i >= due:
            k = i // every
            if snap_at[k] < 0:
                ints[0] = hn
                ints[1] = fn
                ints[2] = skipped
                flts[0] = first_over
                _snapshot(k, i, snap_at, rank_cost, micro_cost, room, best, neg_best, heap, full, ints, flts,
                          s_rank_cost, s_micro_cost, s_room, s_best, s_neg_best, s_heap, s_full, s_ints, s_flts)
            due = (k + 1) * every
        L = lengths[i]
        while fn > 0 and best[full[0]] >= L:  # ranks that have room again for items this small
            r, fn = _pop(full, fn, neg_best)
            hn = _push(heap, hn, rank_cost, r)
        while hn > 0 and best[heap[0]] < L:
            r, hn = _pop(heap, hn, rank_cost)
            neg_best[r] = -best[r]
            fn = _push(full, fn, neg_best, r)
        if hn == 0:
            continue
        r = heap[0]
        if fn > 0 and not urgent[i]:
            v = rank_cost[r] + costs[i]
            if every > 0 and skipped == 0:
                trig[i] = v
            if v > cap:
                if skipped == 0:
                    first_over = v  # the plain pass's maximum reaches at least this
                    if every > 0:
                        ints[0] = hn
                        ints[1] = fn
                        ints[2] = 0
                        flts[0] = 0.0  # a pass resumed here has not held anything back yet
                        _snapshot(last, i, snap_at, rank_cost, micro_cost, room, best, neg_best, heap, full, ints,
                                  flts, s_rank_cost, s_micro_cost, s_room, s_best, s_neg_best, s_heap, s_full,
                                  s_ints, s_flts)
                skipped += 1
                continue  # the ranks with room would exceed the cap, others are full of tokens: carry it
        m = _best_fit(room, r, W, L, capacity)
        _put(i, r, m, L, costs[i], rank, micro, rank_cost, micro_cost, room, best, W)
        _sift_down(heap, hn, rank_cost, 0)
    ints[0] = hn
    ints[1] = fn
    ints[2] = skipped
    flts[0] = first_over
    return stop


@_jit
def _best_fit(room, r, W, L, capacity):
    """Rank r's fullest micro-batch with room for L tokens."""
    m = -1
    mr = capacity + 1
    for j in range(W):
        if L <= room[r, j] < mr:
            mr = room[r, j]
            m = j
    return m


@_jit
def _put(i, r, m, L, c, rank, micro, rank_cost, micro_cost, room, best, W):
    """Item i into micro-batch m of rank r; keeps best[r] (its largest hole) current; returns it."""
    was = room[r, m]
    rank[i] = r
    micro[i] = m
    rank_cost[r] += c
    micro_cost[r, m] += c
    room[r, m] -= L
    if was == best[r]:
        b = 0
        for j in range(W):
            if room[r, j] > b:
                b = room[r, j]
        best[r] = b
    return best[r]


@_jit
def _lpt_rounds(lengths, costs, R, W, capacity, start, rank, micro, rank_cost, micro_cost, room, best, keys, order,
                full, ints, flts, every, snap_at, s_rank_cost, s_micro_cost, s_room, s_best, s_neg_best, s_heap,
                s_full, s_ints, s_flts):
    """Phase 1 of _lpt, from item `start` until an item some rank has no room for, or until rounds get
    short (returned; n if neither).

    A round sorts all ranks by (cost, id) into order[:k], k cut where LPT would serve a rank twice (see
    below). A round starting from the current costs is always LPT's choice, so nothing of a round is
    kept between calls or in snapshots: every call, and every pass resumed from a snapshot, starts a new
    one. ints[4] says whether a round ever ran (the sort overwrites the heaps, which _lpt then rebuilds;
    until then ints[0:2] and the heaps are phase 0's). Every rank has room for the item here, so the cap
    never carries anything in this phase, and the result is the heap phase's, only faster.
    """
    n = len(lengths)
    ptr = 0
    k = 0
    min_best = capacity
    for r in range(R):
        if best[r] < min_best:
            min_best = best[r]
    for i in range(start, n):
        L = lengths[i]
        if min_best < L:
            return i
        if ptr >= k:
            # A new round, least loaded first.
            if every > 0 and snap_at[i // every] < 0:
                _snapshot(i // every, i, snap_at, rank_cost, micro_cost, room, best, keys, order, full, ints,
                          flts, s_rank_cost, s_micro_cost, s_room, s_best, s_neg_best, s_heap, s_full, s_ints, s_flts)
            for q in range(R):
                order[q] = q
                keys[q] = rank_cost[q]
            _sort_by_cost(order, keys, R)
            ints[4] = 1
            # The j-th rank of the round takes item i + j. LPT would give it to that rank too if the rank
            # costs less than every rank served before it in the round does afterwards; those cost at
            # least rank_cost[order[0]] + costs[i + j] (items do not get costlier), so the round stops
            # at the first rank that is not strictly below that: the rounds make exactly LPT's choices.
            base = rank_cost[order[0]]
            k = 1
            while k < R and i + k < n and rank_cost[order[k]] < base + costs[i + k]:
                k += 1
            ptr = 0
            if k < ROUND_SHORT and i + k < n:
                # Rounds this short (items that cost next to nothing against the spread of rank costs)
                # would sort all ranks for a few items: the heaps take over, with the same choices.
                return i
        r = order[ptr]
        b = _put(i, r, _best_fit(room, r, W, L, capacity), L, costs[i], rank, micro, rank_cost, micro_cost, room,
                 best, W)
        if b < min_best:
            min_best = b
        ptr += 1
    return n


@_jit
def _sort_by_cost(order, keys, k):
    """Sort order[:k] by keys[:k] (non-negative costs), stably, on the costs' bit patterns."""
    _, idx = _radix_sort(keys[:k].view(np.int64).copy(), order[:k].copy(), 0x7FFFFFFFFFFFFFFF, 8)
    for t in range(k):
        order[t] = idx[t]


@_jit
def _pack_micro(lengths, costs, rank, micro, micro_cost, room, capacity, compact, counts):
    """Re-pack each rank's items cost-first onto its least costly micro-batch with room.

    Items come in placement order (decreasing cost). With `compact` (variable mode) a rank keeps only
    as many micro-batches as its best-fit packing used, moved to the front; counts[r] says how many.
    Two attempts per rank: every item cost-first onto the least costly micro-batch with room; or only
    the large ones (over capacity / 8) cost-first and the small ones best-fit into the holes (when
    tokens are tight the first may not fit everything). The most even one that fits wins, if it lowers
    the rank's heaviest micro-batch; otherwise the best-fit packing stays. All ranks are re-packed in
    one pass over the items in placement order (each rank sees its own items in that order), so no
    per-rank item lists are built.
    """
    R, W = room.shape
    n = len(lengths)
    use = np.full(R, W, dtype=np.int64)
    if compact:
        slot = np.empty((R, W), dtype=np.int64)
        c_tmp = np.empty(W)
        r_tmp = np.empty(W, dtype=np.int64)
        for r in range(R):
            k = 0
            for j in range(W):
                if room[r, j] < capacity:
                    slot[r, j] = k
                    k += 1
                else:
                    slot[r, j] = -1
            used = k
            for j in range(W):
                if slot[r, j] < 0:
                    slot[r, j] = k
                    k += 1
            for j in range(W):
                c_tmp[slot[r, j]] = micro_cost[r, j]
                r_tmp[slot[r, j]] = room[r, j]
            for j in range(W):
                micro_cost[r, j] = c_tmp[j]
                room[r, j] = r_tmp[j]
            use[r] = max(used, 1)
            counts[r] = use[r]
        for i in range(n):
            if rank[i] >= 0:
                micro[i] = slot[rank[i], micro[i]]
    c2 = np.zeros((2, R, W))
    room2 = np.full((2, R, W), capacity, dtype=np.int64)
    ok = np.ones((2, R), dtype=np.bool_)
    out = np.empty((2, n), dtype=np.int16)  # micro-batch slots (< 32768): half the fresh pages of int32
    small = (0, capacity // 8)
    for i in range(n):
        r = rank[i]
        if r < 0:
            continue
        L = lengths[i]
        for at in range(2):
            if not ok[at, r]:
                continue
            m = -1
            if L > small[at]:
                for j in range(use[r]):
                    if room2[at, r, j] >= L and (m < 0 or c2[at, r, j] < c2[at, r, m]):
                        m = j
            else:
                for j in range(use[r]):
                    if room2[at, r, j] >= L and (m < 0 or room2[at, r, j] < room2[at, r, m]):
                        m = j
            if m < 0:
                ok[at, r] = False
                continue
            c2[at, r, m] += costs[i]
            room2[at, r, m] -= L
            out[at, i] = m
    best_at = np.full(R, -1, dtype=np.int64)
    for r in range(R):
        best_max = 0.0
        for j in range(use[r]):
            if micro_cost[r, j] > best_max:
                best_max = micro_cost[r, j]
        for at in range(2):
            if not ok[at, r]:
                continue
            top = 0.0
            for j in range(use[r]):
                if c2[at, r, j] > top:
                    top = c2[at, r, j]
            if top < best_max:
                best_max = top
                best_at[r] = at
        if best_at[r] >= 0:
            for j in range(use[r]):
                micro_cost[r, j] = c2[best_at[r], r, j]
                room[r, j] = room2[best_at[r], r, j]
    for i in range(n):
        r = rank[i]
        if r >= 0 and best_at[r] >= 0:
            micro[i] = out[best_at[r], i]


@_jit
def _length_order(lengths, c, order, Ls, Cs):
    """Sort by decreasing length, ties by index, into `order` (LSD radix, 11 bits a pass), with the
    lengths and costs in that order in Ls and Cs. True when that is also the order by decreasing cost c
    with ties by index (cost a strictly increasing function of length); False (outputs undefined)
    otherwise."""
    n = len(lengths)
    top = 0
    for i in range(n):
        if lengths[i] < 0:
            return False
        if lengths[i] > top:
            top = lengths[i]
    if top > 16 * n + 65536 or n >= 2**31 - 1 or top >= 2**31 - 1:
        return False
    # Cost as a function of length: one value per length, increasing.
    of_len = np.full(top + 1, -1.0)
    for i in range(n):
        v = of_len[lengths[i]]
        if v < 0.0:
            of_len[lengths[i]] = c[i]
        elif v != c[i]:
            return False
    prev = -1.0
    for v in of_len:
        if v >= 0.0:
            if not v > prev:
                return False
            prev = v
    if top < (1 << 22):
        # Two 11-bit passes: the first straight from the lengths, the second straight into the outputs.
        h0 = np.zeros(2049, dtype=np.int64)
        h1 = np.zeros(2049, dtype=np.int64)
        for i in range(n):
            k = top - lengths[i]
            h0[(k & 2047) + 1] += 1
            h1[(k >> 11) + 1] += 1
        for d in range(2048):
            h0[d + 1] += h0[d]
            h1[d + 1] += h1[d]
        key = np.empty(n, dtype=np.int32)
        idx = np.empty(n, dtype=np.int32)
        for i in range(n):
            k = top - lengths[i]
            p = h0[k & 2047]
            h0[k & 2047] = p + 1
            key[p] = k
            idx[p] = i
        for t in range(n):
            k = key[t]
            p = h1[k >> 11]
            h1[k >> 11] = p + 1
            order[p] = idx[t]
            Ls[p] = top - k
            Cs[p] = of_len[top - k]
        return True
    key = np.empty(n, dtype=np.int32)
    idx = np.empty(n, dtype=np.int32)
    for i in range(n):
        key[i] = top - lengths[i]
        idx[i] = i
    key, idx = _radix_sort(key, idx, top, 11)
    for i in range(n):
        order[i] = idx[i]
        Ls[i] = top - key[i]
        Cs[i] = of_len[Ls[i]]
    return True


@_jit
def _radix_sort(key, idx, top, digit_bits):
    """Sort (key, idx) pairs by key, stably (ties keep their order), for non-negative integer keys up to
    `top`: LSD radix, `digit_bits` a pass, passes whose digit is the same for every key skipped.
    Returns the sorted pair (possibly the other buffers: the arrays passed in are used as scratch)."""
    n = len(key)
    size = 1 << digit_bits
    mask = size - 1
    key2 = np.empty_like(key)
    idx2 = np.empty_like(idx)
    count = np.empty(size + 1, dtype=np.int64)
    shift = 0
    while shift < 63 and (top >> shift) > 0:
        count[:] = 0
        for i in range(n):
            count[((key[i] >> shift) & mask) + 1] += 1
        if count.max() < n:
            for d in range(size):
                count[d + 1] += count[d]
            for i in range(n):
                d = (key[i] >> shift) & mask
                p = count[d]
                count[d] = p + 1
                key2[p] = key[i]
                idx2[p] = idx[i]
            key, key2 = key2, key
            idx, idx2 = idx2, idx
        shift += digit_bits
    return key, idx


@_jit
def _radix_desc(bits):
    """Stable argsort of non-negative int64 keys, descending (ties: ascending index)."""
    n = len(bits)
    MAXK = 0x7FFFFFFFFFFFFFFF
    key = np.empty(n, dtype=np.int64)
    for i in range(n):
        key[i] = MAXK - bits[i]
    return _radix_sort(key, np.arange(n), MAXK, 8)[1]


@_jit
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


@_jit
def _middle_heavy(micro_cost, counts, new_pos):
    R, W = micro_cost.shape
    for r in range(R):
        m = counts[r]
        order = np.argsort(micro_cost[r, :m], kind="mergesort")  # lightest first
        for k in range(m):
            # slots from the outside in: 0, m-1, 1, m-2, ...
            slot = k // 2 if k % 2 == 0 else m - 1 - k // 2
            new_pos[r, order[k]] = slot
        for j in range(m, W):
            new_pos[r, j] = j


@_jit
def _refine_swaps(mc, owner, slots, rank_cost, R, W, max_iter):
    """Pairwise swaps of whole micro-batches between ranks (any two fit anywhere: each is <= capacity).

    slots[r, k] is the micro-batch id in rank r's k-th slot; owner[g] its rank. Each iteration takes the
    costliest rank p (ties: highest id) and the swap with any other rank that lowers max(cost p, cost q)
    the most; stops when no swap lowers the costliest rank. Ranks are kept sorted by (cost, id): a swap
    with q cannot end below (top + cost q) / 2, so the scan from the lightest rank stops early."""
    order = np.argsort(rank_cost, kind="mergesort")
    for it in range(max_iter):
        p = order[R - 1]
        top = rank_cost[p]
        best = top * (1.0 - 1e-12)
        bq = -1
        ba = -1
        bb = -1
        for t in range(min(R - 1, SWAP_SCAN)):
            q = order[t]
            cq = rank_cost[q]
            if cq >= best + best - top:
                break
            for a in range(W):
                ca = mc[slots[p, a]]
                for b in range(W):
                    d = ca - mc[slots[q, b]]
                    if d <= 0.0:
                        continue
                    nm = top - d
                    if cq + d > nm:
                        nm = cq + d
                    if nm < best:
                        best = nm
                        bq = q
                        ba = a
                        bb = b
        if bq < 0:
            return it
        ga = slots[p, ba]
        gb = slots[bq, bb]
        d = mc[ga] - mc[gb]
        slots[p, ba] = gb
        slots[bq, bb] = ga
        owner[ga] = bq
        owner[gb] = p
        rank_cost[p] -= d
        rank_cost[bq] += d
        # Re-sort: drop p and bq, then insert both by (cost, id).
        k = 0
        for t in range(R):
            r = order[t]
            if r != p and r != bq:
                order[k] = r
                k += 1
        for r in (p, bq):
            j = k
            while j > 0 and _before(rank_cost, r, order[j - 1]):
                order[j] = order[j - 1]
                j -= 1
            order[j] = r
            k += 1
    return max_iter


def _rebalance(Ls, Cs, Us, rank_s, micro_s, micro_cost, room, R, W, capacity, carry_budget):
    """Stage 2 (equal mode): move whole micro-batches between ranks, then carry the costliest items of
    the costliest rank while that lowers max/LB, up to carry_budget tokens. Modifies the arrays."""
    G = R * W
    mc = micro_cost.ravel().copy()
    slots = np.arange(G, dtype=np.int64).reshape(R, W)
    owner = np.repeat(np.arange(R, dtype=np.int64), W)
    rc = micro_cost.sum(axis=1)
    cmax_u, first_rest = _placed_stats(rank_s, Cs, Us)
    total = float(Cs[rank_s >= 0].sum())
    max_iter = 4 * R + 16
    _refine_swaps(mc, owner, slots, rc, R, W, max_iter)

    def ratio(rc, total, cmax):
        lb = max(total / R, cmax)
        return float(rc.max()) / lb if lb > 0 else 1.0

    if EXCHANGE and ratio(rc, total, float(Cs.max(initial=0.0))) > 1.0 + RECAP_ABOVE:
        # Items move between a micro-batch of the costliest rank and one of the lightest.
        item_g = _item_group(rank_s, micro_s, W)
        nxt = np.full(len(Ls), -1, dtype=np.int64)
        head = np.full(G, -1, dtype=np.int64)
        _item_lists(item_g, head, nxt)
        mtok = capacity - room.ravel().copy()
        pool = np.empty(len(Ls), dtype=np.int64)
        side = np.empty(len(Ls), dtype=np.int8)
        if _exchange(Ls, Cs, item_g, head, nxt, mc, mtok, owner, slots, rc, R, W, capacity, max_iter, pool, side):
            _from_group(item_g, W, rank_s, micro_s)
            room.ravel()[:] = capacity - mtok
            _refine_swaps(mc, owner, slots, rc, R, W, max_iter)

    cmax = max(cmax_u, float(Cs[first_rest]) if first_rest >= 0 else 0.0)
    # Candidates to carry, costliest first: items of at least half a micro-batch (the long chunks whose
    # count is what cannot be split evenly over ranks).
    pl_idx, after_long = _long_items(rank_s, Us, Ls, capacity)
    best_r = ratio(rc, total, cmax)
    best = (mc.copy(), slots.copy(), owner.copy(), rc.copy(), 0)
    removed = []
    # The costliest ranks typically hold one long item more than the rest: all of them must give one up
    # before the maximum drops, so the search goes on for a while without progress before it stops.
    affordable = int(np.searchsorted(np.cumsum(Ls[pl_idx][::-1]), carry_budget, side="right"))
    patience = max(CARRY_PATIENCE, affordable // 8)
    if best_r > 1.0 + RECAP_ABOVE and carry_budget > 0 and affordable > 0:
        # Carry the costliest long item of the costliest rank, one at a time (a few swaps after each),
        # while the budget lasts; the best state seen wins.
        g_of = rank_s[pl_idx].astype(np.int64) * W + micro_s[pl_idx]
        alive = np.ones(len(pl_idx), dtype=np.bool_)
        left = int(carry_budget)
        fits = Ls[pl_idx] <= left
        for _ in range(len(pl_idx)):
            p = int(np.argmax(rc))
            fits &= Ls[pl_idx] <= left
            cand = np.flatnonzero(alive & fits & (owner[g_of] == p))
            if len(cand) == 0:
                break
            k = int(cand[0])
            i = int(pl_idx[k])
            alive[k] = False
            left -= int(Ls[i])
            g = int(g_of[k])
            mc[g] -= Cs[i]
            rc[p] -= Cs[i]
            total -= float(Cs[i])
            removed.append(i)
            if k == 0 or not alive[:k].any():
                rest = np.flatnonzero(alive)
                cmax = max(cmax_u, float(Cs[pl_idx[rest[0]]]) if len(rest) else 0.0)
                if after_long >= 0:
                    cmax = max(cmax, float(Cs[after_long]))
            _refine_swaps(mc, owner, slots, rc, R, W, max_iter)
            r_now = ratio(rc, total, cmax)
            if r_now < best_r * (1.0 - 1e-9):
                best_r = r_now
                best = (mc.copy(), slots.copy(), owner.copy(), rc.copy(), len(removed))
                if r_now <= 1.0 + RECAP_ABOVE:
                    break
            elif len(removed) - best[4] >= patience:
                break
        if best[4]:
            mc, slots, owner, rc = (x.copy() for x in best[:4])
            _refine_swaps(mc, owner, slots, rc, R, W, max_iter)
            best = (mc, slots, owner, rc, best[4])
    mc, slots, owner, rc, nrem = best
    if nrem:
        gone = np.array(removed[:nrem], dtype=np.int64)
        g = rank_s[gone].astype(np.int64) * W + micro_s[gone]
        room_flat = room.ravel()
        np.add.at(room_flat, g, Ls[gone])
        room[:] = room_flat.reshape(R, W)
        rank_s[gone] = -1
        micro_s[gone] = -1
    pos = np.empty(G, dtype=np.int64)
    pos[slots.ravel()] = np.tile(np.arange(W, dtype=np.int64), R)
    room_new = room.ravel()[slots]
    # Exact costs from the items (no drift from incremental updates).
    mc_new = np.zeros(G)
    _move_groups(rank_s, micro_s, owner, pos, W, Cs, mc_new)
    micro_cost[:] = mc_new.reshape(R, W)
    room[:] = room_new
    return micro_cost.sum(axis=1), nrem


@_jit
def _placed_stats(rank, costs, urgent):
    """The largest cost of a placed urgent item (0.0: none), and the first placed non-urgent item (-1)."""
    cmax_u = 0.0
    first = -1
    for i in range(len(rank)):
        if rank[i] >= 0:
            if urgent[i]:
                if costs[i] > cmax_u:
                    cmax_u = costs[i]
            elif first < 0:
                first = i
    return cmax_u, first


@_jit
def _long_items(rank, urgent, lengths, capacity):
    """Placed non-urgent items of at least half a micro-batch, in order; and the first placed non-urgent
    item after as many such items as there are (-1: none) - the costliest one left if all were carried."""
    n = len(rank)
    out = np.empty(n, dtype=np.int64)
    k = 0
    rest = 0
    for i in range(n):
        if rank[i] >= 0 and not urgent[i]:
            if lengths[i] * 2 >= capacity:
                out[k] = i
                k += 1
    after = -1
    for i in range(n):
        if rank[i] >= 0 and not urgent[i]:
            if rest == k:
                after = i
                break
            rest += 1
    return out[:k].copy(), after


@_jit
def _item_group(rank, micro, W):
    g = np.full(len(rank), -1, dtype=np.int64)
    for i in range(len(rank)):
        if rank[i] >= 0:
            g[i] = rank[i] * W + micro[i]
    return g


@_jit
def _from_group(g, W, rank, micro):
    for i in range(len(g)):
        if g[i] >= 0:
            rank[i] = g[i] // W
            micro[i] = g[i] % W


@_jit
def _move_groups(rank, micro, owner, pos, W, costs, mc):
    """Micro-batch g = rank * W + micro now sits at (owner[g], pos[g]); mc: the costs per new slot."""
    for i in range(len(rank)):
        if rank[i] >= 0:
            g = rank[i] * W + micro[i]
            rank[i] = owner[g]
            micro[i] = pos[g]
            mc[rank[i] * W + micro[i]] += costs[i]


@_jit
def _split_pair(ga, gb, head, nxt, mtok, lengths, costs, capacity, target, pool, side):
    """Pool the items of micro-batches ga and gb (in placement order) and split them again: longest
    first onto the light side (side 1) while its cost stays within `target`, then the shortest onto it
    until the heavy side fits. Returns (pooled count, pooled tokens, light-side tokens, light-side cost)."""
    k = 0
    ia = head[ga]
    ib = head[gb]
    while ia >= 0 or ib >= 0:
        if ib < 0 or (ia >= 0 and ia < ib):
            pool[k] = ia
            ia = nxt[ia]
        else:
            pool[k] = ib
            ib = nxt[ib]
        k += 1
    ptok = mtok[ga] + mtok[gb]
    btok = 0
    bc = 0.0
    for j in range(k):
        i = pool[j]
        side[j] = 0
        if btok + lengths[i] <= capacity and bc + costs[i] <= target:
            side[j] = 1
            btok += lengths[i]
            bc += costs[i]
    j = k - 1
    while ptok - btok > capacity and j >= 0:
        i = pool[j]
        if side[j] == 0 and btok + lengths[i] <= capacity:
            side[j] = 1
            btok += lengths[i]
            bc += costs[i]
        j -= 1
    return k, ptok, btok, bc


@_jit
def _exchange(lengths, costs, item_g, head, nxt, mc, mtok, owner, slots, rank_cost, R, W, capacity, max_iter,
              pool, side):
    """Item exchanges between a micro-batch of the costliest rank and one of the lightest rank.

    When every micro-batch is full of tokens, cost can still move between ranks: long documents cost more
    per token than short ones, so the light rank's micro-batch takes long documents and gives back as
    many tokens of short ones. The pooled items of the two micro-batches are split again: longest first
    (costliest per token) onto the light side while its cost stays below the target, then the shortest
    onto the light side until the heavy side fits. head[g] / nxt[i]: items of micro-batch g, a linked
    list in placement order (decreasing cost)."""
    done = 0
    for it in range(max_iter):
        p = 0
        q = 0
        for r in range(1, R):
            if rank_cost[r] > rank_cost[p] or (rank_cost[r] == rank_cost[p] and r < p):
                p = r
            if rank_cost[r] < rank_cost[q]:
                q = r
        top = rank_cost[p]
        if p == q:
            return done
        best = top * (1.0 - 1e-9)
        bga = -1
        bgb = -1
        for a in range(W):
            ga = slots[p, a]
            for b in range(W):
                gb = slots[q, b]
                target = mc[gb] + (top - rank_cost[q]) * 0.5  # light side's ideal cost
                k, ptok, btok, bc = _split_pair(ga, gb, head, nxt, mtok, lengths, costs, capacity, target, pool, side)
                if ptok - btok > capacity:
                    continue
                d = bc - mc[gb]  # cost moved to the light rank
                if d <= 0.0:
                    continue
                nm = top - d
                if rank_cost[q] + d > nm:
                    nm = rank_cost[q] + d
                if nm < best:
                    best = nm
                    bga = ga
                    bgb = gb
        if bga < 0:
            return done
        # Redo the best split and write it.
        ga = bga
        gb = bgb
        target = mc[gb] + (top - rank_cost[q]) * 0.5
        k, ptok, btok, bc = _split_pair(ga, gb, head, nxt, mtok, lengths, costs, capacity, target, pool, side)
        ac = 0.0
        atok = 0
        la = -1
        lb = -1
        head[ga] = -1
        head[gb] = -1
        for j in range(k):
            i = pool[j]
            nxt[i] = -1
            if side[j] == 1:
                item_g[i] = gb
                if lb < 0:
                    head[gb] = i
                else:
                    nxt[lb] = i
                lb = i
            else:
                item_g[i] = ga
                ac += costs[i]
                atok += lengths[i]
                if la < 0:
                    head[ga] = i
                else:
                    nxt[la] = i
                la = i
        d = bc - mc[gb]
        rank_cost[p] += ac - mc[ga]
        rank_cost[q] += d
        mc[ga] = ac
        mc[gb] = bc
        mtok[ga] = atok
        mtok[gb] = btok
        done += 1
    return done


@_jit
def _item_lists(item_g, head, nxt):
    """Linked lists of each micro-batch's items in increasing index (placement) order."""
    for i in range(len(item_g) - 1, -1, -1):
        g = item_g[i]
        if g >= 0:
            nxt[i] = head[g]
            head[g] = i
