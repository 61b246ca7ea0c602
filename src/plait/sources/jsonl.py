"""JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst): one block per file.

The file is read whole and decompressed here (not by fsspec), strictly: a gzip or zstd stream that is
corrupt or truncated is an error naming the file, never a silently short (or empty) file. A file that
holds no records at all (0 bytes, a valid compressed stream of nothing, only blank lines) is reported
too ("file holds no records"): under `on_error: raise` it stops the run, under `skip` it is counted
and named like any bad file.

Fast path: Arrow's native JSON reader parses the whole file, converting only the needed field (other
keys may hold anything). If it refuses (a malformed line, a value of the wrong type), a line-by-line
pass finds exactly which records are bad so that the policy can name them.
"""

from __future__ import annotations

import gzip
import io
import json
import posixpath

import numpy as np
import pyarrow as pa
import pyarrow.json as pajson
import zstandard

from plait.errors import SourceError
from plait.media.registry import source_media
from plait.sources.multimodal import records_from_values
from plait.sources.reader import EMPTY_FILE, FormatReader, RawBlock, RawLengths, describe, int_lengths


def _compression(path: str) -> str | None:
    p = path.lower()
    if p.endswith(".gz"):
        return "gzip"
    if p.endswith(".zst"):
        return "zstd"
    return None


def decompress(data: bytes, codec: str | None) -> bytes:
    """The whole decompressed content; raises on a corrupt or truncated stream (every frame/member)."""
    if codec is None:
        return data
    if codec == "gzip":
        return gzip.decompress(data)  # BadGzipFile, EOFError (truncated), zlib.error (corrupt)
    out = []
    while data:  # a .zst file may hold several frames, one after the other
        d = zstandard.ZstdDecompressor().decompressobj()
        out.append(d.decompress(data))
        if not d.eof:
            raise EOFError("the zstd stream ends in the middle of a frame (truncated file)")
        data = d.unused_data
    return b"".join(out)


class JsonlReader(FormatReader):
    def num_blocks(self, path: str) -> int:
        return 1

    def _read_bytes(self, path: str) -> bytes:
        with self.fs.open(path, "rb") as f:
            raw = f.read()
        codec = _compression(path)
        try:
            return decompress(raw, codec)
        except Exception as e:  # zstd/gzip errors, EOFError: the file itself is bad
            raise SourceError(self.spec.name, path, None, f"cannot decompress ({codec}): {describe(e)}") from None

    def read_block(self, path: str, block: int) -> RawBlock:
        data = self._read_bytes(path)
        if not data.strip():
            raise SourceError(self.spec.name, path, None, EMPTY_FILE)
        if self.spec.multimodal:
            return self._read_records(path, data)
        try:
            table = pajson.read_json(
                io.BytesIO(data), read_options=pajson.ReadOptions(block_size=1 << 24), parse_options=self._parse_options
            )
            if self.field not in table.column_names:
                raise KeyError(self.field)
            values = table.column(self.field).combine_chunks()
            ok = self._type_ok(values.type)
        except (pa.ArrowInvalid, KeyError, pa.ArrowNotImplementedError):
            ok = False
        if ok:
            n = len(values)
            return RawBlock(0, n, np.arange(n, dtype=np.int64), values)
        # Slow path: find the bad records, one line at a time.
        lines = [ln for ln in data.split(b"\n") if ln.strip()]
        good, good_index, bad = [], [], []
        for i, line in enumerate(lines):
            try:
                rec = json.loads(line)
            except ValueError as e:
                bad.append((i, f"malformed JSON: {e}"))
                continue
            if not isinstance(rec, dict) or self.field not in rec or rec[self.field] is None:
                bad.append((i, f"missing field {self.field!r}"))
                continue
            v = rec[self.field]
            if self.spec.text_field and not isinstance(v, str):
                bad.append((i, f"field {self.field!r} is {type(v).__name__}, not a string"))
                continue
            if self.spec.tokens_field and not (isinstance(v, list) and all(isinstance(t, int) for t in v)):
                bad.append((i, f"field {self.field!r} is not a list of ints"))
                continue
            good.append(v)
            good_index.append(i)
        arr_type = pa.string() if self.spec.text_field else pa.list_(pa.int64())
        return RawBlock(0, len(lines), np.asarray(good_index, dtype=np.int64), pa.array(good, type=arr_type), bad)

    def _read_records(self, path: str, data: bytes) -> RawBlock:
        """Image-text records (LLaVA): a JSON array of records (LLaVA's .json) or JSON Lines."""
        bad: list[tuple[int, str]] = []
        if data.lstrip()[:1] == b"[":
            try:
                recs = json.loads(data)
            except ValueError as e:
                raise SourceError(self.spec.name, path, None, f"malformed JSON array: {e}") from None
        else:
            recs = []
            for i, line in enumerate(ln for ln in data.split(b"\n") if ln.strip()):
                try:
                    recs.append(json.loads(line))
                except ValueError as e:
                    bad.append((i, f"malformed JSON: {e}"))
                    recs.append(None)
        if not recs:
            raise SourceError(self.spec.name, path, None, EMPTY_FILE)
        fields = source_media(self.spec)
        texts, media, index = [], {kind.name: [] for kind, _ in fields}, []
        for i, rec in enumerate(recs):
            if rec is None:
                continue
            if not isinstance(rec, dict):
                bad.append((i, "record is not a JSON object"))
                continue
            texts.append(rec.get(self.field))
            for kind, key in fields:
                media[kind.name].append(rec.get(key))
            index.append(i)
        records, kept, more = records_from_values(texts, media, self.spec, [str(i) for i in index],
                                                  posixpath.dirname(path))
        bad += [(int(name), why) for name, why in more]
        ok_index = np.asarray(index, dtype=np.int64)[kept] if len(kept) else np.zeros(0, np.int64)
        return RawBlock(0, len(recs), ok_index, pa.array([""] * len(records), pa.string()), sorted(bad), records)

    @property
    def _parse_options(self) -> pajson.ParseOptions:
        # Only the needed field is converted; other keys are skipped however messy their types are.
        value_type = pa.string() if self.spec.text_field else pa.list_(pa.int64())
        return pajson.ParseOptions(
            explicit_schema=pa.schema([(self.field, value_type)]), unexpected_field_behavior="ignore"
        )

    def _type_ok(self, t: pa.DataType) -> bool:
        if self.spec.text_field:
            return pa.types.is_string(t) or pa.types.is_large_string(t)
        return (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)

    def read_lengths(self, path: str, block: int) -> RawLengths:
        """Only the length key is converted (the text is neither decoded into Arrow nor tokenized)."""
        data = self._read_bytes(path)
        if not data.strip():
            raise SourceError(self.spec.name, path, None, EMPTY_FILE)
        name = self.spec.length_field
        try:
            table = pajson.read_json(io.BytesIO(data), read_options=pajson.ReadOptions(block_size=1 << 24),
                                     parse_options=pajson.ParseOptions(
                                         explicit_schema=pa.schema([(name, pa.int64())]),
                                         unexpected_field_behavior="ignore"))
            return int_lengths(table.column(name).combine_chunks(), 0, name)
        except (pa.ArrowInvalid, KeyError, pa.ArrowNotImplementedError):
            pass
        lines = [ln for ln in data.split(b"\n") if ln.strip()]  # slow path: name the bad records
        values, bad = [], []
        for i, line in enumerate(lines):
            try:
                rec = json.loads(line)
            except ValueError as e:
                bad.append((i, f"malformed JSON: {e}"))
                values.append(None)
                continue
            v = rec.get(name) if isinstance(rec, dict) else None
            values.append(v if isinstance(v, int) and not isinstance(v, bool) else None)
        raw = int_lengths(pa.array(values, pa.int64()), 0, name)
        bad_rows = {i for i, _ in bad}
        raw.bad = sorted(bad + [(i, why) for i, why in raw.bad if i not in bad_rows])
        return raw
