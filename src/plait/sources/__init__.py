"""Format readers and the Source (shards, deterministic order, decoded blocks).

Modules, imported in a line (no circle): base (Source) -> formats (the format table) ->
jsonl, parquet (readers) -> reader (RawBlock, FormatReader).
"""

from __future__ import annotations

from plait.sources.base import BlockKey, DocBlock, Source
from plait.sources.formats import FORMATS, infer_format, reader_for

__all__ = ["FORMATS", "BlockKey", "DocBlock", "Source", "infer_format", "reader_for"]
