"""Keeping a loader's buffer of decoded blocks within its byte budgets.

A SourceLoader buffers decoded blocks (source, epoch, file_pos, block_pos) -> DocBlock, least recently
used first. All its sources share one budget, sized to the plan window: the blocks the next steps draw
from (`window`), plus WINDOW_SLACK for blocks read ahead, never more than the loader's share of
loading.max_buffer_mb. A block the Planner will still draw from later but no planned step needs (a
source's cursor block) is dropped when over it and read again when a step needs it, so the buffer does
not grow with the number of sources. A source whose spec sets buffer_mb is also capped by it; after a
block is read the buffer is cut back to every budget.
"""

from __future__ import annotations

from collections import OrderedDict

FullKey = tuple[int, int, int, int]  # (source, epoch, file_pos, block_pos)
WINDOW_SLACK = 16 << 20  # bytes over the plan window's blocks kept for blocks read ahead (one default buffer_mb)


def window_limit(blocks: OrderedDict, window: set, cap: int | None) -> int:
    """The shared budget now: the bytes of the buffered blocks the plan window draws from, plus
    WINDOW_SLACK, never over `cap` (the loader's share of loading.max_buffer_mb; None: no cap)."""
    need = sum(b.nbytes for k, b in blocks.items() if k in window) + WINDOW_SLACK
    return need if cap is None else min(cap, need)


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


def retain_blocks(blocks: OrderedDict, live: set, window: set, cap: int | None) -> int:
    """Drops the blocks no step needs (not in `live`), then, least recently used first, those outside the
    plan `window` while the buffer is over the shared budget (window_limit); returns the bytes dropped."""
    dropped = 0
    for k in [k for k in blocks if k not in live]:
        dropped += blocks.pop(k).nbytes
    limit, held = window_limit(blocks, window, cap), sum(b.nbytes for b in blocks.values())
    for k in [k for k in blocks if k not in window]:
        if held <= limit:
            break
        size = blocks.pop(k).nbytes
        held, dropped = held - size, dropped + size
    return dropped
