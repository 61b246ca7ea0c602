"""What every format reader shares: the block it returns (RawBlock) and its interface (FormatReader).

Kept apart from `base` (the Source) and `formats` (the table of readers) so that the imports form a
line, never a circle: base -> formats -> jsonl, parquet -> reader.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import fsspec
import numpy as np
import pyarrow as pa

from plait.spec import SourceSpec

EMPTY_FILE = "file holds no records (an empty file: remove it, or set on_error: skip)"
STREAM_BLOCK = (1 << 20, 8 << 20)  # bounds of a remote handle's read-ahead block (a quarter of buffer_mb within them)


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
    records: list | None = None  # image sources: MMRecords aligned with ok_index (sources/multimodal.py)


@dataclass
class RawLengths:
    """What a format reader returns for one block when planning asks only for sizes: each readable
    record's token count (bos/eos not included), read from a stored length column or the format's own
    index, never from the token or text column. Same records and `bad` convention as RawBlock."""

    first_row: int
    num_records: int
    ok_index: np.ndarray  # int64, increasing
    lengths: np.ndarray  # int64, aligned with ok_index
    bad: list[tuple[int, str]] = field(default_factory=list)  # (record index in file, reason)


class OpenStreams:
    """The readers a SourceLoader keeps open between the blocks of a run (a Parquet row group read in
    row ranges), at most `limit` (loading.max_open_streams), the least recently used closed first.

    An open row-range reader holds its current data page and dictionary (~1.3 MiB at pyarrow's default
    1 MiB pages), which is what would otherwise grow with the number of sources. A closed one is opened
    again at its next block and reads its row group up to there again: decode time, no memory, and the
    same rows (reading is deterministic). `reopened` / `rows_reread` count that cost."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.open: OrderedDict[tuple[int, str], dict] = OrderedDict()  # (reader, file) -> its open cursor
        self.reopened = 0
        self.rows_reread = 0

    def use(self, key: tuple[int, str], cursor: dict) -> None:
        """`cursor` (a reader's open state, a dict) stays open; the least recently used beyond the limit
        are closed (cleared)."""
        self.open[key] = cursor
        self.open.move_to_end(key)
        while self.limit is not None and len(self.open) > self.limit:
            _, oldest = self.open.popitem(last=False)
            oldest.clear()

    def done(self, key: tuple[int, str]) -> None:
        self.open.pop(key, None)


class FormatReader:
    """Reads blocks of one file format. Subclasses: ParquetReader, JsonlReader, MegatronReader,
    ArrowReader, MdsReader.

    A file that cannot be read as a whole (corrupt, truncated, not of the format, empty, missing the
    field) makes `num_blocks` or `read_block` raise: a SourceError naming the file (and the record
    where known), or any other exception, which the Source reports as "cannot open" / "cannot read".
    The Source applies the policy (raise, or skip and count); readers never decide it.
    """

    def __init__(self, spec: SourceSpec, fs: fsspec.AbstractFileSystem):
        self.spec = spec
        self.fs = fs
        self.field = spec.text_field or spec.tokens_field
        self.streams = OpenStreams()  # this reader's own, until share_open_streams gives the loader's

    def share_open_streams(self, streams: OpenStreams) -> None:
        """Count this reader's open row-range readers against `streams` (the SourceLoader's limit)."""
        self.streams = streams

    def open_stream(self, path: str):
        """A handle for reading a file in pieces whose read-ahead is bounded by the source's buffer: a
        remote filesystem's default is not (s3fs reads ahead in 50 MiB blocks, per open file)."""
        low, high = STREAM_BLOCK
        block = int(min(max(self.spec.buffer_bytes // 4, low), high))
        try:
            return self.fs.open(path, "rb", block_size=block, cache_type="readahead")
        except TypeError:  # a filesystem whose files take no block size or cache: its own default
            return self.fs.open(path, "rb")

    def num_blocks(self, path: str) -> int:
        raise NotImplementedError

    def read_block(self, path: str, block: int) -> RawBlock:
        raise NotImplementedError

    def block_runs(self, path: str) -> np.ndarray | None:
        """Blocks that are read in sequence (a Parquet row group read in row ranges): the length of each
        run, in file order; the Source shuffles runs, never the blocks inside one. None: every block alone."""
        return None

    def reads_lengths(self, path: str) -> bool:
        """Whether `read_lengths` gives the record lengths of a block of `path` without reading its
        tokens (a `length_field` is set, or the format's index holds them)."""
        return self.spec.length_field is not None

    def read_lengths(self, path: str, block: int) -> RawLengths:
        raise NotImplementedError(f"{type(self).__name__} reads no length column")

    def image_head(self, path: str, ref, n: int) -> tuple[bytes, bool]:
        """The first `n` bytes of an image (inline bytes, or a file path) and whether that is all of it.
        WebDataset overrides it (a reference there is a member of the shard)."""
        if isinstance(ref, bytes):
            return ref, True
        with self._open_image(ref) as f:
            head = f.read(n)
        return head, len(head) < n

    def image_bytes(self, path: str, ref) -> bytes:
        """All of an image's bytes (to decode at gather time)."""
        if isinstance(ref, bytes):
            return ref
        with self._open_image(ref) as f:
            return f.read()

    def _open_image(self, ref: str):
        """An image file, for reading bytes: a local path (no URL scheme, no storage options) with Python's
        `open`, anything else through fsspec. fsspec's open of a local file is Python: 42 us against open's
        10 us (a 60 KB JPEG, measured), on the decode pool's threads where every stretch of Python holds the
        GIL that the other threads' Pillow calls wait to take back."""
        if "://" not in ref and not self.spec.storage_options:
            return open(ref, "rb")
        return fsspec.open(ref, "rb", **self.spec.storage_options)

    def video_input(self, path: str, ref):
        """What FFmpeg opens for a video: a local path as is (a probe then reads only its headers), else
        its bytes (inline, or read whole through fsspec). WebDataset overrides it (a shard's member)."""
        if isinstance(ref, bytes) or ("://" not in ref and not self.spec.storage_options):
            return ref
        return self.image_bytes(path, ref)

    def close(self) -> None:
        pass


def int_lengths(values: pa.Array, first_row: int, name: str) -> RawLengths:
    """A stored length column as RawLengths: nulls, negatives and non-integers are bad records."""
    if not pa.types.is_integer(values.type):
        raise TypeError(f"length_field {name!r} is {values.type}, not an integer")
    n = len(values)
    valid = np.ones(n, dtype=bool) if values.null_count == 0 else ~np.asarray(values.is_null().to_numpy(zero_copy_only=False))
    lengths = np.asarray(values.fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
    bad = [(first_row + int(i), f"length_field {name!r} is null") for i in np.flatnonzero(~valid)]
    neg = valid & (lengths < 0)
    bad += [(first_row + int(i), f"length_field {name!r} is negative ({int(lengths[i])})") for i in np.flatnonzero(neg)]
    ok = np.flatnonzero(valid & ~neg).astype(np.int64)
    bad.sort()
    return RawLengths(first_row, n, ok, lengths[ok], bad)


def describe(e: BaseException) -> str:
    """An exception as one line: its type and message."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"
