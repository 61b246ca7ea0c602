"""The table of file formats: which reader reads a format, and which file names are of which format."""

from __future__ import annotations

import posixpath

import fsspec

from plait.errors import SourceError
from plait.sources.arrow import ArrowReader
from plait.sources.jsonl import JsonlReader
from plait.sources.mds import MdsReader
from plait.sources.megatron import MegatronReader
from plait.sources.parquet import ParquetReader
from plait.sources.reader import FormatReader
from plait.sources.webdataset import WebDatasetReader
from plait.spec import SourceSpec

READERS: dict[str, type[FormatReader]] = {
    "parquet": ParquetReader, "jsonl": JsonlReader, "megatron": MegatronReader, "arrow": ArrowReader, "mds": MdsReader,
    "webdataset": WebDatasetReader,
}
FORMATS: tuple[str, ...] = tuple(READERS)

_JSONL_BASES = (".jsonl", ".json", ".ndjson")
EXTENSIONS: dict[str, tuple[str, ...]] = {
    "parquet": (".parquet", ".pq"),
    "jsonl": tuple(base + codec for base in _JSONL_BASES for codec in ("", ".gz", ".zst")),
    "megatron": (".idx", ".bin"),
    "arrow": (".arrow",),
    "mds": (".mds", ".mds.zstd", ".mds.gz"),
    "webdataset": (".tar",),
}
# Metadata files that sit beside the data of a format (not data themselves): a Hugging Face
# `save_to_disk` folder's state.json and dataset_info.json; an MDS folder's index.json.
METADATA: dict[str, str | None] = {"state.json": None, "dataset_info.json": None, "index.json": "mds"}


def infer_format(path: str) -> str | None:
    """The format a file name says (None if it says none we read). An MDS folder's index.json says mds."""
    p = path.lower()
    base = posixpath.basename(p)
    if base in METADATA:
        return METADATA[base]
    for fmt, extensions in EXTENSIONS.items():
        if p.endswith(extensions):
            return fmt
    return None


def supported() -> str:
    """The supported formats and their extensions, for messages."""
    return "; ".join(f"{fmt} ({', '.join(EXTENSIONS[fmt])})" for fmt in FORMATS)


def reader_for(spec: SourceSpec, first_file: str, fs: fsspec.AbstractFileSystem) -> FormatReader:
    fmt = spec.format or infer_format(first_file)
    if fmt is None and fs.exists(first_file + ".idx"):  # a Megatron prefix names no file itself
        fmt = "megatron"
    if fmt is None:
        raise SourceError(
            spec.name, first_file, None,
            f"cannot infer the format from the file name; set `format` to one of {', '.join(FORMATS)} "
            f"(supported: {supported()})",
        )
    return READERS[fmt](spec, fs)
