"""Keeping a loader's buffer of decoded blocks within its byte budgets.

A SourceLoader buffers decoded blocks (source, epoch, file_pos, block_pos) -> DocBlock, least recently
used first. All its sources share one budget: the loader's share of loading.max_buffer_mb, applied when
a block is read and when the Planner releases blocks; over it, blocks outside the plan `window` (the
blocks the planned steps and carried chunks draw from) go first, e.g. a source's cursor block that the
Planner will draw from later but no planned step needs yet (read again when one does: reading is
deterministic, the stream is the same). A source whose spec sets buffer_mb is also capped by it.

A block kept outside the window is compact (blocks.compact: uint16 ids where they fit, half the bytes,
the same values): with many sources the cursor blocks are most of the buffer (64 sources of 2.4 MiB
blocks: 153 MiB as int32, 77 MiB compact), and compacting costs one copy per block, never a decode.

A cursor block is also cut to its head (CursorHeads): the documents its next HEAD_STEPS steps draw, at an
equal share, from the last one gathered on; drawing past a head reads the block again (the same block:
reading is deterministic), about sources / HEAD_STEPS blocks a step. It keeps no more than that of a row
group for the hundreds of steps its source takes to draw it, which is what made the buffer grow with the
number of sources (docs/memory.md).

WINDOW_SLACK sizes the shared budget to the plan window instead (its blocks plus WINDOW_SLACK, within the
cap), so that the buffer stops growing with the number of sources. It is off (None) by default: at 64
sources of 2 MiB blocks it cut the node host's PSS from 265 to 127 MiB but re-decoded cursor blocks
~15 times each (loader CPU 12.9 s instead of 1.7 s per 100 steps); flat memory without that cost needs
blocks smaller than a row group sized from the shared budget (docs/memory.md).
"""

from __future__ import annotations

from collections import OrderedDict

from plait.sources.blocks import compact, head

FullKey = tuple[int, int, int, int]  # (source, epoch, file_pos, block_pos)
WINDOW_SLACK: int | None = None  # bytes kept over the plan window's blocks; None: the cap alone (see above)
HEAD_STEPS = 512  # a cursor block keeps what this many steps draw from its source at an equal share (CursorHeads)


def head_tokens(spec) -> int:
    """Tokens a cursor block keeps (CursorHeads): HEAD_STEPS steps' tokens over the job's sources. The
    blocks read again to go on past a head are then about (sources / HEAD_STEPS) a step, whatever the
    weights: a source drawn twice as often goes through its heads twice as fast."""
    packing = spec.packing
    step = packing.seq_len * packing.num_microbatches * spec.topology.dp
    return max(1, HEAD_STEPS * step // max(1, len(spec.sources)))


class CursorHeads:
    """Cuts each block outside the plan window (a cursor block: the Planner draws from it later, no planned
    step does now) to its head (blocks.head): `tokens` (head_tokens) of its documents from the last one a
    gather took on (every document before it was drawn by a step that is built: `note` keeps per block the
    highest shuffled position gathered). A cursor block drawn one document every few steps held a whole
    row group for hundreds of steps: with many sources, most of the buffer."""

    def __init__(self, spec):
        self.tokens = head_tokens(spec)
        self.served: dict[FullKey, int] = {}

    def note(self, key: FullKey, positions) -> None:
        """A gather took the documents at these shuffled positions of block `key`."""
        self.served[key] = max(self.served.get(key, 0), int(positions.max()))

    def trim(self, blocks: OrderedDict, live: set, window: set) -> int:
        """Cut the blocks outside `window` to their heads (forgetting blocks no longer `live`); returns the
        bytes cut."""
        self.served = {k: v for k, v in self.served.items() if k in live}
        cut = 0
        for k in [k for k in blocks if k not in window]:
            before = blocks[k].nbytes
            blocks[k] = head(blocks[k], self.served.get(k, 0), self.tokens)
            cut += before - blocks[k].nbytes
        return cut


def drop_over_count(blocks: OrderedDict, limit: int, newest: FullKey) -> int:
    """Drops the least recently used whole blocks beyond `limit` (a SourceLoader's max_cached_blocks), never
    the one just read (`newest`, made the most recent); a cursor block's head is not counted (a few KiB, one
    per source: its bytes count in the budgets). Returns the bytes dropped."""
    blocks.move_to_end(newest)
    whole = [k for k, block in blocks.items() if block.span is None]
    return sum(blocks.pop(k).nbytes for k in whole[:max(0, len(whole) - limit)])


def window_limit(blocks: OrderedDict, window: set, cap: int | None) -> int | None:
    """The shared budget now: `cap` (the loader's share of loading.max_buffer_mb; None: no cap), or with
    WINDOW_SLACK set, the bytes of the buffered blocks the plan window draws from plus it, within `cap`."""
    if WINDOW_SLACK is None:
        return cap
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
    plan `window` while the buffer is over the shared budget (window_limit); the others outside the
    window are kept compact (blocks.compact). Returns the bytes dropped (compacting counts too)."""
    dropped = 0
    for k in [k for k in blocks if k not in live]:
        dropped += blocks.pop(k).nbytes
    for k in [k for k in blocks if k not in window]:
        before = blocks[k].nbytes
        blocks[k] = compact(blocks[k])
        dropped += before - blocks[k].nbytes
    limit, held = window_limit(blocks, window, cap), sum(b.nbytes for b in blocks.values())
    for k in [k for k in blocks if k not in window]:
        if limit is None or held <= limit:
            break
        size = blocks.pop(k).nbytes
        held, dropped = held - size, dropped + size
    return dropped
