"""Stage 4, micro-batches inside each rank, and stage 6, their order.

Stage 4 re-packs each rank's items cost-first onto its least costly micro-batch with room: LPT (stage 2)
packed them best-fit, which fills micro-batches unevenly, and balanced micro-batch costs shorten
pipeline bubbles. In variable mode it also drops a rank's unused micro-batches (`counts`).

Stage 6 orders each rank's micro-batches heaviest in the middle: pipeline parallelism's warm-up and
cool-down phases then run the light ones.
"""

from __future__ import annotations

import numpy as np

from plait.jit import jit

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
    middle_heavy(micro_cost, np.asarray(counts, dtype=np.int64), new_pos)
    return new_pos


@jit
def middle_heavy(micro_cost, counts, new_pos):
    """The kernel of middle_heavy_order, into new_pos."""
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


@jit
def pack_micro(items, rank, micro, micro_cost, rooms, caps, compact, counts):
    """Re-pack each rank's items cost-first onto its least costly micro-batch with room.

    Items come in placement order (decreasing cost). With `compact` (variable mode) a rank keeps only
    as many micro-batches as its best-fit packing used, moved to the front; counts[r] says how many.
    Two attempts per rank: every item cost-first onto the least costly micro-batch with room; or only
    the large ones (over capacity / 8) cost-first and the small ones best-fit into the holes (when
    tokens are tight the first may not fit everything). The most even one that fits wins, if it lowers
    the rank's heaviest micro-batch; otherwise the best-fit packing stays. All ranks are re-packed in
    one pass over the items in placement order (each rank sees its own items in that order), so no
    per-rank item lists are built. rooms: (token room [R, W], load room [R, W, K]), caps: as
    capacities.capacities gives them: an item needs room for its tokens and every load, and is small
    only if all of them are. Modifies micro, micro_cost, the rooms and counts.
    """
    lengths, costs, loads = items.lengths, items.costs, items.loads
    room, proom = rooms
    capacity, load_capacity = caps[0], caps[1]
    K = loads.shape[1]
    R, W = room.shape
    n = len(lengths)
    use = np.full(R, W, dtype=np.int64)
    if compact:
        _compact(rank, micro, micro_cost, rooms, caps, use)
        for r in range(R):
            counts[r] = use[r]
    c2 = np.zeros((2, R, W))
    room2 = np.full((2, R, W), capacity, dtype=np.int64)
    proom2 = np.empty((2, R, W, K), dtype=np.int64)
    for k in range(K):
        proom2[:, :, :, k] = load_capacity[k]
    ok = np.ones((2, R), dtype=np.bool_)
    out = np.empty((2, n), dtype=np.int16)  # micro-batch slots (< 32768): half the fresh pages of int32
    small = (0, capacity // 8)
    for i in range(n):
        r = rank[i]
        if r < 0:
            continue
        L = lengths[i]
        P = loads[i]
        for at in range(2):
            if not ok[at, r]:
                continue
            m = -1
            if L > small[at] or _big_load(P, load_capacity, at):
                for j in range(use[r]):
                    if room2[at, r, j] >= L and (m < 0 or c2[at, r, j] < c2[at, r, m]):
                        if _loads_fit(proom2[at, r, j], P):
                            m = j
            else:
                for j in range(use[r]):
                    if room2[at, r, j] >= L and (m < 0 or room2[at, r, j] < room2[at, r, m]):
                        if _loads_fit(proom2[at, r, j], P):
                            m = j
            if m < 0:
                ok[at, r] = False
                continue
            c2[at, r, m] += costs[i]
            room2[at, r, m] -= L
            for k in range(K):
                proom2[at, r, m, k] -= P[k]
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
                proom[r, j] = proom2[best_at[r], r, j]
    for i in range(n):
        r = rank[i]
        if r >= 0 and best_at[r] >= 0:
            micro[i] = out[best_at[r], i]


@jit
def _compact(rank, micro, micro_cost, rooms, caps, use):
    """Variable mode: move each rank's used micro-batches to the front (in order); use[r] = how many
    (at least 1)."""
    room, proom = rooms
    capacity, load_capacity = caps[0], caps[1]
    R, W = room.shape
    slot = np.empty((R, W), dtype=np.int64)
    c_tmp = np.empty(W)
    r_tmp = np.empty(W, dtype=np.int64)
    p_tmp = np.empty((W, proom.shape[2]), dtype=np.int64)
    for r in range(R):
        k = 0
        for j in range(W):
            if room[r, j] < capacity or _loads_used(proom[r, j], load_capacity):
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
            p_tmp[slot[r, j]] = proom[r, j]
        for j in range(W):
            micro_cost[r, j] = c_tmp[j]
            room[r, j] = r_tmp[j]
            proom[r, j] = p_tmp[j]
        use[r] = max(used, 1)
    for i in range(len(rank)):
        if rank[i] >= 0:
            micro[i] = slot[rank[i], micro[i]]


@jit
def _big_load(P, load_capacity, at):
    """Whether loads P make an item large in attempt `at` of pack_micro (0: every item; 1: over capacity / 8
    in some load)."""
    for k in range(len(P)):
        if P[k] > (load_capacity[k] // 8 if at == 1 else -1):
            return True
    return False


@jit
def _loads_fit(room, P):
    """Whether a micro-batch's load room [K] holds loads P."""
    for k in range(len(P)):
        if room[k] < P[k]:
            return False
    return True


@jit
def _loads_used(room, load_capacity):
    """Whether a micro-batch holds some load (its room below capacity in some encoder capacity)."""
    for k in range(len(room)):
        if room[k] < load_capacity[k]:
            return True
    return False
