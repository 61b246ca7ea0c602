"""Balancing: assign each document (chunk) of a global step to a (DP rank, micro-batch).

The objective is the step time: the largest total cost over DP ranks, subject to every micro-batch
holding at most `capacity` tokens. This module is pure: arrays in, arrays out, deterministic.

Lower bound (the certificate reported with every step): no assignment can beat
    LB = max(sum(cost) / ranks, max(cost)).

The algorithm, in three passes over arrays (compiled with numba when it is installed; the very same
Python functions run uncompiled otherwise, so results never depend on it):

1. **LPT with capacity.** Items in order of decreasing cost (items carried before go first, so nothing
   starves) each go to the least-loaded rank that still has a micro-batch with room for them, into the
   fullest micro-batch they fit (best fit keeps big holes for big items). Two heaps make this
   O(n log R): ranks by cost, and ranks that are currently too full by their largest hole, so a rank
   returns as soon as items become small enough for it. Items that fit nowhere stay unplaced (rank -1).
2. **Cost cap.** When tokens bind before cost (a rank holding a 128k-token chunk is "full" at far more
   than the mean cost, while ranks of short documents are full at less), the pass is repeated with
   every rank's cost capped just above the lower bound: while some ranks are too full for an item, the
   cheap leftovers that would push a rank past the cap are carried to the next step instead of piling
   onto the expensive ranks. The capped result is kept when it certifies better; a second capped pass
   at the new (lower) bound may follow if it carries at most 2% more of the step's tokens. Carried
   items go first in the next step, uncapped, so nothing waits more than a step for this.
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
    order = _order(costs, priority)
    # Work in placement order: the passes below then stream through contiguous arrays.
    Ls, Cs = lengths[order], costs[order]
    Us = np.zeros(n, dtype=np.bool_) if priority is None else (np.asarray(priority) >= 2)[order]
    cap = lower_bound(costs, R) * (1.0 + CAP_SLACK)
    # Tokens may bind before cost: some ranks full of cheap short documents while others hold the
    # expensive long ones. The capped pass carries the cheapest leftovers instead of piling them onto
    # the expensive ranks. Where it holds nothing back it *is* the plain pass. Where it does, the plain
    # pass would have put the first held-back item on top, reaching first_over, and its bound is at
    # most the bound of all items: if the capped pass certifies below first_over / LB(all) it wins
    # without running the plain one; otherwise both are compared.
    state = _place(Us, Ls, Cs, R, W, int(capacity), cap)
    lb_all = lower_bound(Cs, R)
    if state[5] and _ratio(state, Cs, R) > state[6] / lb_all:
        plain = _place(Us, Ls, Cs, R, W, int(capacity), np.inf)
        if _ratio(plain, Cs, R) <= _ratio(state, Cs, R):
            state = plain
    if state[5] and _ratio(state, Cs, R) > 1.0 + RECAP_ABOVE:
        # Carrying lowered the bound itself: cap again at the new bound, if that carries at most
        # RECAP_TOKENS more of the step's tokens.
        placed = state[0] >= 0
        recap = lower_bound(Cs[placed], R) * (1.0 + CAP_SLACK)
        again = _place(Us, Ls, Cs, R, W, int(capacity), recap)
        lost = int(Ls[placed].sum()) - int(Ls[again[0] >= 0].sum())
        if _ratio(again, Cs, R) < _ratio(state, Cs, R) and lost <= RECAP_TOKENS * int(Ls.sum()):
            state = again
    rank_s, micro_s, rank_cost, micro_cost, room = state[:5]
    counts = np.full(R, W, dtype=np.int64)
    _pack_micro(Ls, Cs, rank_s, micro_s, micro_cost, room, int(capacity), mode == "variable", counts)
    if mode == "equal" and R > 1 and n and _ratio(state, Cs, R) > 1.0 + RECAP_ABOVE:
        rank_cost, _ = _rebalance(Ls, Cs, Us, rank_s, micro_s, micro_cost, room, R, W, int(capacity),
                                  int(REBALANCE_TOKENS * int(Ls.sum())))
    rank = np.empty(n, dtype=np.int32)
    micro = np.empty(n, dtype=np.int32)
    rank[order] = rank_s
    micro[order] = micro_s
    micro_tokens = int(capacity) - room
    new_pos = np.empty((R, W), dtype=np.int64)
    _middle_heavy(micro_cost, counts, new_pos)
    placed = rank >= 0
    micro[placed] = new_pos[rank[placed], micro[placed]]
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


def _place(urgent, lengths, costs, R, W, capacity, cap):
    """One LPT pass over items already in placement order."""
    n = len(lengths)
    rank = np.full(n, -1, dtype=np.int32)
    micro = np.full(n, -1, dtype=np.int32)
    rank_cost = np.zeros(R)
    micro_cost = np.zeros((R, W))
    room = np.full((R, W), capacity, dtype=np.int64)
    skipped, first_over = _lpt(urgent, lengths, costs, R, W, capacity, float(cap), rank, micro, rank_cost, micro_cost, room)
    return rank, micro, rank_cost, micro_cost, room, skipped, first_over


def _ratio(state, costs, R) -> float:
    placed = state[0] >= 0
    lb = lower_bound(costs[placed], R)
    return float(state[2].max()) / lb if lb > 0 else 1.0


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
    first_fit(np.zeros(2, dtype=np.int64), lengths[:2], 2, 10, np.empty(2, dtype=np.int64))
    return time.perf_counter() - t


def _order(costs: np.ndarray, priority: np.ndarray | None) -> np.ndarray:
    """Placement order: urgent items first, then by decreasing cost; ties by index.

    A stable radix sort on the costs' bit patterns (monotone for non-negative floats): the same order on
    every machine and numpy version, unlike an unstable quicksort on tied costs.
    """
    c = np.where(costs > 0, costs, 0.0)  # also turns -0.0 and NaN into 0.0
    order = _radix_desc(c.view(np.int64))
    if priority is not None:
        urgent = (np.asarray(priority) >= 2)[order]
        if urgent.any():
            order = np.concatenate([order[urgent], order[~urgent]])
    return order


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
def _lpt(urgent, lengths, costs, R, W, capacity, cap, rank, micro, rank_cost, micro_cost, room):
    best = np.full(R, capacity, dtype=np.int64)  # each rank's largest hole
    neg_best = np.zeros(R)  # key of the "too full" heap: largest hole first
    heap = np.arange(R, dtype=np.int64)  # ranks by cost; all 0 now, so already a heap
    hn = R
    full = np.empty(R, dtype=np.int64)
    fn = 0
    skipped = 0  # items the cap held back
    first_over = 0.0
    for i in range(len(lengths)):
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
        if rank_cost[r] + costs[i] > cap and fn > 0 and not urgent[i]:
            if skipped == 0:
                first_over = rank_cost[r] + costs[i]  # the plain pass's maximum reaches at least this
            skipped += 1
            continue  # the ranks with room would exceed the cap, others are full of tokens: carry it
        m = -1
        mr = capacity + 1
        for j in range(W):
            if L <= room[r, j] < mr:
                mr = room[r, j]
                m = j
        rank[i] = r
        micro[i] = m
        rank_cost[r] += costs[i]
        micro_cost[r, m] += costs[i]
        room[r, m] -= L
        if mr == best[r]:
            b = 0
            for j in range(W):
                if room[r, j] > b:
                    b = room[r, j]
            best[r] = b
        _sift_down(heap, hn, rank_cost, 0)
    return skipped, first_over


@_jit
def _pack_micro(lengths, costs, rank, micro, micro_cost, room, capacity, compact, counts):
    """Re-pack each rank's items cost-first onto its least costly micro-batch with room.

    Items come in placement order (decreasing cost). With `compact` (variable mode) a rank keeps only
    as many micro-batches as its best-fit packing used, moved to the front; counts[r] says how many.
    The re-pack is kept only when it fits every item and lowers the rank's heaviest micro-batch.
    """
    R, W = room.shape
    n = len(lengths)
    # Items of each rank, in placement order (CSR).
    start = np.zeros(R + 1, dtype=np.int64)
    for i in range(n):
        if rank[i] >= 0:
            start[rank[i] + 1] += 1
    for r in range(R):
        start[r + 1] += start[r]
    fill = start[:-1].copy()
    items = np.empty(start[R], dtype=np.int64)
    for i in range(n):
        r = rank[i]
        if r >= 0:
            items[fill[r]] = i
            fill[r] += 1
    slot = np.empty(W, dtype=np.int64)
    c2 = np.empty(W)
    room2 = np.empty(W, dtype=np.int64)
    for r in range(R):
        a, b = start[r], start[r + 1]
        use = W
        if compact:
            use = 0
            for j in range(W):
                if room[r, j] < capacity:
                    slot[j] = use
                    use += 1
                else:
                    slot[j] = -1
            k = use
            for j in range(W):
                if slot[j] < 0:
                    slot[j] = k
                    k += 1
            for j in range(W):
                c2[slot[j]] = micro_cost[r, j]
                room2[slot[j]] = room[r, j]
            for j in range(W):
                micro_cost[r, j] = c2[j]
                room[r, j] = room2[j]
            for k in range(a, b):
                micro[items[k]] = slot[micro[items[k]]]
            use = max(use, 1)
            counts[r] = use
        old_max = 0.0
        for j in range(use):
            if micro_cost[r, j] > old_max:
                old_max = micro_cost[r, j]
        # Attempts: every item cost-first onto the least costly micro-batch with room; or only the
        # large ones cost-first and the small ones best-fit into the holes (when tokens are tight the
        # first may not fit everything). The most even one that fits wins, if it beats best fit.
        best_small = -1
        best_max = old_max
        for small in (0, capacity // 8):
            new_max = _repack(items, a, b, lengths, costs, use, capacity, small, c2, room2, micro, False)
            if 0.0 <= new_max < best_max:
                best_max = new_max
                best_small = small
        if best_small < 0:
            continue
        _repack(items, a, b, lengths, costs, use, capacity, best_small, c2, room2, micro, True)
        for j in range(use):
            micro_cost[r, j] = c2[j]
            room[r, j] = room2[j]


@_jit
def _repack(items, a, b, lengths, costs, use, capacity, small, c2, room2, micro, write):
    """Pack items[a:b] into `use` micro-batches: longer than `small` onto the least costly one with
    room, the rest best-fit. Returns the heaviest micro-batch's cost, or -1.0 if an item did not fit."""
    for j in range(use):
        c2[j] = 0.0
        room2[j] = capacity
    for k in range(a, b):
        i = items[k]
        L = lengths[i]
        m = -1
        if L > small:
            for j in range(use):
                if room2[j] >= L and (m < 0 or c2[j] < c2[m]):
                    m = j
        else:
            for j in range(use):
                if room2[j] >= L and (m < 0 or room2[j] < room2[m]):
                    m = j
        if m < 0:
            return -1.0
        c2[m] += costs[i]
        room2[m] -= L
        if write:
            micro[i] = m
    top = 0.0
    for j in range(use):
        if c2[j] > top:
            top = c2[j]
    return top

@_jit
def _radix_desc(bits):
    """Stable argsort of non-negative int64 keys, descending (ties: ascending index); LSD radix, 8 bits
    a pass, passes whose digit is the same for every key skipped."""
    n = len(bits)
    MAXK = 0x7FFFFFFFFFFFFFFF
    key = np.empty(n, dtype=np.int64)
    for i in range(n):
        key[i] = MAXK - bits[i]
    idx = np.arange(n)
    key2 = np.empty(n, dtype=np.int64)
    idx2 = np.empty(n, dtype=np.int64)
    count = np.empty(257, dtype=np.int64)
    for shift in range(0, 64, 8):
        count[:] = 0
        for i in range(n):
            count[((key[i] >> shift) & 255) + 1] += 1
        if count.max() == n:
            continue
        for d in range(256):
            count[d + 1] += count[d]
        for i in range(n):
            d = (key[i] >> shift) & 255
            p = count[d]
            count[d] = p + 1
            key2[p] = key[i]
            idx2[p] = idx[i]
        key, key2 = key2, key
        idx, idx2 = idx2, idx
    return idx


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
    placed = rank_s >= 0
    total = float(Cs[placed].sum())
    cmax_u = float(Cs[placed & Us].max()) if (placed & Us).any() else 0.0
    max_iter = 4 * R + 16
    _refine_swaps(mc, owner, slots, rc, R, W, max_iter)

    def ratio(rc, total, cmax):
        lb = max(total / R, cmax)
        return float(rc.max()) / lb if lb > 0 else 1.0

    if EXCHANGE and ratio(rc, total, float(Cs.max(initial=0.0))) > 1.0 + RECAP_ABOVE:
        # Items move between a micro-batch of the costliest rank and one of the lightest.
        idx = np.flatnonzero(placed)
        item_g = np.full(len(Ls), -1, dtype=np.int64)
        item_g[idx] = rank_s[idx].astype(np.int64) * W + micro_s[idx]
        nxt = np.full(len(Ls), -1, dtype=np.int64)
        head = np.full(G, -1, dtype=np.int64)
        _item_lists(item_g, head, nxt)
        mtok = capacity - room.ravel().copy()
        pool = np.empty(len(Ls), dtype=np.int64)
        side = np.empty(len(Ls), dtype=np.int8)
        if _exchange(Ls, Cs, item_g, head, nxt, mc, mtok, owner, slots, rc, R, W, capacity, max_iter, pool, side):
            rank_s[idx] = item_g[idx] // W
            micro_s[idx] = item_g[idx] % W
            room.ravel()[:] = capacity - mtok
            _refine_swaps(mc, owner, slots, rc, R, W, max_iter)

    rest_all = np.flatnonzero(placed & ~Us)
    cmax = max(cmax_u, float(Cs[rest_all[0]]) if len(rest_all) else 0.0)
    # Candidates to carry, costliest first: items of at least half a micro-batch (the long chunks whose
    # count is what cannot be split evenly over ranks).
    pl_idx = rest_all[Ls[rest_all] * 2 >= capacity]
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
                if len(rest_all) > len(pl_idx):
                    cmax = max(cmax, float(Cs[rest_all[len(pl_idx)]]))
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
    ok = rank_s >= 0
    g = rank_s[ok].astype(np.int64) * W + micro_s[ok]
    rank_s[ok] = owner[g]
    micro_s[ok] = pos[g]
    # Exact costs from the items (no drift from incremental updates).
    mc_new = np.bincount(rank_s[ok].astype(np.int64) * W + micro_s[ok], weights=Cs[ok], minlength=G)
    micro_cost[:] = mc_new.reshape(R, W)
    room[:] = room_new
    return micro_cost.sum(axis=1), nrem


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
