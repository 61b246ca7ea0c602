"""Planner helpers for packing.schedule, sources[].max_chunk, packing.max_long_per_step and packing.split.

Chunk numbers. A chunk's number (the sample id's last field) is ceil(offset / g), `offset` its first token
inside the document and `g` the source's *granule*: the shortest piece its cuts can make other than a
document's last one. Pieces of one document never overlap, so consecutive cuts lie at least g apart and
the numbers strictly increase with the offset: unique per document, whatever the phase. Without a
schedule, max_chunk or split, g = seq_len and the numbers are the plain chunk indices (0, 1, 2, ...).
With a schedule or max_chunk, g = min over the phases of min(max_chunk, seq_len). With
`split: boundary` a cut may fall anywhere, so g = 1: the chunk number is the token offset itself.
"""

from __future__ import annotations

import numpy as np

from plait.plan import Items
from plait.spec import Spec


def chunk_limits(spec: Spec, seq_len: int) -> np.ndarray:
    """Longest chunk per source in a phase of `seq_len`: min(max_chunk, seq_len)."""
    return np.array([min(s.max_chunk or seq_len, seq_len) for s in spec.sources], dtype=np.int64)


def granules(spec: Spec) -> np.ndarray:
    """The chunk-numbering granule g per source (see the module's docstring)."""
    p = spec.packing
    if p.split == "boundary":
        return np.ones(len(spec.sources), dtype=np.int64)
    return chunk_limits(spec, p.min_seq_len())


def recut(items: Items, limits: np.ndarray, grains: np.ndarray) -> Items:
    """Carried chunks longer than their source's limit (the phase's seq_len shrank) cut into pieces of at
    most that limit, at exact token offsets; a piece keeps the chunk's wait (priority)."""
    if not len(items):
        return items
    lim = limits[items.source]
    if not bool((items.length > lim).any()):
        return items
    pieces = -(-items.length // lim)
    idx = np.repeat(np.arange(len(items)), pieces)
    j = np.arange(len(idx)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    out = items.take(idx)
    start = items.offset[idx] + j * lim[idx]
    out.length = np.minimum(lim[idx], items.offset[idx] + items.length[idx] - start).astype(np.int64)
    out.offset = start.astype(np.int64)
    out.chunk = np.where(pieces[idx] > 1, -(-start // grains[items.source[idx]]), items.chunk[idx]).astype(np.int64)
    return out


def hold_long(items: Items, priority: np.ndarray, min_tokens: int, allowed: int) -> np.ndarray:
    """Which items to hold back so that at most `allowed` chunks of >= min_tokens go into this step:
    the longest-waiting first, then in draw order (deterministic)."""
    held = np.zeros(len(items), dtype=bool)
    long = np.flatnonzero(items.length >= min_tokens)
    if len(long) <= allowed:
        return held
    order = long[np.lexsort((long, -priority[long]))]
    held[order[allowed:]] = True
    return held


def cap_long_per_rank(result, items: Items, costs: np.ndarray, min_tokens: int, per_rank: int) -> None:
    """Unplace a rank's long chunks beyond `per_rank` (its last ones by index), in place on the
    balance result: they go to the carry."""
    long = np.flatnonzero(result.placed & (items.length >= min_tokens))
    for r in np.unique(result.rank[long]):
        mine = long[result.rank[long] == r]
        for i in mine[per_rank:]:
            m = int(result.micro[i])
            result.micro_cost[r, m] -= costs[i]
            result.micro_tokens[r, m] -= items.length[i]
            result.rank_cost[r] -= costs[i]
            result.rank[i] = -1


def fill_boundary(result, items: Items, order: np.ndarray, capacity: int, cost_of, longest: int | None):
    """`split: boundary`: fill each run micro-batch's remaining room with head pieces of the unplaced
    items `order` (in that order), each of at most `longest` tokens when given. A piece is a new chunk of the document (its own sequence, numbered by
    its token offset); the rest stays unplaced. Updates the result's costs and tokens in place.

    Returns (pieces: Items placed, their ranks, micros, costs, rest: Items left (whole or tails), cuts)."""
    R, W = result.micro_tokens.shape
    counts = result.microbatches
    room = [(r, m) for r in range(R) for m in range(int(counts[r])) if result.micro_tokens[r, m] < capacity]
    take, lens, ranks, micros = [], [], [], []
    rest_idx, rest_skip = [], []
    cuts = 0
    k = 0
    for i in order.tolist():
        rem = int(items.length[i])
        skip = 0
        if not items.media[i]:  # a document with media is never cut
            while rem and k < len(room):
                r, m = room[k]
                space = capacity - int(result.micro_tokens[r, m])
                h = min(rem, space, longest or space)
                take.append((i, skip))
                lens.append(h)
                ranks.append(r)
                micros.append(m)
                result.micro_tokens[r, m] += h
                cuts += h < rem
                skip += h
                rem -= h
                if h == space:
                    k += 1
        if rem:
            rest_idx.append(i)
            rest_skip.append(skip)
    pieces = _pieces(items, [t[0] for t in take], [t[1] for t in take], lens)
    piece_costs = cost_of(pieces.length)
    ranks_a = np.asarray(ranks, dtype=np.int32)
    micros_a = np.asarray(micros, dtype=np.int32)
    np.add.at(result.micro_cost, (ranks_a, micros_a), piece_costs)
    np.add.at(result.rank_cost, ranks_a, piece_costs)
    rest = _pieces(items, rest_idx, rest_skip, None)
    return pieces, ranks_a, micros_a, piece_costs, rest, cuts


def _pieces(items: Items, idx: list[int], skip: list[int], lens: list[int] | None) -> Items:
    """Items[idx] starting `skip` tokens further in (length `lens`, or the rest); chunk = the offset."""
    idx_a = np.asarray(idx, dtype=np.int64)
    skip_a = np.asarray(skip, dtype=np.int64)
    out = items.take(idx_a)
    if not len(idx_a):
        return out
    out.offset = (out.offset + skip_a).astype(np.int64)
    out.length = (np.asarray(lens, dtype=np.int64) if lens is not None else out.length - skip_a).astype(np.int64)
    out.chunk = out.offset.copy()  # split: boundary numbers chunks by their token offset (granule 1)
    return out
