"""Parquet: one block per row group; only the needed column is read (for planning, only `length_field`)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pyarrow.parquet as pq

import pyarrow as pa

from plait.errors import SourceError
from plait.sources.multimodal import records_from_values
from plait.sources.reader import EMPTY_FILE, FormatReader, RawBlock, RawLengths, int_lengths


class ParquetReader(FormatReader):
    MAX_OPEN = 4  # open files kept per source (footers are small; handles are not free on object stores)

    def __init__(self, spec, fs):
        super().__init__(spec, fs)
        self._open: OrderedDict[str, tuple[pq.ParquetFile, object, np.ndarray]] = OrderedDict()

    def _file(self, path: str):
        entry = self._open.get(path)
        if entry is None:
            handle = self.fs.open(path, "rb") if "://" in path else None
            try:
                pf = pq.ParquetFile(handle if handle is not None else path, memory_map=handle is None)
                for column in (self.field, self.spec.length_field, self.spec.image_field):
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
            starts = np.concatenate([[0], np.cumsum(counts)])
            entry = (pf, handle, starts)
            self._open[path] = entry
            while len(self._open) > self.MAX_OPEN:
                _, (_, old_handle, _) = self._open.popitem(last=False)
                if old_handle is not None:
                    old_handle.close()
        else:
            self._open.move_to_end(path)
        return entry

    def num_blocks(self, path: str) -> int:
        return self._file(path)[0].num_row_groups

    def read_block(self, path: str, block: int) -> RawBlock:
        pf, _, starts = self._file(path)
        if self.spec.image_field is not None:
            return self._read_records(pf, int(starts[block]), block)
        table = pf.read_row_group(block, columns=[self.field])
        values = table.column(0).combine_chunks()
        n = len(values)
        return RawBlock(int(starts[block]), n, np.arange(n, dtype=np.int64), values)

    def _read_records(self, pf, first: int, block: int) -> RawBlock:
        """Image-text rows: the text column and the image column (struct<bytes, path>, binary, a path, or
        a list of them); image bytes stay inline in the records (read once with the row group)."""
        table = pf.read_row_group(block, columns=[self.field, self.spec.image_field])
        texts = table.column(0).to_pylist()
        images = table.column(1).to_pylist()
        n = len(texts)
        records, kept, bad = records_from_values(texts, images, self.spec, [str(first + i) for i in range(n)])
        return RawBlock(first, n, kept, pa.array([""] * len(records), pa.string()),
                        [(int(name), why) for name, why in bad], records)

    def read_lengths(self, path: str, block: int) -> RawLengths:
        pf, _, starts = self._file(path)
        values = pf.read_row_group(block, columns=[self.spec.length_field]).column(0).combine_chunks()
        return int_lengths(values, int(starts[block]), self.spec.length_field)

    def close(self) -> None:
        for _, handle, _ in self._open.values():
            if handle is not None:
                handle.close()
        self._open.clear()
