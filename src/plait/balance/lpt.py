"""Stages 2 and 3: LPT with capacity, and the passes at other cost caps resumed from its snapshots.

Stage 2, one LPT pass. Items in placement order (stage 1) each go to the least-loaded rank that still
has a micro-batch with room for them, into the fullest micro-batch they fit (best fit keeps big holes
for big items). Two heaps make this O(n log R): ranks by cost, and ranks that are currently too full by
their largest hole, so a rank returns as soon as items become small enough for it. Items that fit
nowhere stay unplaced (rank -1). The many small items at the end (each at most LB / ROUND_ITEM) go in
rounds while every rank still has room for them: ranks sorted by cost once a round, each taking the next
item, the least loaded the largest, a round ending where LPT would serve a rank twice. These are exactly
LPT's choices without a heap operation per item; as soon as some rank is too full the heaps take over.

Stage 3, the cost cap. An item that would lift its rank past `cap` while some rank is too full for it
is carried to the next step (skipped) instead of piling onto the ranks that still have room: when tokens
bind before cost, the ranks of short cheap documents are full at a low cost and the rest would otherwise
overshoot. `assign` runs passes at several caps. Two passes make the same decisions up to the first
item one of them holds back, so `LptRun` keeps snapshots of its first pass's state and resumes every
later pass from the last snapshot before that item: exactly the result of a full pass, without redoing
the shared prefix.

The state of a pass is an `LptState` of arrays (kernels write into them); its scalar counters live in
`ints`, indexed by the I_* constants, so a snapshot is a plain copy of every array.

Encoder capacities. Besides tokens, a micro-batch may have K encoder capacities (image patches, video
patches, audio frames: whatever the encoders' memory limits), each item a load in each (`loads` [n, K]).
An item fits a micro-batch only where its tokens and all its loads do. K = 0 is the text-only path;
every kernel loops over the K capacities, so one code path serves any K.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from plait.jit import jit

from . import tuning
from .capacities import best_fit_loads, capacities, lacking, need, no_loads
from .heaps import pop, push, sift_down
from .ordering import radix_sort

# The items of a step, in placement order: urgent (bool: never held back by the cap), lengths, costs,
# loads (int64 [n, K]: each item's load in each encoder capacity; K = 0: tokens only - every kernel then
# runs its text-only path, bit for bit the one it ran before encoder capacities existed).
PlacementItems = namedtuple("PlacementItems", "urgent lengths costs loads")
# The name the on-disk numba caches of earlier versions pickled (they fail to load, not recompile, without it)
Items = PlacementItems


# The state of an LPT pass, all arrays. rank, micro [n]: the item's place (-1: none yet). rank_cost [R],
# micro_cost [R, W], room [R, W] (tokens left). best [R]: each rank's largest hole. heap: ranks with room
# for the current item, by (cost, id); full: ranks too full for it, by (neg_best, id) - largest hole
# first; the rounds reuse heap / neg_best as their order / sort keys. ints: the counters (I_*).
# first_over [1]: the cost the first held-back item would have lifted its rank to (0.0: none yet).
# The encoder capacities (K of them, caps as `capacities` gives them): proom [R, W, K] (load room left),
# pbest [K, R] (each rank's largest hole in load k), neg_pbest [K, R], pfull [K, R]: per capacity, the
# ranks too full in it for the current item (largest hole first; ints[I_PFULL_N + k] of them), fit [R]:
# max over the rank's micro-batches of min(room * weights[0], proom[k] * weights[1 + k] over k) (an item
# fits *every* rank when max(L * weights[0], loads[k] * weights[1 + k]) <= min(fit): the rounds' test),
# stash [R]: scratch for ranks passed over by one item.
LptState = namedtuple("LptState", "rank micro rank_cost micro_cost room best neg_best heap full ints first_over "
                                  "proom pbest neg_pbest pfull fit stash")
I_HEAP_N = 0  # ranks in heap[:n]
I_FULL_N = 1  # ranks in full[:n]
I_SKIPPED = 2  # items held back by the cap so far
I_PHASE = 3  # PHASE_*: where the pass is (see _lpt)
I_ROUNDS_RAN = 4  # 1 once a round ran (its sort overwrote the heaps, which must then be rebuilt)
I_PFULL_N = 5  # ints[I_PFULL_N + k]: ranks in pfull[k, :n]
N_INTS = 5  # ... plus one per encoder capacity
PHASE_HEAPS = 0
PHASE_ROUNDS = 1
PHASE_HEAPS_AGAIN = 2

# Snapshots of a pass: slot k holds the state's arrays (all but rank and micro, which a resumed pass
# copies from the first pass's result) before item at[k] (-1: not taken). Slots [0, K-1) are periodic,
# one per `every`-block of items; the last one is taken before the first held-back item. trig[i]: what
# item i would lift its rank's cost to (recorded until the first held-back item), from which a pass at
# a lower cap finds where it diverges.
Snapshots = namedtuple("Snapshots", "at rank_cost micro_cost room best neg_best heap full ints first_over "
                                      "proom pbest neg_pbest pfull fit trig")

# The outcome of a pass: the places, costs and room, how many items the cap held back, and first_over.
LptResult = namedtuple("LptResult", "rank micro rank_cost micro_cost room skipped first_over proom")


def fresh_state(n, R, W, caps) -> LptState:
    """The state of an LPT pass before its first item: nothing placed, every rank in the cost heap.
    caps: as `capacities` gives them."""
    capacity, load_capacity, weights = caps
    K = len(load_capacity)
    ints = np.zeros(N_INTS + K, dtype=np.int64)
    ints[I_HEAP_N] = R
    full_fit = capacity * weights[0]
    for k in range(K):
        full_fit = min(full_fit, load_capacity[k] * weights[1 + k])
    return LptState(np.full(n, -1, dtype=np.int32), np.full(n, -1, dtype=np.int32), np.zeros(R), np.zeros((R, W)),
                    np.full((R, W), capacity, dtype=np.int64), np.full(R, capacity, dtype=np.int64), np.zeros(R),
                    np.arange(R, dtype=np.int64), np.empty(R, dtype=np.int64), ints, np.zeros(1),
                    np.broadcast_to(load_capacity, (R, W, K)).copy(),
                    np.broadcast_to(load_capacity[:, None], (K, R)).copy(), np.zeros((K, R), dtype=np.int64),
                    np.empty((K, R), dtype=np.int64), np.full(R, full_fit), np.empty(R, dtype=np.int64))


def new_snapshots(S, n, R, W, K=0) -> Snapshots:
    """Room for S snapshots of a pass over n items with K encoder capacities (S = 0: a pass that takes
    none)."""
    return Snapshots(np.full(S, -1, dtype=np.int64), np.empty((S, R)), np.empty((S, R, W)),
                     np.empty((S, R, W), dtype=np.int64), np.empty((S, R), dtype=np.int64), np.empty((S, R)),
                     np.empty((S, R), dtype=np.int64), np.empty((S, R), dtype=np.int64),
                     np.empty((S, N_INTS + K), dtype=np.int64), np.empty((S, 1)),
                     np.empty((S, R, W, K), dtype=np.int64), np.empty((S, K, R), dtype=np.int64),
                     np.empty((S, K, R), dtype=np.int64), np.empty((S, K, R), dtype=np.int64), np.empty((S, R)),
                     np.full(n if S else 0, -np.inf))


def no_snapshots(K: int) -> Snapshots:
    """For a pass that takes none (every = 0: nothing is written)."""
    return new_snapshots(0, 0, 0, 0, K)


def result_of(st: LptState) -> LptResult:
    return LptResult(st.rank, st.micro, st.rank_cost, st.micro_cost, st.room, int(st.ints[I_SKIPPED]),
                     float(st.first_over[0]), st.proom)


class LptRun:
    """The first LPT pass, with snapshots of its state, and later passes at other caps resumed from them.

    Two passes make the same decisions until the first item that one cap holds back and the other does
    not: for a larger cap that is the first pass's first held-back item (a snapshot is taken right
    there); for a smaller cap it is the first item whose "rank cost + item cost" (recorded by the first
    pass while the slower heap had ranks) exceeds that cap. Resuming from the last snapshot before it
    gives exactly the result of a full pass, without redoing the shared prefix. Steps of fewer than
    tuning.SNAPSHOT_MIN items take no snapshots: every pass runs from the first item.
    """

    def __init__(self, urgent, lengths, costs, R, W, capacity, cap, loads=None, load_capacity=None):
        """loads int64 [n, K] and load_capacity [K]: the encoder capacities (None: tokens only)."""
        n = len(lengths)
        limited = loads is not None and load_capacity is not None
        self.items = PlacementItems(urgent, lengths, costs, loads if limited else no_loads(n))
        self.R, self.W = R, W
        self.caps = capacities(capacity, load_capacity if limited else None)
        self.K = len(self.caps[1])
        self.cap = float(cap)
        self.switch = round_start(urgent, costs, R)
        self.round_short = int(tuning.ROUND_SHORT)
        if n < tuning.SNAPSHOT_MIN:  # small steps: passes are cheap, snapshots and their bookkeeping are not
            self.snaps = None
            self.result = self.pass_from_scratch(self.cap)
            return
        every = max(1024, -(-n // tuning.SNAPSHOTS))
        K = n // every + 2  # periodic snapshots, then the one at the first held-back item
        self.snaps = new_snapshots(K, n, R, W, self.K)
        st = fresh_state(n, R, W, self.caps)
        _lpt(self.items, st, self.snaps, self.caps, self.cap, 0, self.switch, every, self.round_short)
        self.result = result_of(st)

    def rerun(self, cap: float) -> LptResult:
        """The result of a full pass at `cap`, resumed from the latest snapshot that all passes share."""
        cap = float(cap)
        n = len(self.items.lengths)
        if self.snaps is None:
            return self.pass_from_scratch(cap)
        at = self.snaps.at
        first_skip = int(at[-1])
        if n == 0 or (first_skip < 0 and cap >= self.cap):
            return LptResult(*(x.copy() if isinstance(x, np.ndarray) else x for x in self.result))
        limit = first_skip if first_skip >= 0 else n
        diverge = limit
        if cap < self.cap:
            over = np.flatnonzero(self.snaps.trig[:limit] > cap)
            if len(over):
                diverge = int(over[0])
        taken = at[:-1]
        if first_skip >= 0 and diverge == first_skip:
            k = len(at) - 1
        else:
            k = int(np.flatnonzero((taken >= 0) & (taken <= diverge))[-1])
        start = int(at[k])
        st = fresh_state(n, self.R, self.W, self.caps)
        st.rank[:start] = self.result.rank[:start]
        st.micro[:start] = self.result.micro[:start]
        for dst, snap in zip(st[2:], self.snaps[1:-1]):
            dst[...] = snap[k]
        none = self.snaps._replace(at=at[:0], trig=self.snaps.trig[:0])  # a resumed pass takes no snapshots
        _lpt(self.items, st, none, self.caps, cap, start, self.switch, 0, self.round_short)
        return result_of(st)

    def pass_from_scratch(self, cap: float) -> LptResult:
        """A whole pass at `cap` from the first item, without snapshots (one compiled call)."""
        n = len(self.items.lengths)
        st = fresh_state(n, self.R, self.W, self.caps)
        _lpt(self.items, st, no_snapshots(self.K), self.caps, float(cap), 0, self.switch, 0, self.round_short)
        return result_of(st)


def round_start(urgent, costs, R) -> int:
    """Index from which LPT places items in rounds instead of one heap operation each (see _lpt)."""
    n = len(costs)
    if R < tuning.ROUND_RANKS or n < tuning.ROUND_MIN * R:
        return n
    return _first_small(urgent, costs, R, float(tuning.ROUND_ITEM), tuning.ROUND_MIN * R)


@jit
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


@jit
def _snapshot(snaps, k, i, st):
    """Copy the state (counters included: write them to st.ints first) into slot k, before item i."""
    snaps.at[k] = i
    snaps.rank_cost[k] = st.rank_cost
    snaps.micro_cost[k] = st.micro_cost
    snaps.room[k] = st.room
    snaps.best[k] = st.best
    snaps.neg_best[k] = st.neg_best
    snaps.heap[k] = st.heap
    snaps.full[k] = st.full
    snaps.ints[k] = st.ints
    snaps.first_over[k] = st.first_over
    snaps.proom[k] = st.proom
    snaps.pbest[k] = st.pbest
    snaps.neg_pbest[k] = st.neg_pbest
    snaps.pfull[k] = st.pfull
    snaps.fit[k] = st.fit


@jit
def _lpt(items, st, snaps, caps, cap, start, switch, every, round_short):
    """LPT from item `start` on, from the state `st`, in up to three phases (st.ints[I_PHASE] says which):

    PHASE_HEAPS: items before `switch`: each to the least loaded rank with room (heap: ranks by cost;
       full: ranks too full for the current item, by largest hole);
    PHASE_ROUNDS: from `switch` on (many small items), while every rank still has room for the item: in
       rounds, ranks sorted by cost once a round and each taking the next item in turn (the least loaded
       the largest; a round holds only ranks LPT itself would serve in that order). The same choices as
       the heaps, at a fraction of a heap operation per item;
    PHASE_HEAPS_AGAIN: once some rank is too full: heaps again, rebuilt from the state (the least-loaded
       rank *with room* and the cap below need them).

    caps: (token capacity, load capacities [K], weights), see `capacities`. An item that would lift its rank past `cap`
    while some rank is too full for it is carried (skipped). With every > 0 the state is snapshotted at
    the first item of each `every`-block (at a round start in the round phase) and before the first
    skipped item (last slot), and snaps.trig[i] is recorded (see LptRun). Returns the number of skipped
    items.
    """
    n = len(items.lengths)
    R = st.rank_cost.shape[0]
    ints = st.ints
    i = start
    if ints[I_PHASE] == PHASE_HEAPS:
        i = _lpt_heap(items, st, snaps, caps, cap, i, min(switch, n), every)
        if i < n:
            ints[I_PHASE] = PHASE_ROUNDS  # the heaps stay as they are until a round runs (I_ROUNDS_RAN)
    if ints[I_PHASE] == PHASE_ROUNDS and i < n:
        i = _lpt_rounds(items, st, snaps, caps, i, every, round_short)
        if i < n:
            if ints[I_ROUNDS_RAN] == 1:
                # Rounds ran (their order overwrote the heaps). Every rank had room for every item they
                # placed, so the heaps' "too full" side would be empty here, all ranks in the cost heap:
                # rebuild exactly that; the heap loop then moves ranks that are too full for item i.
                hn = 0
                for r in range(R):
                    hn = push(st.heap, hn, st.rank_cost, r)
                ints[I_HEAP_N] = hn
                ints[I_FULL_N] = 0
                ints[I_PFULL_N:] = 0
            ints[I_PHASE] = PHASE_HEAPS_AGAIN
    if ints[I_PHASE] == PHASE_HEAPS_AGAIN and i < n:
        _lpt_heap(items, st, snaps, caps, cap, i, n, every)
    return ints[I_SKIPPED]


@jit
def _lpt_heap(items, st, snaps, caps, cap, start, stop, every):
    """The heap phases of _lpt over items [start, stop); returns stop.

    Encoder capacities (K > 0): a rank can take an item when one of its micro-batches has room for its
    tokens and all its loads. Ranks with too few tokens left anywhere wait in `full` (largest token hole
    first), ranks with too little of load k left anywhere in pfull[k] (largest hole in k first); each
    comes back as soon as an item small enough in that capacity arrives, to the cost heap if it lacks no
    other capacity for that item, else to wait under the first one it lacks.
    A rank in the cost heap may still have its rooms in different micro-batches: the top of the heap is
    then set aside (stash) until one that can take the item comes up, and the set-aside ranks go back
    afterwards. So the item goes to exactly the least-loaded rank that can take it, as with tokens alone.
    """
    urgent, lengths, costs, loads = items
    capacity, load_capacity, weights = caps
    K = loads.shape[1]
    W = st.micro_cost.shape[1]
    heap, full, rank_cost, best, neg_best, ints = st.heap, st.full, st.rank_cost, st.best, st.neg_best, st.ints
    pfull, pbest, neg_pbest, stash = st.pfull, st.pbest, st.neg_pbest, st.stash
    hn = ints[I_HEAP_N]
    fn = ints[I_FULL_N]
    skipped = ints[I_SKIPPED]
    first_over = st.first_over[0]
    last = len(snaps.at) - 1
    due = start if every > 0 else stop  # the next item that may start a snapshot block
    for i in range(start, stop):
        if i >= due:
            k = i // every
            if snaps.at[k] < 0:
                ints[I_HEAP_N] = hn
                ints[I_FULL_N] = fn
                ints[I_SKIPPED] = skipped
                st.first_over[0] = first_over
                _snapshot(snaps, k, i, st)
            due = (k + 1) * every
        L = lengths[i]
        while fn > 0 and best[full[0]] >= L:  # ranks that have room again for items this small
            r, fn = pop(full, fn, neg_best)
            hn = push(heap, hn, rank_cost, r)
        sn = 0
        m = -1
        waiting = 0  # ranks waiting in some pfull
        if K > 0:
            P = loads[i]
            for k in range(K):
                pn = ints[I_PFULL_N + k]
                while pn > 0 and pbest[k, pfull[k, 0]] >= P[k]:
                    r, pn = pop(pfull[k], pn, neg_pbest[k])
                    # Back in the cost heap only if it lacks no capacity now, else it waits under the
                    # first one it lacks (never k: it has room in k), so that `waiting` (and the cost cap it
                    # switches on) is the same in any order of the capacities.
                    lack = lacking(pbest, r, P)
                    if lack >= 0:
                        neg_pbest[lack, r] = -pbest[lack, r]
                        ints[I_PFULL_N + lack] = push(pfull[lack], ints[I_PFULL_N + lack], neg_pbest[lack], r)
                    else:
                        hn = push(heap, hn, rank_cost, r)
                ints[I_PFULL_N + k] = pn
            while hn > 0:
                r = heap[0]
                if best[r] < L:
                    r, hn = pop(heap, hn, rank_cost)
                    neg_best[r] = -best[r]
                    fn = push(full, fn, neg_best, r)
                    continue
                lack = lacking(pbest, r, P)
                if lack >= 0:
                    r, hn = pop(heap, hn, rank_cost)
                    neg_pbest[lack, r] = -pbest[lack, r]
                    ints[I_PFULL_N + lack] = push(pfull[lack], ints[I_PFULL_N + lack], neg_pbest[lack], r)
                    continue
                m = best_fit_loads(st.room, st.proom, r, L, P, weights)
                if m >= 0:
                    break
                r, hn = pop(heap, hn, rank_cost)  # room in every capacity, but not in one micro-batch
                stash[sn] = r
                sn += 1
            for k in range(K):
                waiting += ints[I_PFULL_N + k]
        else:
            while hn > 0 and best[heap[0]] < L:
                r, hn = pop(heap, hn, rank_cost)
                neg_best[r] = -best[r]
                fn = push(full, fn, neg_best, r)
        if hn == 0:
            if sn > 0:
                hn = _unstash(heap, hn, rank_cost, stash, sn)
            continue
        r = heap[0]
        if (fn > 0 or waiting > 0 or sn > 0) and not urgent[i]:
            v = rank_cost[r] + costs[i]
            if every > 0 and skipped == 0:
                snaps.trig[i] = v
            if v > cap:
                if sn > 0:
                    hn = _unstash(heap, hn, rank_cost, stash, sn)
                if skipped == 0:
                    first_over = v  # the plain pass's maximum reaches at least this
                    if every > 0:
                        ints[I_HEAP_N] = hn
                        ints[I_FULL_N] = fn
                        ints[I_SKIPPED] = 0
                        st.first_over[0] = 0.0  # a pass resumed here has not held anything back yet
                        _snapshot(snaps, last, i, st)
                skipped += 1
                continue  # the ranks with room would exceed the cap, others are full: carry it
        if K > 0:
            _put(st, i, r, m, L, costs[i])
            _put_loads(st, r, m, loads[i], weights)
        else:
            _put(st, i, r, _best_fit(st.room, r, W, L, capacity), L, costs[i])
        sift_down(heap, hn, rank_cost, 0)
        if sn > 0:
            hn = _unstash(heap, hn, rank_cost, stash, sn)
    ints[I_HEAP_N] = hn
    ints[I_FULL_N] = fn
    ints[I_SKIPPED] = skipped
    st.first_over[0] = first_over
    return stop


@jit
def _unstash(heap, hn, rank_cost, stash, sn):
    """The ranks set aside for one item back into the cost heap; returns its size."""
    for t in range(sn):
        hn = push(heap, hn, rank_cost, stash[t])
    return hn


@jit
def _best_fit(room, r, W, L, capacity):
    """Rank r's fullest micro-batch with room for L tokens."""
    m = -1
    mr = capacity + 1
    for j in range(W):
        if L <= room[r, j] < mr:
            mr = room[r, j]
            m = j
    return m


@jit
def _put(st, i, r, m, L, c):
    """Item i (L tokens, cost c) into micro-batch m of rank r; keeps best[r] (its largest hole) current;
    returns it. (With encoder capacities, _put_loads follows.)"""
    room, best = st.room, st.best
    was = room[r, m]
    st.rank[i] = r
    st.micro[i] = m
    st.rank_cost[r] += c
    st.micro_cost[r, m] += c
    room[r, m] -= L
    if was == best[r]:
        b = 0
        for j in range(room.shape[1]):
            if room[r, j] > b:
                b = room[r, j]
        best[r] = b
    return best[r]


@jit
def _put_loads(st, r, m, P, weights):
    """Loads P into micro-batch m of rank r (after _put): keeps pbest[:, r] and fit[r] current."""
    room, proom, pbest = st.room, st.proom, st.pbest
    W = proom.shape[1]
    for k in range(len(P)):
        was = proom[r, m, k]
        proom[r, m, k] -= P[k]
        if was == pbest[k, r]:
            b = 0
            for j in range(W):
                if proom[r, j, k] > b:
                    b = proom[r, j, k]
            pbest[k, r] = b
    f = 0.0
    for j in range(W):
        v = room[r, j] * weights[0]
        for k in range(len(P)):
            v = min(v, proom[r, j, k] * weights[1 + k])
        f = max(f, v)
    st.fit[r] = f


@jit
def _lpt_rounds(items, st, snaps, caps, start, every, round_short):
    """The round phase of _lpt, from item `start` until an item some rank has no room for, or until
    rounds get shorter than `round_short` ranks (returned; n if neither).

    A round sorts all ranks by (cost, id) into order[:k], k cut where LPT would serve a rank twice (see
    below). A round starting from the current costs is always LPT's choice, so nothing of a round is
    kept between calls or in snapshots: every call, and every pass resumed from a snapshot, starts a new
    one. ints[I_ROUNDS_RAN] says whether a round ever ran (the sort overwrites the heaps, which _lpt then
    rebuilds; until then the heap sizes and the heaps are the first heap phase's). Every rank has room
    for the item here, so the cap never carries anything in this phase, and the result is the heap
    phase's, only faster. With encoder capacities, "every rank has room" is tested on st.fit (a
    micro-batch whose weighed room is at least the item's weighed need in tokens and every load has room
    for it), which may hand over to the heaps early, never late.
    """
    lengths, costs, loads = items.lengths, items.costs, items.loads
    capacity, load_capacity, weights = caps
    K = loads.shape[1]
    R, W = st.micro_cost.shape
    rank_cost, best = st.rank_cost, st.best
    order, keys = st.heap, st.neg_best  # the round's order and its sort keys
    n = len(lengths)
    ptr = 0
    k = 0
    min_best = capacity
    for r in range(R):
        if best[r] < min_best:
            min_best = best[r]
    min_fit = 0.0
    if K > 0:
        min_fit = st.fit.min()
    for i in range(start, n):
        L = lengths[i]
        if min_best < L:
            return i
        if K > 0 and min_fit < need(L, loads[i], weights):
            return i
        if ptr >= k:
            # A new round, least loaded first.
            if every > 0 and snaps.at[i // every] < 0:
                _snapshot(snaps, i // every, i, st)
            for q in range(R):
                order[q] = q
                keys[q] = rank_cost[q]
            _sort_by_cost(order, keys, R)
            st.ints[I_ROUNDS_RAN] = 1
            # The j-th rank of the round takes item i + j. LPT would give it to that rank too if the rank
            # costs less than every rank served before it in the round does afterwards; those cost at
            # least rank_cost[order[0]] + costs[i + j] (items do not get costlier), so the round stops
            # at the first rank that is not strictly below that: the rounds make exactly LPT's choices.
            base = rank_cost[order[0]]
            k = 1
            while k < R and i + k < n and rank_cost[order[k]] < base + costs[i + k]:
                k += 1
            ptr = 0
            if k < round_short and i + k < n:
                # Rounds this short (items that cost next to nothing against the spread of rank costs)
                # would sort all ranks for a few items: the heaps take over, with the same choices.
                return i
        r = order[ptr]
        if K > 0:
            m = best_fit_loads(st.room, st.proom, r, L, loads[i], weights)
            b = _put(st, i, r, m, L, costs[i])
            _put_loads(st, r, m, loads[i], weights)
            if st.fit[r] < min_fit:
                min_fit = st.fit[r]
        else:
            b = _put(st, i, r, _best_fit(st.room, r, W, L, capacity), L, costs[i])
        if b < min_best:
            min_best = b
        ptr += 1
    return n


@jit
def _sort_by_cost(order, keys, k):
    """Sort order[:k] by keys[:k] (non-negative costs), stably, on the costs' bit patterns."""
    _, idx = radix_sort(keys[:k].view(np.int64).copy(), order[:k].copy(), 0x7FFFFFFFFFFFFFFF, 8)
    for t in range(k):
        order[t] = idx[t]
