"""The table of file formats: which reader reads a format, and which file names are of which format."""

from __future__ import annotations

import fsspec

from plait.errors import SourceError
from plait.sources.jsonl import JsonlReader
from plait.sources.parquet import ParquetReader
from plait.sources.reader import FormatReader
from plait.spec import SourceSpec

READERS: dict[str, type[FormatReader]] = {"parquet": ParquetReader, "jsonl": JsonlReader}
FORMATS: tuple[str, ...] = tuple(READERS)

_JSONL_BASES = (".jsonl", ".json", ".ndjson")
EXTENSIONS: dict[str, tuple[str, ...]] = {
    "parquet": (".parquet", ".pq"),
    "jsonl": tuple(base + codec for base in _JSONL_BASES for codec in ("", ".gz", ".zst")),
}


def infer_format(path: str) -> str | None:
    """The format a file name's extension says (None if it says none we read)."""
    p = path.lower()
    for fmt, extensions in EXTENSIONS.items():
        if p.endswith(extensions):
            return fmt
    return None


def supported() -> str:
    """The supported formats and their extensions, for messages."""
    return "; ".join(f"{fmt} ({', '.join(EXTENSIONS[fmt])})" for fmt in FORMATS)


def reader_for(spec: SourceSpec, first_file: str, fs: fsspec.AbstractFileSystem) -> FormatReader:
    fmt = spec.format or infer_format(first_file)
    if fmt is None:
        raise SourceError(
            spec.name, first_file, None,
            f"cannot infer the format from the file name; set `format` to one of {', '.join(FORMATS)} "
            f"(supported: {supported()})",
        )
    return READERS[fmt](spec, fs)
