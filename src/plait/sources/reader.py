"""What every format reader shares: the block it returns (RawBlock) and its interface (FormatReader).

Kept apart from `base` (the Source) and `formats` (the table of readers) so that the imports form a
line, never a circle: base -> formats -> jsonl, parquet -> reader.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import fsspec
import numpy as np
import pyarrow as pa

from plait.spec import SourceSpec

EMPTY_FILE = "file holds no records (an empty file: remove it, or set on_error: skip)"


@dataclass
class RawBlock:
    """What a format reader returns for one block: the readable records' field values.

    The block holds records first_row .. first_row+num_records-1 of its file; `values[i]` belongs to
    record first_row + ok_index[i]; records missing from ok_index were unreadable (listed in `bad`).
    """

    first_row: int
    num_records: int
    ok_index: np.ndarray  # int64, increasing
    values: pa.Array  # string or list<int> array aligned with ok_index
    bad: list[tuple[int, str]] = field(default_factory=list)  # (record index in file, reason)


class FormatReader:
    """Reads blocks of one file format. Subclasses: ParquetReader, JsonlReader.

    A file that cannot be read as a whole (corrupt, truncated, not of the format, empty, missing the
    field) makes `num_blocks` or `read_block` raise: a SourceError naming the file (and the record
    where known), or any other exception, which the Source reports as "cannot open" / "cannot read".
    The Source applies the policy (raise, or skip and count); readers never decide it.
    """

    def __init__(self, spec: SourceSpec, fs: fsspec.AbstractFileSystem):
        self.spec = spec
        self.fs = fs
        self.field = spec.text_field or spec.tokens_field

    def num_blocks(self, path: str) -> int:
        raise NotImplementedError

    def read_block(self, path: str, block: int) -> RawBlock:
        raise NotImplementedError

    def close(self) -> None:
        pass


def describe(e: BaseException) -> str:
    """An exception as one line: its type and message."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"
