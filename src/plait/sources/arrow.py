"""Arrow IPC files: Hugging Face `datasets` shards, one block per record batch.

`Dataset.save_to_disk` writes `data-00000-of-0000N.arrow` beside `dataset_info.json` and `state.json`,
and the hub cache holds `<name>-<split>-0000i-of-0000N.arrow`: both are Arrow IPC *streams*, read here
through a memory map (zero-copy; only the needed column of a batch is touched). The IPC *file* format
(magic "ARROW1") is read as well. Columns are named by text_field / tokens_field (and length_field),
as for Parquet.

Opening a file walks its batches' headers once (no data is copied) to know how many blocks it holds;
a stream that ends early (a truncated file) or holds no rows is an error naming the file.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pyarrow as pa

from plait.errors import SourceError
from plait.sources.reader import (
    EMPTY_FILE,
    FormatReader,
    RawBlock,
    RawLengths,
    describe,
    int_lengths,
)

FILE_MAGIC = b"ARROW1"


class ArrowReader(FormatReader):
    MAX_OPEN = 8

    def __init__(self, spec, fs):
        super().__init__(spec, fs)
        self._open: OrderedDict[str, tuple[list[pa.RecordBatch], np.ndarray]] = OrderedDict()

    def num_blocks(self, path: str) -> int:
        return len(self._file(path)[0])

    def read_block(self, path: str, block: int) -> RawBlock:
        batches, starts = self._file(path)
        values = batches[block].column(self.field)
        n = len(values)
        return RawBlock(int(starts[block]), n, np.arange(n, dtype=np.int64), values)

    def read_lengths(self, path: str, block: int) -> RawLengths:
        batches, starts = self._file(path)
        return int_lengths(batches[block].column(self.spec.length_field), int(starts[block]), self.spec.length_field)

    def _file(self, path: str):
        entry = self._open.get(path)
        if entry is not None:
            self._open.move_to_end(path)
            return entry
        try:
            source = pa.memory_map(path) if "://" not in path else pa.BufferReader(self._read(path))
            head = source.read(len(FILE_MAGIC))
            source.seek(0)
            if head == FILE_MAGIC:
                f = pa.ipc.open_file(source)
                schema, batches = f.schema, [f.get_batch(i) for i in range(f.num_record_batches)]
            else:
                reader = pa.ipc.open_stream(source)
                schema, batches = reader.schema, list(reader)
        except (pa.ArrowInvalid, OSError, EOFError) as e:
            raise SourceError(self.spec.name, path, None, f"not a readable Arrow IPC stream or file "
                              f"(truncated or corrupt?): {describe(e)}") from None
        for column in (self.field, self.spec.length_field):
            if column is not None and column not in schema.names:
                raise SourceError(self.spec.name, path, None, f"no column {column!r} (columns: {schema.names})")
        batches = [b for b in batches if b.num_rows]
        if not batches:
            raise SourceError(self.spec.name, path, None, EMPTY_FILE)
        starts = np.concatenate([[0], np.cumsum([b.num_rows for b in batches])]).astype(np.int64)
        entry = (batches, starts)
        self._open[path] = entry
        while len(self._open) > self.MAX_OPEN:
            self._open.popitem(last=False)
        return entry

    def _read(self, path: str) -> bytes:
        with self.fs.open(path, "rb") as f:
            return f.read()

    def close(self) -> None:
        self._open.clear()
