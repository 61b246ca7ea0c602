"""Parquet: one block per row group; only the needed column is read."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pyarrow.parquet as pq

from plait.errors import SourceError
from plait.sources.reader import EMPTY_FILE, FormatReader, RawBlock


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
                if self.field not in pf.schema_arrow.names:
                    raise SourceError(
                        self.spec.name, path, None, f"no column {self.field!r} (columns: {pf.schema_arrow.names})"
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
        table = pf.read_row_group(block, columns=[self.field])
        values = table.column(0).combine_chunks()
        n = len(values)
        return RawBlock(int(starts[block]), n, np.arange(n, dtype=np.int64), values)

    def close(self) -> None:
        for _, handle, _ in self._open.values():
            if handle is not None:
                handle.close()
        self._open.clear()
