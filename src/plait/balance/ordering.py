"""Stage 1, placement order: urgent items first, then by decreasing cost, ties by index.

Every later stage streams through the items in this order, so `sorted_items` also returns the lengths
and costs gathered into it (contiguous arrays), and `scatter_back` maps the final assignment back to the
caller's order. The sorts are stable LSD radix sorts on integer keys: the same order on every machine
and numpy version (an unstable quicksort on tied costs would not be), in linear time. When cost is an
increasing function of length (text), sorting the lengths gives the same order faster.
"""

from __future__ import annotations

import numpy as np

from plait.jit import jit
LENGTH_ORDER_MIN = 4096  # steps with more items try the sort by length first


def sorted_items(costs, priority, lengths):
    """The placement order, and `lengths` and `costs` in that order (None, None without lengths).

    Urgent items (priority >= 2) come first, each group by decreasing cost, ties by index. A stable radix
    sort on the costs' bit patterns (monotone for non-negative floats; negative, -0.0 and NaN costs sort
    as 0.0). Text costs are an increasing function of length: then a radix sort of the lengths gives the
    same order faster, with the sorted lengths and costs for free (checked on the data; any other cost
    model takes the first way).
    """
    n = len(costs)
    positive = bool((costs > 0).all())
    order = Ls = Cs = None
    if lengths is not None and n > LENGTH_ORDER_MIN and positive:
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


@jit
def _gather(order, lengths, costs):
    n = len(order)
    Ls = np.empty(n, dtype=np.int64)
    Cs = np.empty(n)
    for t in range(n):
        Ls[t] = lengths[order[t]]
        Cs[t] = costs[order[t]]
    return Ls, Cs


@jit
def scatter_back(order, rank_s, micro_s, new_pos, rank, micro):
    """From placement order back to the caller's order, micro-batches renumbered by new_pos."""
    for t in range(len(order)):
        i = order[t]
        r = rank_s[t]
        rank[i] = r
        micro[i] = new_pos[r, micro_s[t]] if r >= 0 else -1


@jit
def radix_sort(key, idx, top, digit_bits):
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


@jit
def _radix_desc(bits):
    """Stable argsort of non-negative int64 keys, descending (ties: ascending index)."""
    n = len(bits)
    MAXK = 0x7FFFFFFFFFFFFFFF
    key = np.empty(n, dtype=np.int64)
    for i in range(n):
        key[i] = MAXK - bits[i]
    return radix_sort(key, np.arange(n), MAXK, 8)[1]


@jit
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
    key, idx = radix_sort(key, idx, top, 11)
    for i in range(n):
        order[i] = idx[i]
        Ls[i] = top - key[i]
        Cs[i] = of_len[Ls[i]]
    return True
