"""Stage 5 (equal mode): rebalance between ranks by swapping micro-batches, exchanging items and carrying.

In equal mode every rank runs the same number of micro-batches, so when tokens bind (128k micro-batches
full of tokens, a long chunk costing several micro-batches of short documents) LPT alone leaves ranks
that differ by whole long chunks. `assign` runs this stage when the step still certifies worse than
1 + RECAP_ABOVE:

1. Swaps. Any two micro-batches fit anywhere (each is within capacity), so swapping them between ranks
   keeps capacity: the costliest rank repeatedly swaps one with one of the lightest ranks while that
   lowers the pair's maximum.
2. Item exchange. Items move between a micro-batch of the costliest rank and one of the lightest: long
   documents cost more per token, so the light side takes long ones and gives back as many tokens of
   short ones. Then the swaps run again.
3. Carry. The costliest long item of the costliest rank is carried to the next step, one at a time with
   swaps after each, up to REBALANCE_TOKENS of the step's tokens, keeping the best state seen. Never an
   urgent item: nothing waits more than a step for this.

The micro-batches are handled as groups g = rank * W + slot of the packing stage 4 left; a `Board` says
where each group sits now.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from plait.jit import jit

from . import tuning
from .heaps import before

# Where the micro-batch groups sit: mc[g] its cost, owner[g] its rank, slots[r, k] the group in rank r's
# k-th slot, rank_cost[r] the sum of its groups' costs.
Board = namedtuple("Board", "mc owner slots rank_cost")

# The items of each group, for the item exchange: item_g[i] the group of item i (-1: not placed);
# head[g] / nxt[i] a linked list of g's items in placement order (decreasing cost); mtok[g] its tokens.
# pool, side: scratch for the split of one pair of groups (the pooled items, and the side each goes to).
# mload[g]: its encoder loads [K] (K = 0: none); bload: scratch [K] for the light side's loads of a split.
Members = namedtuple("Members", "item_g head nxt mtok pool side mload bload")


def rebalance(items, rank_s, micro_s, micro_cost, rooms, caps, carry_budget):
    """Stage 5 on the items (lpt.PlacementItems, in placement order) as placed by stages 2-4: swaps, item
    exchange, carrying at most carry_budget tokens. rooms: (token room [R, W], load room [R, W, K]),
    caps: as capacities.capacities gives them; whole micro-batches keep their rooms when they swap, an
    item moves only where its tokens and every load fit. Modifies rank_s, micro_s (-1 for carried items),
    micro_cost and the rooms in place (the micro-batches in their new slots); returns the rank costs."""
    room, proom = rooms
    capacity = caps[0]
    K = items.loads.shape[1]
    Cs = items.costs
    R, W = micro_cost.shape
    G = R * W
    board = Board(micro_cost.ravel().copy(), np.repeat(np.arange(R, dtype=np.int64), W),
                  np.arange(G, dtype=np.int64).reshape(R, W), micro_cost.sum(axis=1))
    max_iter = 4 * R + 16
    swap_scan = int(tuning.SWAP_SCAN)
    refine_swaps(board, max_iter, swap_scan)
    total = float(Cs[rank_s >= 0].sum())
    if _ratio(board.rank_cost, total, float(Cs.max(initial=0.0)), R) > 1.0 + tuning.RECAP_ABOVE:
        _exchange_items(items, rank_s, micro_s, rooms, caps, board, max_iter, swap_scan)
    board, gone = _carry_long(items, rank_s, micro_s, board, capacity, carry_budget, max_iter, swap_scan)
    if len(gone):
        gone = np.array(gone, dtype=np.int64)
        g = rank_s[gone].astype(np.int64) * W + micro_s[gone]
        room_flat = room.ravel()
        np.add.at(room_flat, g, items.lengths[gone])
        room[:] = room_flat.reshape(R, W)
        if K:
            proom_flat = proom.reshape(G, K)
            np.add.at(proom_flat, g, items.loads[gone])
            proom[:] = proom_flat.reshape(R, W, K)
        rank_s[gone] = -1
        micro_s[gone] = -1
    pos = np.empty(G, dtype=np.int64)
    pos[board.slots.ravel()] = np.tile(np.arange(W, dtype=np.int64), R)
    room_new = room.ravel()[board.slots]
    if K:
        proom[:] = proom.reshape(G, K)[board.slots]
    # Exact costs from the items (no drift from incremental updates).
    mc_new = np.zeros(G)
    _move_groups(rank_s, micro_s, board.owner, pos, W, Cs, mc_new)
    micro_cost[:] = mc_new.reshape(R, W)
    room[:] = room_new
    return micro_cost.sum(axis=1)


def _ratio(rank_cost, total, cmax, R) -> float:
    """max(rank cost) / LB, LB = max(total / R, cmax) from the placed items' total and largest cost."""
    lb = max(total / R, cmax)
    return float(rank_cost.max()) / lb if lb > 0 else 1.0


def _copy(board: Board) -> Board:
    return Board(*(x.copy() for x in board))


def _exchange_items(items, rank_s, micro_s, rooms, caps, board, max_iter, swap_scan):
    """Step 2: item exchanges between the costliest and the lightest ranks, then swaps again (if any
    exchange happened). Updates rank_s, micro_s (groups), the rooms and the board."""
    room, proom = rooms
    capacity, load_capacity = caps[0], caps[1]
    n = len(items.lengths)
    R, W = board.slots.shape
    K = items.loads.shape[1]
    item_g = _item_group(rank_s, micro_s, W)
    members = Members(item_g, np.full(R * W, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64),
                      capacity - room.ravel().copy(), np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int8),
                      load_capacity - proom.reshape(R * W, K), np.zeros(K, dtype=np.int64))
    _item_lists(item_g, members.head, members.nxt)
    if _exchange(items.lengths, items.costs, items.loads, board, members, caps, max_iter):
        _from_group(item_g, W, rank_s, micro_s)
        room.ravel()[:] = capacity - members.mtok
        if K:
            proom[:] = (load_capacity - members.mload).reshape(R, W, K)
        refine_swaps(board, max_iter, swap_scan)


def _carry_long(items, rank_s, micro_s, board, capacity, carry_budget, max_iter, swap_scan):
    """Step 3: carry the costliest long item of the costliest rank, one at a time (swaps after each),
    while the budget lasts and it helps. Returns the best board seen and the items carried to reach it
    (the board before any carry and [] if none helped); rank_s and micro_s are left as they are."""
    urgent, Ls, Cs = items.urgent, items.lengths, items.costs
    R, W = board.slots.shape
    cmax_u, first_rest = _placed_stats(rank_s, Cs, urgent)
    total = float(Cs[rank_s >= 0].sum())
    cmax = max(cmax_u, float(Cs[first_rest]) if first_rest >= 0 else 0.0)
    # Candidates to carry, costliest first: items of at least half a micro-batch (the long chunks whose
    # count is what cannot be split evenly over ranks).
    pl_idx, after_long = _long_items(rank_s, urgent, Ls, capacity)
    best_r = _ratio(board.rank_cost, total, cmax, R)
    best, best_n = _copy(board), 0
    removed = []
    # The costliest ranks typically hold one long item more than the rest: all of them must give one up
    # before the maximum drops, so the search goes on for a while without progress before it stops.
    affordable = int(np.searchsorted(np.cumsum(Ls[pl_idx][::-1]), carry_budget, side="right"))
    patience = max(tuning.CARRY_PATIENCE, affordable // 8)
    if not (best_r > 1.0 + tuning.RECAP_ABOVE and carry_budget > 0 and affordable > 0):
        return best, []
    mc, owner, rc = board.mc, board.owner, board.rank_cost
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
        refine_swaps(board, max_iter, swap_scan)
        r_now = _ratio(rc, total, cmax, R)
        if r_now < best_r * (1.0 - 1e-9):
            best_r = r_now
            best, best_n = _copy(board), len(removed)
            if r_now <= 1.0 + tuning.RECAP_ABOVE:
                break
        elif len(removed) - best_n >= patience:
            break
    if best_n:
        best = _copy(best)
        refine_swaps(best, max_iter, swap_scan)
    return best, removed[:best_n]


@jit
def refine_swaps(board, max_iter, swap_scan):
    """Pairwise swaps of whole micro-batches between ranks (any two fit anywhere: each is <= capacity).

    Each iteration takes the costliest rank p (ties: highest id) and the swap with any of the
    `swap_scan` lightest other ranks that lowers max(cost p, cost q) the most; stops when no swap lowers
    the costliest rank (or after max_iter swaps; returns how many ran). Ranks are kept sorted by
    (cost, id): a swap with q cannot end below (top + cost q) / 2, so the scan from the lightest rank
    stops early."""
    mc, owner, slots, rank_cost = board
    R, W = slots.shape
    order = np.argsort(rank_cost, kind="mergesort")
    for it in range(max_iter):
        p = order[R - 1]
        top = rank_cost[p]
        best = top * (1.0 - 1e-12)
        bq = -1
        ba = -1
        bb = -1
        for t in range(min(R - 1, swap_scan)):
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
            while j > 0 and before(rank_cost, r, order[j - 1]):
                order[j] = order[j - 1]
                j -= 1
            order[j] = r
            k += 1
    return max_iter


@jit
def _exchange(lengths, costs, loads, board, members, caps, max_iter):
    """Item exchanges between a micro-batch of the costliest rank and one of the lightest rank.

    When every micro-batch is full of tokens, cost can still move between ranks: long documents cost more
    per token than short ones, so the light rank's micro-batch takes long documents and gives back as
    many tokens of short ones. The pooled items of the two micro-batches are split again (_split_pair).
    Returns how many exchanges ran."""
    capacity, load_capacity = caps[0], caps[1]
    K = loads.shape[1]
    mc, slots, rank_cost = board.mc, board.slots, board.rank_cost
    item_g, head, nxt, mtok, pool, side, mload = members.item_g, members.head, members.nxt, members.mtok, \
        members.pool, members.side, members.mload
    R, W = slots.shape
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
                if K:
                    k, ptok, btok, bc = _split_pair_loads(members, ga, gb, lengths, costs, loads, caps, target)
                    if ptok - btok > capacity or not _split_fits(members, ga, gb, k, loads, load_capacity):
                        continue
                else:
                    k, ptok, btok, bc = _split_pair(members, ga, gb, lengths, costs, capacity, target)
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
        if K:
            k, ptok, btok, bc = _split_pair_loads(members, ga, gb, lengths, costs, loads, caps, target)
        else:
            k, ptok, btok, bc = _split_pair(members, ga, gb, lengths, costs, capacity, target)
        ac = 0.0
        atok = 0
        for u in range(K):  # the pair's loads are recounted from the items of each side
            mload[ga, u] = 0
            mload[gb, u] = 0
        la = -1
        lb = -1
        head[ga] = -1
        head[gb] = -1
        for j in range(k):
            i = pool[j]
            nxt[i] = -1
            g_side = gb if side[j] == 1 else ga
            for u in range(K):
                mload[g_side, u] += loads[i, u]
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


@jit
def _split_fits(members, ga, gb, k, loads, load_capacity):
    """Whether both sides of the split in members.side (k pooled items) are within every load capacity."""
    for q in range(loads.shape[1]):
        bp = 0
        for j in range(k):
            if members.side[j] == 1:
                bp += loads[members.pool[j], q]
        if bp > load_capacity[q] or members.mload[ga, q] + members.mload[gb, q] - bp > load_capacity[q]:
            return False
    return True


@jit
def _split_pair(members, ga, gb, lengths, costs, capacity, target):
    """Pool the items of micro-batches ga and gb (in placement order) into members.pool and split them
    again (members.side): longest first onto the light side (side 1) while its cost stays within
    `target`, then the shortest onto it until the heavy side fits. Returns (pooled count, pooled tokens,
    light-side tokens, light-side cost)."""
    k, ptok = _pool(members, ga, gb)
    pool, side = members.pool, members.side
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


@jit
def _split_pair_loads(members, ga, gb, lengths, costs, loads, caps, target):
    """_split_pair with encoder loads: the light side takes an item only where its loads fit too (the
    heavy side is checked by _split_fits)."""
    capacity, load_capacity = caps[0], caps[1]
    k, ptok = _pool(members, ga, gb)
    pool, side, bp = members.pool, members.side, members.bload
    bp[:] = 0
    btok = 0
    bc = 0.0
    for j in range(k):
        i = pool[j]
        side[j] = 0
        if btok + lengths[i] <= capacity and bc + costs[i] <= target and _light_fits(bp, loads[i], load_capacity):
            side[j] = 1
            btok += lengths[i]
            bp += loads[i]
            bc += costs[i]
    j = k - 1
    while ptok - btok > capacity and j >= 0:
        i = pool[j]
        if side[j] == 0 and btok + lengths[i] <= capacity and _light_fits(bp, loads[i], load_capacity):
            side[j] = 1
            btok += lengths[i]
            bp += loads[i]
            bc += costs[i]
        j -= 1
    return k, ptok, btok, bc


@jit
def _light_fits(held, P, load_capacity):
    """Whether loads P still fit beside `held` within every load capacity."""
    for q in range(len(P)):
        if held[q] + P[q] > load_capacity[q]:
            return False
    return True


@jit
def _pool(members, ga, gb):
    """The items of micro-batches ga and gb merged in placement order into members.pool; returns their
    count and tokens."""
    head, nxt, mtok, pool = members.head, members.nxt, members.mtok, members.pool
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
    return k, mtok[ga] + mtok[gb]


@jit
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


@jit
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


@jit
def _item_group(rank, micro, W):
    g = np.full(len(rank), -1, dtype=np.int64)
    for i in range(len(rank)):
        if rank[i] >= 0:
            g[i] = rank[i] * W + micro[i]
    return g


@jit
def _from_group(g, W, rank, micro):
    for i in range(len(g)):
        if g[i] >= 0:
            rank[i] = g[i] // W
            micro[i] = g[i] % W


@jit
def _item_lists(item_g, head, nxt):
    """Linked lists of each micro-batch's items in increasing index (placement) order."""
    for i in range(len(item_g) - 1, -1, -1):
        g = item_g[i]
        if g >= 0:
            nxt[i] = head[g]
            head[g] = i


@jit
def _move_groups(rank, micro, owner, pos, W, costs, mc):
    """Micro-batch g = rank * W + micro now sits at (owner[g], pos[g]); mc: the costs per new slot."""
    for i in range(len(rank)):
        if rank[i] >= 0:
            g = rank[i] * W + micro[i]
            rank[i] = owner[g]
            micro[i] = pos[g]
            mc[rank[i] * W + micro[i]] += costs[i]
