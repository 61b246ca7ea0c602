"""Format readers and the Source (shards, deterministic order, decoded blocks)."""

from __future__ import annotations

from plait.errors import SourceError
from plait.sources.base import BlockKey, DocBlock, Source
from plait.spec import SourceSpec


def infer_format(path: str) -> str | None:
    p = path.lower()
    if p.endswith((".parquet", ".pq")):
        return "parquet"
    if p.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".ndjson")):
        return "jsonl"
    return None


def reader_for(spec: SourceSpec, first_file: str, fs):
    from plait.sources.jsonl import JsonlReader
    from plait.sources.parquet import ParquetReader

    fmt = spec.format or infer_format(first_file)
    if fmt is None:
        raise SourceError(spec.name, first_file, None, "cannot infer the format from the extension; set `format`")
    return {"parquet": ParquetReader, "jsonl": JsonlReader}[fmt](spec, fs)


__all__ = ["BlockKey", "DocBlock", "Source", "infer_format", "reader_for"]
