"""Parquet: one block per row group, or per row range of a row group too large for the source's buffer;
only the needed column is read (for planning, only `length_field`).

Row ranges. A row group whose decoded size (estimated from the footer: the token column's value count,
or the text column's uncompressed bytes) exceeds a quarter of the source's `buffer_mb` is cut into
equal row ranges ("pieces") that each fit; its pieces are consecutive blocks of the file, read in order
through one open `iter_batches` iterator (a piece asked for out of order restarts it). A row group that
fits stays one block, so specs whose row groups fit keep their stream exactly. The SourceLoader keeps
at most `loading.max_open_streams` such iterators open over all its sources (reader.OpenStreams).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from plait.errors import SourceError
from plait.media.registry import source_media
from plait.sources.multimodal import records_from_values
from plait.sources.reader import (
    EMPTY_FILE,
    FormatReader,
    RawBlock,
    RawLengths,
    int_lengths,
)

PIECE_FRACTION = 4  # a block decodes to at most buffer_mb / PIECE_FRACTION (estimated)
READ_BUFFER = 64 << 10  # streamed column-chunk reads (no pre-buffering): a row group is never held whole; held per open source
ITER_BATCHES = 32  # a piece is read in this many batches: an open iterator holds about one batch and one page
DOC_INDEX_BYTES = 32  # per document, a decoded block's index arrays (starts, lengths, rows, positions)


@dataclass
class _OpenFile:
    pf: pq.ParquetFile
    handle: object
    starts: np.ndarray  # first row of each row group (and the total at the end)
    pieces: np.ndarray  # pieces per row group (1: the whole row group is one block)
    first_block: np.ndarray  # the block index of each row group's first piece
    cursor: dict = field(default_factory=dict)  # the open row-range iterator: group, next piece, batches, rest


class ParquetReader(FormatReader):
    MAX_OPEN = 4  # open files kept per source (footers are small; handles are not free on object stores)

    def __init__(self, spec, fs):
        super().__init__(spec, fs)
        self._open: OrderedDict[str, _OpenFile] = OrderedDict()
        self.piece_bytes = max(1, spec.buffer_bytes // PIECE_FRACTION)

    def _file(self, path: str) -> _OpenFile:
        entry = self._open.get(path)
        if entry is None:
            handle = self.open_stream(path) if "://" in path else None
            try:
                pf = pq.ParquetFile(handle if handle is not None else path, buffer_size=READ_BUFFER, pre_buffer=False)
                for column in (self.field, self.spec.length_field, *(c for _, c in source_media(self.spec))):
                    if column is not None and column not in pf.schema_arrow.names:
                        raise SourceError(
                            self.spec.name, path, None, f"no column {column!r} (columns: {pf.schema_arrow.names})"
                        )
                if pf.metadata.num_rows == 0:
                    raise SourceError(self.spec.name, path, None, EMPTY_FILE)
            except BaseException:
                if handle is not None:  # a bad file must not leak its (remote) handle
                    handle.close()
                raise
            counts = np.array([pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)], np.int64)
            pieces = np.array([self._pieces(pf.metadata.row_group(i)) for i in range(pf.num_row_groups)], np.int64)
            entry = _OpenFile(pf, handle, np.concatenate([[0], np.cumsum(counts)]), pieces,
                              np.cumsum(pieces) - pieces)
            self._open[path] = entry
            while len(self._open) > self.MAX_OPEN:
                old_path, old = self._open.popitem(last=False)
                self.streams.done((id(self), old_path))
                if old.handle is not None:
                    old.handle.close()
        else:
            self._open.move_to_end(path)
        return entry

    def _pieces(self, group) -> int:
        """How many row ranges a row group is read in: its estimated decoded size over `piece_bytes`."""
        rows = group.num_rows
        estimate = DOC_INDEX_BYTES * rows
        media_columns = [column for _, column in source_media(self.spec)]
        for i in range(group.num_columns):
            column = group.column(i)
            name = column.path_in_schema.split(".")[0]
            if name == self.field and self.spec.tokens_field is not None:
                estimate += 4 * column.num_values  # one int32 per id (dictionary-encoded ids decode wider)
            elif name == self.field:  # text: bytes-level tokens are one int32 per byte; a tokenizer ~ 1 per 4
                estimate += column.total_uncompressed_size * (4 if self.spec.tokenizer is None else 1)
            elif name in media_columns:
                estimate += column.total_uncompressed_size
        pieces = max(1, min(rows, -(-estimate // self.piece_bytes)))
        return int(-(-rows // -(-rows // pieces)))  # as many as equal ranges of ceil(rows / pieces) rows fill: none empty

    def num_blocks(self, path: str) -> int:
        return int(self._file(path).pieces.sum())

    def block_runs(self, path: str) -> np.ndarray:
        return self._file(path).pieces

    def _where(self, entry: _OpenFile, block: int) -> tuple[int, int, int, int]:
        """Block -> (row group, piece, first row in the file, rows)."""
        group = int(np.searchsorted(entry.first_block, block, side="right") - 1)
        piece = block - int(entry.first_block[group])
        rows = int(entry.starts[group + 1] - entry.starts[group])
        per_piece = -(-rows // int(entry.pieces[group]))
        first = min(piece * per_piece, rows)
        return group, piece, int(entry.starts[group]) + first, min(per_piece, rows - first)

    def _table(self, path: str, block: int, columns: list[str]) -> tuple[int, pa.Table]:
        """The rows of a block: a whole row group, or one of its pieces (streamed, in order)."""
        entry = self._file(path)
        group, piece, first, rows = self._where(entry, block)
        if entry.pieces[group] == 1:
            return first, entry.pf.read_row_group(group, columns=columns)
        cur, key = entry.cursor, (id(self), path)
        if cur.get("at") != (group, piece, tuple(columns)):
            per_piece = -(-int(entry.starts[group + 1] - entry.starts[group]) // int(entry.pieces[group]))
            cur.clear()
            cur.update(batches=entry.pf.iter_batches(batch_size=max(1, per_piece // ITER_BATCHES), row_groups=[group],
                                                      columns=columns, use_threads=False), rest=None)
            if piece:  # out of order, or its reader was closed (OpenStreams): read past the pieces before it
                self.streams.reopened += 1
                self.streams.rows_reread += piece * per_piece
            for _ in range(piece):  # one piece at a time: bounded memory
                self._take(cur, per_piece)
        table = self._take(cur, rows)
        cur["at"] = (group, piece + 1, tuple(columns))
        if piece + 1 == entry.pieces[group]:
            cur.clear()  # the row group is read: its reader's page and batch buffers go now, not at the next one
            self.streams.done(key)
        else:
            self.streams.use(key, cur)
        return first, table

    @staticmethod
    def _take(cur: dict, rows: int) -> pa.Table:
        """The next `rows` rows of the open iterator (batches need not match pieces exactly)."""
        parts, have = [], 0
        rest = cur.get("rest")
        while have < rows:
            batch = rest if rest is not None else next(cur["batches"])
            rest = None
            need = rows - have
            if batch.num_rows > need:
                batch, rest = batch.slice(0, need), batch.slice(need)
            parts.append(batch)
            have += batch.num_rows
        cur["rest"] = rest
        return pa.Table.from_batches(parts)

    def read_block(self, path: str, block: int) -> RawBlock:
        if self.spec.multimodal:
            return self._read_records(path, block)
        first, table = self._table(path, block, [self.field])
        values = table.column(0).combine_chunks()
        n = len(values)
        return RawBlock(first, n, np.arange(n, dtype=np.int64), values)

    def _read_records(self, path: str, block: int) -> RawBlock:
        """Image-text rows: the text column and the image column (struct<bytes, path>, binary, a path, or
        a list of them); image bytes stay inline in the records (read once with the block)."""
        fields = source_media(self.spec)
        first, table = self._table(path, block, [self.field, *(c for _, c in fields)])
        texts = table.column(0).to_pylist()
        n = len(texts)
        media = {kind.name: table.column(column).to_pylist() for kind, column in fields}
        records, kept, bad = records_from_values(texts, media, self.spec, [str(first + i) for i in range(n)])
        return RawBlock(first, n, kept, pa.array([""] * len(records), pa.string()),
                        [(int(name), why) for name, why in bad], records)

    def read_lengths(self, path: str, block: int) -> RawLengths:
        entry = self._file(path)
        group, _, first, rows = self._where(entry, block)
        values = entry.pf.read_row_group(group, columns=[self.spec.length_field]).column(0)
        begin = first - int(entry.starts[group])  # the length column is small: read whole, cut to the piece
        return int_lengths(values.slice(begin, rows).combine_chunks(), first, self.spec.length_field)

    def close(self) -> None:
        for entry in self._open.values():
            if entry.handle is not None:
                entry.handle.close()
        self._open.clear()
