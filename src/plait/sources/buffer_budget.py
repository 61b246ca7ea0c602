"""Keeping a loader's buffer of decoded blocks within its byte budgets.

A SourceLoader buffers decoded blocks (source, epoch, file_pos, block_pos) -> DocBlock, least recently
used first. Each source has a budget (its buffer_mb) and the loader one (its share of
loading.max_buffer_mb); after a block is read the buffer is cut back to both.
"""

from __future__ import annotations

from collections import OrderedDict

FullKey = tuple[int, int, int, int]  # (source, epoch, file_pos, block_pos)


def fit_budgets(blocks: OrderedDict, newest: FullKey, budgets: tuple, window: set) -> tuple[int, bool]:
    """Drop least recently used blocks until each (limit, source) budget holds (source None: all blocks;
    limit None: no budget), those no plan in `window` needs first (a dropped block that is needed again
    is read again: reading is deterministic). The block just read (`newest`) stays even if it alone is
    over a budget (one document larger than buffer_mb): never a deadlock.

    Returns the bytes dropped and whether a budget is still exceeded."""
    over = False
    dropped_bytes = 0
    for limit, source in budgets:
        if limit is None:
            continue
        mine = [k for k in blocks if source is None or k[0] == source]
        held = sum(blocks[k].nbytes for k in mine)
        victims = sorted((k for k in mine if k != newest), key=lambda k: k in window)  # stable: LRU first
        for k in victims:
            if held <= limit:
                break
            dropped = blocks.pop(k).nbytes
            held -= dropped
            dropped_bytes += dropped
        over = over or held > limit
    return dropped_bytes, over
