"""What a source's blocks are decoded into: documents with their tokens (DocBlock), or their sizes alone
(BlockLengths, for planning), and the check that makes the first agree with the second.

A block key (epoch, file_pos, block_pos) names a block in the source's order (sources/base.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from plait.sources.multimodal import ImageTable
from plait.spec import SourceSpec

BlockKey = tuple[int, int, int]  # (epoch, file_pos, block_pos)


@dataclass
class DocBlock:
    """Decoded documents of one block, in the source's shuffled order.

    Document i (in shuffled order) is tokens[starts[i] : starts[i] + lengths[i]], sample id
    (shard, rows[i]), at shuffled position positions[i]. `tokens` stays in file order (for token-id
    sources it is the Arrow buffer itself, zero-copy); only the small index arrays are shuffled.
    Positions of dropped (bad) records are absent from `positions`.
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

    @property
    def nbytes(self) -> int:
        extra = self.images.nbytes if self.images is not None else 0
        return extra + sum(a.nbytes for a in (self.tokens, self.starts, self.lengths, self.rows, self.positions))


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
    bad record, reported (`report(path, record, reason)`: raise, or count) and delivered cut or padded
    (eos, else 0) to the planned length: the plan already holds it there."""
    if np.array_equal(block.positions, meta.positions) and np.array_equal(block.lengths, meta.lengths):
        return block
    what = f"length_field {spec.length_field!r}" if spec.length_field else "the format's index"
    pad = spec.eos if spec.eos is not None else 0
    at = np.minimum(np.searchsorted(block.positions, meta.positions), max(len(block.positions) - 1, 0))
    found = (at < len(block.positions)) & (block.positions[at] == meta.positions) if len(block.positions) \
        else np.zeros(len(meta.positions), bool)
    pieces = []
    for j in range(len(meta.positions)):
        want = int(meta.lengths[j])
        doc = block.tokens[block.starts[at[j]] : block.starts[at[j]] + block.lengths[at[j]]] if found[j] else None
        if doc is None or len(doc) != want:
            held = "cannot be read" if doc is None else f"holds {len(doc)}"
            report(path, str(int(meta.rows[j])), f"{what} says {want} tokens (bos/eos included) but the "
                   f"record {held}; planned at {want}, it is delivered cut or padded with id {pad}")
            doc = np.full(want, pad, np.int32) if doc is None else \
                np.concatenate([doc[:want], np.full(max(want - len(doc), 0), pad, np.int32)])
        pieces.append(doc)
    tokens = np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32)
    lengths = meta.lengths.astype(np.int64)
    return DocBlock(block.source, block.key, meta.shard, meta.positions, meta.rows, tokens,
                    np.cumsum(lengths) - lengths, lengths, meta.num_positions)
