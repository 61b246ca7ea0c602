"""A source's column of documents made into tokens: checked record by record, bad records left out.

A column holds text (`text_field`, tokenized here) or token ids (`tokens_field`, a list of ints). A
record that is null, holds a null or negative id, an id beyond int32 or one at or above vocab_size is a
bad record (BadRecords: raise, or counted and left out); a column of the wrong type makes its whole
block bad. bos / eos are added to every kept document.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from plait.errors import SourceError
from plait.ragged import ragged_arange
from plait.sources.bad_records import BadRecords
from plait.sources.reader import RawBlock
from plait.spec import SourceSpec
from plait.transforms.tokenize import TextEncoder, add_special_tokens


class TokenColumn:
    """How one source's documents become tokens (flat int32 ids and offsets), its bad records reported."""

    def __init__(self, spec: SourceSpec, field: str, encoder: TextEncoder | None, vocab_size: int | None,
                 bad: BadRecords):
        self.spec = spec
        self.name = spec.name
        self.field = field
        self.encoder = encoder
        self.vocab_size = vocab_size  # ids at or above it are bad records (the model has no row for them)
        self.bad = bad

    def empty_raw(self) -> RawBlock:
        """A block of no records, of this column's type (what a block that could not be read becomes)."""
        value_type = pa.string() if self.encoder is not None else pa.list_(pa.int32())
        return RawBlock(0, 0, np.zeros(0, np.int64), pa.array([], value_type))

    def clean(self, values, ok_index: np.ndarray, path: str, first_row: int) -> tuple[pa.Array, np.ndarray]:
        """The records left once null ones and token lists holding a null or out-of-range id are reported
        and dropped; `ok_index` follows (record indices in the block)."""
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        values, ok_index = self.drop(values, ok_index, null_mask(values), path, first_row,
                                     f"field {self.field!r} is null or missing")
        if self.encoder is None and is_int_list(values.type):
            for mask, reason in bad_token_lists(values):
                values, ok_index = self.drop(values, ok_index, mask, path, first_row, reason)
        return values, ok_index

    def drop(self, values: pa.Array, ok_index: np.ndarray, bad: np.ndarray, path: str, first_row: int, reason: str):
        """Report the records flagged in `bad` (policy: raise, or skip and count) and leave them out."""
        if not bad.any():
            return values, ok_index
        for i in np.flatnonzero(bad):
            self.bad.record(path, str(first_row + int(ok_index[i])), reason)
        keep = np.flatnonzero(~bad)
        return values.take(pa.array(keep)), ok_index[keep]

    def drop_out_of_vocab(self, tokens: np.ndarray, offsets: np.ndarray, ok_index: np.ndarray, path: str,
                          first_row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Report records holding an id >= vocab_size (policy: raise, or skip and count) and leave them out."""
        lengths = np.diff(offsets)
        if not len(tokens) or int(tokens.max()) < self.vocab_size:
            return tokens, offsets, ok_index
        nonempty = lengths > 0
        record_max = np.full(len(lengths), -1, dtype=np.int64)
        record_max[nonempty] = np.maximum.reduceat(tokens, offsets[:-1][nonempty])
        bad = record_max >= self.vocab_size
        for i in np.flatnonzero(bad):
            self.bad.record(path, str(first_row + int(ok_index[i])),
                            f"token id {int(record_max[i])} is outside the vocabulary (vocab_size {self.vocab_size})")
        keep = np.flatnonzero(~bad)
        kept_tokens = tokens[ragged_arange(offsets[:-1][keep], lengths[keep])]
        kept_offsets = np.concatenate([[0], np.cumsum(lengths[keep])]).astype(offsets.dtype)
        return kept_tokens, kept_offsets, ok_index[keep]

    def tokens(self, values: pa.Array, path: str) -> tuple[np.ndarray, np.ndarray]:
        """Flat int32 ids and offsets of the records, bos / eos added; a SourceError when the column is of
        the wrong type or holds ids beyond int32 (the whole block is bad)."""
        if self.encoder is not None:
            if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
                raise SourceError(self.name, path, None, f"text_field {self.field!r} is {values.type}, not a string")
            flat, offsets = self.encoder.encode(values)
        else:
            if not (pa.types.is_list(values.type) or pa.types.is_large_list(values.type)):
                raise SourceError(
                    self.name, path, None, f"tokens_field {self.field!r} is {values.type}, not a list of ints"
                )
            if not pa.types.is_integer(values.type.value_type):
                raise SourceError(self.name, path, None, f"tokens_field values are {values.type.value_type}, not ints")
            offsets = np.asarray(values.offsets.to_numpy(), dtype=np.int64)
            child = values.values
            flat = child.to_numpy(zero_copy_only=False)
            base = offsets[0]
            flat = flat[base : offsets[-1]]
            offsets = offsets - base
            if flat.dtype != np.int32:
                if len(flat) and (flat.min() < 0 or flat.max() > np.iinfo(np.int32).max):
                    raise SourceError(self.name, path, None, "token ids out of int32 range")
                flat = flat.astype(np.int32)
        return add_special_tokens(flat, offsets, self.spec.bos, self.spec.eos)


def is_int_list(t: pa.DataType) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)


def bad_token_lists(values: pa.Array) -> list[tuple[np.ndarray, str]]:
    """Per-record masks of token lists holding a null or an id outside 0..2^31-1, with the reason.

    Vectorised: one pass over the ids; only a block that has such ids pays for finding their records.
    """
    offsets = np.asarray(values.offsets.to_numpy(), dtype=np.int64)
    ids = values.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    n = len(values)
    out = []

    def records(token_mask: np.ndarray) -> np.ndarray:
        owner = np.repeat(np.arange(n), np.diff(offsets))
        mask = np.zeros(n, dtype=bool)
        mask[owner[token_mask]] = True
        return mask

    if ids.null_count:
        out.append((records(null_mask(ids)),
                    "token list holds a null id"))
        ids = ids.fill_null(0)
    flat = ids.to_numpy(zero_copy_only=False)
    if len(flat) and (flat.min() < 0 or flat.max() > np.iinfo(np.int32).max):
        out.append((records((flat < 0) | (flat > np.iinfo(np.int32).max)), "token id out of range 0..2^31-1"))
    return out


def null_mask(values: pa.Array) -> np.ndarray:
    """Which entries are null, read straight from the validity bitmap (nothing to do without nulls)."""
    n = len(values)
    if values.null_count == 0:
        return np.zeros(n, dtype=bool)
    bitmap = values.buffers()[0]
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), bitorder="little")
    return bits[values.offset : values.offset + n] == 0
