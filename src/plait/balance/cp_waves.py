"""Dynamic CP, stage 2: group micro-batches placed in waves over the pool of ranks (docs/long-context.md).

A step is a grid of pool ranks x waves; each (rank, wave) slot holds at most `slot` tokens. A group of k
ranks runs one micro-batch of at most k * slot tokens in one wave, every document in it sharded over the
k members (each padded to a multiple of 2k); a group of one holds whole documents, as today. Every rank
runs exactly one micro-batch per wave, so every rank has the same number of waves.

1. **Bins** (`_pack_bins`): the documents of degree k > 1 (cp_degrees.py), by degree then cost, first-fit
   into group micro-batches of their degree: at most k * slot tokens, and at most a mean rank's cost per
   member (two long documents in one group would make its members the slowest ranks).
2. **Blocks** (`_place_bins`): each group micro-batch, costliest first, onto the free block of k ranks in
   some wave whose members carry the least so far (pow2: aligned blocks, first % k == 0; contiguous: any
   run), the communication term included (a block across nodes pays the inter-node bandwidth). When no
   wave has a free block, a wave is added (at most `max_waves`); what still finds none is carried.
3. **Fill** (`_fill`): the remaining documents, urgent first then by decreasing cost (LPT), each where it
   raises the slowest rank it touches least: a rank's free slot (best fit among its waves), or an
   existing group micro-batch with room (sharded over it: its members each carry c / k plus the traffic,
   allowed only while the traffic adds at most MAX_SHARD_OVERHEAD to the document's work: sharding short
   documents over a group across nodes would lower the slowest rank a little and multiply the work).
   Tokens bind (a step draws as many tokens as its slots hold), so the fill is capped, as the balancer's
   stage 3: a document that would push a rank above (1 + slack) x the lower bound is carried to the next
   step (first there) -- the first slack of CAP_SLACKS that carries at most MAX_CARRY of the step's tokens
   is kept (the last one is uncapped). What fits nowhere is carried too.

Rank totals are the step cost each rank carries over all waves: compute / k plus the CP traffic (cost.py's
CommCost, passed in as a `CommTable` of per-degree coefficients). Deterministic: fixed orders, ties to
the lower index.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plait.jit import jit

from .cp_degrees import CommTable, CPLayout, padded_lengths

MAX_SHARD_OVERHEAD = 0.25  # traffic / compute of a document sharded into a group by the fill
CAP_SLACKS = (0.02, 0.06, np.inf)  # the fill's cost caps over the lower bound, tried in order
MAX_CARRY = 0.04  # share of the step's tokens a capped fill may carry


@dataclass
class WaveAssignment:
    item_group: np.ndarray  # [n] group id of each item, -1: carried
    wave: np.ndarray  # [G] the groups, sorted by (wave, first rank)
    first: np.ndarray
    size: np.ndarray
    comm: np.ndarray  # [G] traffic each member carries
    group_tokens: np.ndarray  # [G] tokens of the group micro-batch, padding included
    rank_cost: np.ndarray  # [P] compute + traffic per rank over the step
    micro_cost: np.ndarray  # [P, W]
    micro_tokens: np.ndarray  # [P, W] tokens per rank and wave (its shard, padding included)
    degrees: np.ndarray  # [n] each item's degree (its group's size where placed)
    padding: int  # pad tokens of the placed items (documents padded to multiples of 2k)

    @property
    def waves(self) -> int:
        return int(self.micro_cost.shape[1])


@jit
def _pack_bins(order, padded, costs, degrees, slot, cost_cap):
    n = len(order)
    bin_of = np.full(len(padded), -1, np.int64)
    size = np.empty(n, np.int64)
    tokens = np.empty(n, np.int64)
    cost = np.empty(n)
    nb, start, current = 0, 0, -1
    for t in range(n):
        i = order[t]
        k = degrees[i]
        if k != current:
            current, start = k, nb
        share = costs[i] / k
        chosen = -1
        for b in range(start, nb):
            if tokens[b] + padded[i] <= k * slot and cost[b] + share <= cost_cap:
                chosen = b
                break
        if chosen < 0:
            chosen = nb
            size[nb], tokens[nb], cost[nb] = k, 0, 0.0
            nb += 1
        tokens[chosen] += padded[i]
        cost[chosen] += share
        bin_of[i] = chosen
    return bin_of, size[:nb].copy(), tokens[:nb].copy(), cost[:nb].copy()


@jit
def _best_block(k, tokens, cost, w, grid, comm):
    """(score, first rank, traffic) of the best free block of k ranks in wave w; first -1: none.
    grid: (occ [P, W] group or -1, total [P], aligned); comm: (slope_in, slope_out, intercept, per node)."""
    occ, total, aligned = grid
    slope_in, slope_out, intercept, rpn = comm
    pool = occ.shape[0]
    best, best_s, best_c = np.inf, -1, 0.0
    step = k if aligned else 1
    s = 0
    while s + k <= pool:
        free = True
        top = -np.inf
        for r in range(s, s + k):
            if occ[r, w] >= 0:
                free = False
                break
            if total[r] > top:
                top = total[r]
        if free:
            cross = (s // rpn) != ((s + k - 1) // rpn)
            c = (slope_out[k] if cross else slope_in[k]) * tokens + intercept[k]
            score = top + cost + c
            if score < best:
                best, best_s, best_c = score, s, c
        s += step
    return best, best_s, best_c


@jit
def _place_bins(bin_order, bins, waves, max_waves, grid, comm):
    """Each bin (size, tokens, cost per member) onto its best free block (module docstring, 2.)."""
    size, tokens, cost = bins
    occ, total, aligned = grid
    slope_in, slope_out, intercept, rpn = comm
    nb = len(size)
    first = np.full(nb, -1, np.int64)
    wave = np.full(nb, -1, np.int64)
    traffic = np.zeros(nb)
    slope = np.zeros(nb)
    W = waves
    for t in range(nb):
        b = bin_order[t]
        k = size[b]
        best, bs, bw, bc = np.inf, -1, -1, 0.0
        for w in range(W):
            score, s, c = _best_block(k, tokens[b], cost[b], w, grid, comm)
            if s >= 0 and score < best:
                best, bs, bw, bc = score, s, w, c
        if bs < 0 and W < max_waves:
            score, s, c = _best_block(k, tokens[b], cost[b], W, grid, comm)
            if s >= 0:
                bs, bw, bc = s, W, c
                W += 1
        if bs < 0:
            continue
        cross = (bs // rpn) != ((bs + k - 1) // rpn)
        slope[b] = slope_out[k] if cross else slope_in[k]
        first[b], wave[b], traffic[b] = bs, bw, bc
        for r in range(bs, bs + k):
            occ[r, bw] = b
            total[r] += cost[b] + bc
    return W, first, wave, traffic, slope


@jit
def _room(r, slot, occ, slot_tokens):
    room = -1
    for w in range(occ.shape[1]):
        if occ[r, w] < 0 and slot - slot_tokens[r, w] > room:
            room = slot - slot_tokens[r, w]
    return room


@jit
def _raise_tops(r, value, occ, top):
    """Rank r's total grew to `value`: the bins it belongs to (one per wave at most) see it."""
    for w in range(occ.shape[1]):
        b = occ[r, w]
        if b >= 0 and value > top[b]:
            top[b] = value


@jit
def _lowest(first, top):
    """The lowest top of the placed bins (inf: none); tops only grow, so an old value stays a lower bound."""
    low = np.inf
    for b in range(len(first)):
        if first[b] >= 0 and top[b] < low:
            low = top[b]
    return low


@jit
def _fill(docs, limit, slot, occ, groups, state):
    """The remaining documents, LPT (module docstring, 3.). docs: (order, lengths, costs, urgent); groups:
    (first, size, slope) of the placed bins; state, changed: (tokens, cost and traffic per member of each
    bin, rank totals, slot tokens and cost [P, W], each item's bin, rank and wave)."""
    order, lengths, costs, urgent, whole = docs
    first, size, slope = groups
    tokens, bin_cost, traffic, total, slot_tokens, slot_cost, item_bin, item_rank, item_wave = state
    pool, W = occ.shape
    nb = len(first)
    room = np.empty(pool, np.int64)
    for r in range(pool):
        room[r] = _room(r, slot, occ, slot_tokens)
    top = np.full(nb, -np.inf)  # each placed bin's slowest member (totals only grow: kept by max)
    for b in range(nb):
        for r in range(first[b], first[b] + size[b] if first[b] >= 0 else first[b]):
            top[b] = max(top[b], total[r])
    lowest = _lowest(first, top)  # no bin's option is below its top: while a rank's is, the bins are skipped
    for t in range(len(order)):
        i = order[t]
        L, c = lengths[i], costs[i]
        best, kind, target, target_pad = np.inf, -1, -1, 0
        cap = np.inf if urgent[i] else limit
        for r in range(pool):
            if room[r] >= L and total[r] + c < best and total[r] + c <= cap:
                best, kind, target = total[r] + c, 0, r
        if best > lowest:
            lowest = _lowest(first, top)
        for b in range(nb if best > lowest and not whole[i] else 0):  # a whole (media) document: one rank
            if first[b] < 0:
                continue
            k = size[b]
            p = (L + 2 * k - 1) // (2 * k) * (2 * k)
            if tokens[b] + p > k * slot or k * slope[b] * p > MAX_SHARD_OVERHEAD * c:
                continue
            v = top[b] + c / k + slope[b] * p
            if v < best and v <= cap:
                best, kind, target, target_pad = v, 1, b, p
        if kind == 0:
            r = target
            w_best, w_room = -1, slot + 1
            for w in range(W):  # best fit: the fullest of the rank's slots that takes it
                left = slot - slot_tokens[r, w]
                if occ[r, w] < 0 and L <= left < w_room:
                    w_best, w_room = w, left
            slot_tokens[r, w_best] += L
            slot_cost[r, w_best] += c
            total[r] += c
            room[r] = _room(r, slot, occ, slot_tokens)
            item_rank[i], item_wave[i] = r, w_best
            _raise_tops(r, total[r], occ, top)
        elif kind == 1:
            b = target
            k = size[b]
            extra = slope[b] * target_pad
            tokens[b] += target_pad
            bin_cost[b] += c / k
            traffic[b] += extra
            for r in range(first[b], first[b] + k):
                total[r] += c / k + extra
                _raise_tops(r, total[r], occ, top)
            item_bin[i] = b


def place_waves(lengths: np.ndarray, costs: np.ndarray, degrees: np.ndarray, layout: CPLayout, comm: CommTable, *,
                bound: float, priority: np.ndarray | None = None, slacks: tuple = CAP_SLACKS,
                whole: np.ndarray | None = None) -> WaveAssignment:
    """Place a step's documents in `layout.waves` waves or a few more (module docstring; at most 2 x waves,
    at least one more). `degrees` from cp_degrees; `bound` the step's lower bound (cp_bound.py: the fill's
    caps); `priority` >= 1 marks carried documents (first among their kind, never held back by a cap); `whole`
    marks documents that stay on one rank (media: a shard would cut or duplicate their placeholder runs)."""
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    costs = np.ascontiguousarray(costs, dtype=np.float64)
    degrees = np.ascontiguousarray(degrees, dtype=np.int64)
    n, pool = len(lengths), layout.pool
    urgent = (np.asarray(priority) > 0) if priority is not None else np.zeros(n, bool)
    rank_urgent = -urgent.astype(np.int64)
    wide = degrees > 1
    order = np.lexsort((np.arange(n), -costs, rank_urgent, -degrees))
    mean = float(costs.sum()) / pool if n else 0.0
    bin_of, size, tokens, bin_cost = _pack_bins(order[wide[order]], padded_lengths(lengths, degrees), costs, degrees,
                                                layout.slot, mean)
    bin_order = np.lexsort((np.arange(len(size)), -size, -bin_cost)).astype(np.int64)
    occ = np.full((pool, layout.waves + max(1, layout.waves)), -1, np.int64)
    total = np.zeros(pool)
    links = (comm.slope_intra, comm.slope_inter, comm.intercept, comm.ranks_per_node)
    W, first, wave, traffic, slope = _place_bins(bin_order, (size, tokens, bin_cost), layout.waves, occ.shape[1],
                                                 (occ, total, layout.pow2), links)
    occ = np.ascontiguousarray(occ[:, :W])
    in_bin = np.where(wide & (first[bin_of] >= 0 if len(first) else False), bin_of, -1)
    narrow = order[~wide[order]]
    narrow = narrow[np.lexsort((narrow, -costs[narrow], rank_urgent[narrow]))]
    whole = np.zeros(n, bool) if whole is None else np.ascontiguousarray(whole, dtype=bool)
    docs = (narrow, lengths, costs, urgent, whole)
    for slack in slacks:
        state = (tokens.copy(), bin_cost.copy(), traffic.copy(), total.copy(), np.zeros((pool, W), np.int64),
                 np.zeros((pool, W)), in_bin.copy(), np.full(n, -1, np.int64), np.full(n, -1, np.int64))
        _fill(docs, bound * (1.0 + slack), layout.slot, occ, (first, size, slope), state)
        carried = int(lengths[(state[6] < 0) & (state[7] < 0)].sum())
        if carried <= MAX_CARRY * max(1, int(lengths.sum())):
            break
    return _assemble(lengths, degrees, occ, (first, wave, size), state)


def _assemble(lengths, degrees, occ, bins, state) -> WaveAssignment:
    """The groups in (wave, first rank) order, and each item's group."""
    first, wave, size = bins
    tokens, bin_cost, bin_comm, total, slot_tokens, slot_cost, item_bin, item_rank, item_wave = state
    pool, W = occ.shape
    placed_bins = np.flatnonzero(first >= 0)
    singles_r, singles_w = np.nonzero(occ.T < 0)[::-1]  # every slot no group holds: a group of one
    g_wave = np.concatenate([wave[placed_bins], singles_w]).astype(np.int64)
    g_first = np.concatenate([first[placed_bins], singles_r]).astype(np.int64)
    g_size = np.concatenate([size[placed_bins], np.ones(len(singles_r), np.int64)])
    g_comm = np.concatenate([bin_comm[placed_bins], np.zeros(len(singles_r))])
    g_tokens = np.concatenate([tokens[placed_bins], slot_tokens[singles_r, singles_w]])
    order = np.lexsort((g_first, g_wave))
    rank_of = np.empty(len(order), np.int64)
    rank_of[order] = np.arange(len(order))
    bin_gid = np.full(len(first), -1, np.int64)
    bin_gid[placed_bins] = rank_of[: len(placed_bins)]
    slot_gid = np.full((pool, W), -1, np.int64)
    slot_gid[singles_r, singles_w] = rank_of[len(placed_bins):]
    item_group = np.full(len(lengths), -1, np.int64)
    in_bin = item_bin >= 0
    item_group[in_bin] = bin_gid[item_bin[in_bin]]
    in_slot = item_rank >= 0
    item_group[in_slot] = slot_gid[item_rank[in_slot], item_wave[in_slot]]
    micro_cost = slot_cost.copy()
    micro_tokens = slot_tokens.copy()
    for b in placed_bins.tolist():  # a few groups: their members' shares
        k, s, w = int(size[b]), int(first[b]), int(wave[b])
        micro_cost[s:s + k, w] = bin_cost[b] + bin_comm[b]
        micro_tokens[s:s + k, w] = tokens[b] // k
    placed = item_group >= 0
    sizes = np.where(placed, g_size[order][np.maximum(item_group, 0)], degrees)
    pad = int((padded_lengths(lengths[placed], sizes[placed]) - lengths[placed]).sum())
    return WaveAssignment(
        item_group=item_group, wave=g_wave[order], first=g_first[order], size=g_size[order], comm=g_comm[order],
        group_tokens=g_tokens[order], rank_cost=total, micro_cost=micro_cost, micro_tokens=micro_tokens,
        degrees=sizes, padding=pad,
    )
