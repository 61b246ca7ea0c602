"""What a source's blocks are decoded into: documents with their tokens (DocBlock), or their sizes alone
(BlockLengths, for planning), and the check that makes the first agree with the second.

A block key (epoch, file_pos, block_pos) names a block in the source's order (sources/base.py).

A record planned from its length alone (a `length_field`, Megatron's index) that then fails to decode,
or whose tokens disagree with that length, is a late failure: the plan (of every rank) already holds it
at its planned length, so it stays in the block's documents, marked `failed`, and a gather leaves it out
as a dropped sample (`Payload.dropped`, as an image that fails after planning): not delivered, counted in
the micro-batch's `dropped_samples` and its labels in `dropped_label_tokens`, so that the step's
`global_label_tokens` less them is exactly what the loss sees.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from plait.batch import Payload
from plait.ragged import ragged_arange
from plait.sources.multimodal import ImageTable
from plait.spec import SourceSpec

BlockKey = tuple[int, int, int]  # (epoch, file_pos, block_pos)


@dataclass
class DocBlock:
    """Decoded documents of one block, in the source's shuffled order.

    Document i (in shuffled order) is tokens[starts[i] : starts[i] + lengths[i]], sample id
    (shard, rows[i]), at shuffled position positions[i]. `tokens` stays in file order (for token-id
    sources it is the Arrow buffer itself, zero-copy); only the small index arrays are shuffled.
    Positions of dropped (bad) records are absent from `positions`, except late failures (module
    docstring): listed, marked in `failed`, their span empty (it starts at the end of `tokens`).
    """

    source: int
    key: BlockKey
    shard: int
    positions: np.ndarray  # int64 [n] shuffled positions of kept docs (increasing)
    rows: np.ndarray  # int64 [n] row index inside the file
    tokens: np.ndarray  # int32 flat, file order
    starts: np.ndarray  # int64 [n]
    lengths: np.ndarray  # int64 [n]
    num_positions: int  # shuffled positions in the block, bad records included (what a cursor counts)
    images: ImageTable | None = None  # image sources: each document's images (sources/multimodal.py)
    failed: np.ndarray | None = None  # bool [n]: late failures (module docstring); None: none
    wide: bool = False  # an id beyond uint16 was found: `compact` leaves it as it is (checked once)
    span: tuple[int, int] | None = None  # a head (`head`): it holds the positions lo <= p < hi only; None: all

    def holds(self, positions: np.ndarray | None) -> bool:
        """Whether the block holds these documents' tokens (None: the whole block, e.g. its metadata)."""
        if self.span is None:
            return True
        return positions is not None and (len(positions) == 0 or (
            int(positions.min()) >= self.span[0] and int(positions.max()) < self.span[1]))

    @property
    def nbytes(self) -> int:
        extra = self.images.nbytes if self.images is not None else 0
        extra += self.failed.nbytes if self.failed is not None else 0
        return extra + sum(a.nbytes for a in (self.tokens, self.starts, self.lengths, self.rows, self.positions))


def compact(block: DocBlock) -> DocBlock:
    """The block with its ids held as uint16 where all of them fit: half the bytes, the same values (so
    the same batches). For a block kept while no planned step draws from it (a source's cursor block:
    buffer_budget.retain_blocks), which is most of what a job of many sources buffers; a gather copies
    from it as from int32 ids."""
    tokens = block.tokens
    if block.wide or tokens.dtype == np.uint16:
        return block
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) > np.iinfo(np.uint16).max):
        block.wide = True
        return block
    return replace(block, tokens=tokens.astype(np.uint16))


def head(block: DocBlock, first: int, tokens: int) -> DocBlock:
    """The block's documents at shuffled positions `first` on, as many as hold `tokens` tokens (at least
    one): what the next draws of a cursor block need (buffer_budget.trim_heads). The order is the whole
    block's (nothing is re-shuffled): a later draw past the head reads the block again, the same block.
    Text blocks only (media blocks and late failures stay whole); a head is not cut again."""
    if block.span is not None or block.images is not None or block.failed is not None:
        return block
    n = len(block.positions)
    a = int(np.searchsorted(block.positions, first))
    b = min(n, a + max(1, int(np.searchsorted(np.cumsum(block.lengths[a:]), tokens, side="right"))))
    if b == n:  # the rest of the block is its head: kept as it is (no copy)
        return block
    lengths = block.lengths[a:b]
    starts = np.cumsum(lengths) - lengths
    end = int(block.positions[b]) if b < n else block.num_positions
    return replace(block, positions=block.positions[a:b].copy(), rows=block.rows[a:b].copy(),
                   tokens=block.tokens[ragged_arange(block.starts[a:b], lengths)], starts=starts,
                   lengths=lengths.copy(), span=(int(first), end))


@dataclass
class BlockLengths:
    """A block's documents' sizes and ids in shuffled order (DocBlock without the tokens), read from a
    length column or the format's index: what planning needs. Lengths include bos/eos."""

    source: int
    key: BlockKey
    shard: int
    positions: np.ndarray
    rows: np.ndarray
    lengths: np.ndarray
    num_positions: int


def reconcile(block: DocBlock, meta: BlockLengths, spec: SourceSpec, path: str,
              report: Callable[[str, str | None, str], None]) -> DocBlock:
    """The decoded block made to hold exactly the planned documents at their planned lengths.

    A record whose tokens disagree with the lengths planning read (or that turns out unreadable) is a
    bad record, reported (`report(path, record, reason)`: raise, or count) and marked `failed`: a late
    failure, dropped from its batch (module docstring)."""
    if np.array_equal(block.positions, meta.positions) and np.array_equal(block.lengths, meta.lengths):
        return block
    want = meta.lengths.astype(np.int64)
    at = np.searchsorted(block.positions, meta.positions)
    found = at < len(block.positions)
    found[found] = block.positions[at[found]] == meta.positions[found]
    held = np.full(len(want), -1, np.int64)
    held[found] = block.lengths[at[found]]
    failed = held != want
    what = f"length_field {spec.length_field!r}" if spec.length_field else "the format's index"
    for j in np.flatnonzero(failed):
        got = "cannot be read" if held[j] < 0 else f"holds {held[j]}"
        report(path, str(int(meta.rows[j])), f"{what} says {want[j]} tokens (bos/eos included) but the record "
               f"{got}; it was planned at that length, so its sample is dropped from its batch")
    kept = want * ~failed
    starts = np.cumsum(kept) - kept
    tokens = block.tokens[ragged_arange(block.starts[at[~failed]], want[~failed])].astype(np.int32, copy=False)
    starts[failed] = len(tokens)
    return DocBlock(block.source, block.key, meta.shard, meta.positions, meta.rows, tokens, starts, want,
                    meta.num_positions, failed=failed if failed.any() else None)


def late_failures(block: DocBlock, sel: np.ndarray, doc: np.ndarray, failed: np.ndarray):
    """The requested items `sel` (documents `doc` of `block`) less the block's late failures, which are
    marked in `failed` (per item of the whole request)."""
    if block.failed is None:
        return sel, doc
    failed[sel] = block.failed[doc]
    keep = ~block.failed[doc]
    return sel[keep], doc[keep]


def without_late_failures(payload: np.ndarray | Payload, failed: np.ndarray | None,
                          length: np.ndarray) -> np.ndarray | Payload:
    """A gather's payload (tokens, or a Payload) with its late failures (`failed`, per requested item; their
    tokens never copied) left out and listed as dropped, each with the labels the step counted for it
    (every token but the last: a text document has no placeholders). Unchanged when none failed."""
    if failed is None or not failed.any():
        return payload
    length = np.asarray(length, np.int64)
    payload = payload if isinstance(payload, Payload) else Payload(payload, None)
    none = np.zeros(0, np.int64)
    dropped = none if payload.dropped is None else np.asarray(payload.dropped, np.int64)
    labels = none if payload.dropped_labels is None else np.asarray(payload.dropped_labels, np.int64)
    present = np.ones(len(length), bool)  # items whose tokens are in the payload (not dropped for their media)
    present[dropped] = False
    tokens = payload.tokens[np.repeat(~failed[present], length[present])]
    gone = np.flatnonzero(failed)
    all_gone = np.concatenate([gone, dropped])
    order = np.argsort(all_gone, kind="stable")
    all_labels = np.concatenate([(length[gone] - 1).clip(min=0), labels])
    return payload._replace(tokens=tokens, dropped=all_gone[order], dropped_labels=all_labels[order])
