"""Binary min-heaps of rank ids, for the LPT pass (lpt.py) and the micro-batch swaps (exchange.py).

A heap is an int64 array of rank ids plus its current size; ranks are ordered by (key[rank], rank), so
ties break by rank id and every result is deterministic. The size lives with the caller (it is part of
the LPT state that snapshots copy), so push and pop take it and return the new one.
"""

from __future__ import annotations

from plait.jit import jit

@jit
def before(key, a, b):
    """Whether rank a comes before rank b: lower key, ties by lower id."""
    return key[a] < key[b] or (key[a] == key[b] and a < b)


@jit
def sift_down(heap, n, key, i):
    while True:
        c = 2 * i + 1
        if c >= n:
            return
        if c + 1 < n and before(key, heap[c + 1], heap[c]):
            c += 1
        if before(key, heap[c], heap[i]):
            heap[c], heap[i] = heap[i], heap[c]
            i = c
        else:
            return


@jit
def push(heap, n, key, r):
    """Add rank r to heap[:n]; returns the new size."""
    i = n
    heap[i] = r
    while i > 0:
        p = (i - 1) // 2
        if before(key, heap[i], heap[p]):
            heap[p], heap[i] = heap[i], heap[p]
            i = p
        else:
            break
    return n + 1


@jit
def pop(heap, n, key):
    """Remove the first rank of heap[:n]; returns it and the new size."""
    r = heap[0]
    n -= 1
    heap[0] = heap[n]
    sift_down(heap, n, key, 0)
    return r, n
