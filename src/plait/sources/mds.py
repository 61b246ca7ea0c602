"""MosaicML MDS shards (`streaming.MDSWriter`): a folder with index.json and shard.NNNNN.mds[.zstd].

A source's files are the shards that index.json lists (the raw shard when it is there, else the
compressed one, `zip_data`). A shard's layout (streaming/base/format/mds/writer.py), little-endian:

    uint32 num_samples  uint32 offsets[num_samples + 1]  (byte offsets of the samples from the shard start)
    the writer's config as JSON, then the samples

A sample is one uint32 size per variable-size column (`column_sizes` null), then every column's bytes
in `column_names` order. Text columns are `str` (utf-8); token columns are `ndarray:<int dtype>` (a
header byte ndim<<2 | shape dtype, the shape, the values), `ndarray:<dtype>:<n>` (the values only) or
`ndarray` (a dtype byte first). A length column is an integer scalar (`int32`, `int`, ...).

Blocks are runs of BLOCK samples of a shard. Lengths for planning come from `length_field`, or from
the offsets alone when the token column is the only variable-size one (its size fixes its count).
Checked: the header against index.json (sample count) and the file's size (a truncated shard: the
samples past its end are bad records), each sample's column sizes against its bytes, the array header
against its size, the dtype (integers only), utf-8.
"""

from __future__ import annotations

import gzip
import json
import posixpath
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from plait.errors import SourceError
from plait.sources.jsonl import decompress
from plait.sources.reader import (
    FormatReader,
    RawBlock,
    RawLengths,
    describe,
    int_lengths,
)

BLOCK = 4096
INDEX = "index.json"
SCALARS = {name: np.dtype(name) for name in ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64")}
SCALARS["int"] = np.dtype(np.int64)
ARRAY_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 32: "uint32", 33: "int32", 64: "uint64",
                65: "int64", 18: "float16", 34: "float32", 66: "float64"}


@dataclass
class _Shard:
    data: np.ndarray  # uint8, the decompressed shard
    ends: np.ndarray  # int64 [n + 1] sample offsets
    names: list[str]
    encodings: list[str]
    sizes: list[int | None]


def shard_files(fs, index_path: str) -> list[str]:
    """The shard files an index.json lists: the raw shard if present, else the compressed one."""
    with fs.open(index_path, "rb") as f:
        index = json.loads(f.read())
    folder = posixpath.dirname(index_path)
    out = []
    for entry in index["shards"]:
        raw = posixpath.join(folder, entry["raw_data"]["basename"])
        zipped = entry.get("zip_data")
        out.append(posixpath.join(folder, zipped["basename"]) if zipped and not fs.exists(raw) else raw)
    return out


class MdsReader(FormatReader):
    MAX_OPEN = 2  # decompressed shards kept (tens of MB each)

    def __init__(self, spec, fs):
        super().__init__(spec, fs)
        self._indexes: dict[str, dict[str, dict]] = {}
        self._open: OrderedDict[str, _Shard] = OrderedDict()

    def num_blocks(self, path: str) -> int:
        return -(-(len(self._shard(path).ends) - 1) // BLOCK)

    def reads_lengths(self, path: str) -> bool:
        if self.spec.length_field is not None:
            return True
        try:
            return self._derivable(self._entry(path))
        except Exception:  # a bad index: the decode path reports it
            return False

    def read_lengths(self, path: str, block: int) -> RawLengths:
        shard = self._shard(path)
        first, rows, bad = self._rows(path, shard, block)
        if self.spec.length_field is not None:
            start, size, rows = self._column(shard, rows, self.spec.length_field, bad)
            dtype = SCALARS.get(shard.encodings[shard.names.index(self.spec.length_field)])
            if dtype is None:
                raise SourceError(self.spec.name, path, None, f"length_field {self.spec.length_field!r} is not an "
                                  f"integer column (encodings: {dict(zip(shard.names, shard.encodings))})")
            values = _gather(shard.data, start, size).view(dtype) if len(start) else np.zeros(0, dtype)
            raw = int_lengths(pa.array(values), 0, self.spec.length_field)
            bad += [(int(rows[raw_i]), why) for raw_i, why in raw.bad]
            keep = raw.ok_index
            rows, lengths = rows[keep], raw.lengths
        else:
            rows, lengths = self._derived_lengths(shard, rows, bad)
        bad.sort()
        return RawLengths(first, len(rows) + len(bad), rows - first, lengths, bad)

    def read_block(self, path: str, block: int) -> RawBlock:
        shard = self._shard(path)
        first, rows, bad = self._rows(path, shard, block)
        enc = shard.encodings[shard.names.index(self.field)]
        start, size, rows = self._column(shard, rows, self.field, bad)
        if self.spec.text_field is not None:
            if enc != "str":
                raise SourceError(self.spec.name, path, None, f"text_field {self.field!r} is {enc!r}, not 'str'")
            values, rows = _strings(shard.data, start, size, rows, bad)
        else:
            values, rows = self._arrays(path, shard.data, enc, start, size, rows, bad)
        bad.sort()
        return RawBlock(first, len(rows) + len(bad), rows - first, values, bad)

    # ----- samples and columns ------------------------------------------------------------------
    def _rows(self, path: str, shard: _Shard, block: int) -> tuple[int, np.ndarray, list[tuple[int, str]]]:
        first = block * BLOCK
        stop = min(first + BLOCK, len(shard.ends) - 1)
        rows = np.arange(first, stop, dtype=np.int64)
        past = shard.ends[rows + 1] > len(shard.data)
        bad = [(int(r), (f"the offsets put the sample at bytes {shard.ends[r]}..{shard.ends[r + 1]} but the shard "
                         f"holds {len(shard.data)} (a truncated shard?)")) for r in rows[past]]
        return first, rows[~past], bad

    def _column(self, shard: _Shard, rows: np.ndarray, name: str, bad: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Byte start and size of column `name` in each sample of `rows` (those whose sizes fit)."""
        var = [i for i, s in enumerate(shard.sizes) if s is None]
        starts, ends = shard.ends[rows], shard.ends[rows + 1]
        head = 4 * len(var)
        fits = starts + head <= ends
        if len(var):
            idx = starts[:, None] + np.arange(head)[None, :]
            heads = shard.data[np.where(fits[:, None], idx, 0)].view("<u4").reshape(len(rows), len(var)).astype(np.int64)
        else:
            heads = np.zeros((len(rows), 0), np.int64)
        col_sizes = np.empty((len(rows), len(shard.sizes)), np.int64)
        for j, s in enumerate(shard.sizes):
            col_sizes[:, j] = heads[:, var.index(j)] if s is None else s
        j = shard.names.index(name)
        col_start = starts + head + col_sizes[:, :j].sum(axis=1)
        ok = fits & (starts + head + col_sizes.sum(axis=1) == ends)
        for r in rows[~ok]:
            bad.append((int(r), "the sample's column sizes disagree with its offsets (a corrupt sample)"))
        return col_start[ok], col_sizes[ok, j], rows[ok]

    def _arrays(self, path, data, enc, start, size, rows, bad) -> tuple[pa.Array, np.ndarray]:
        parts = enc.split(":")
        if parts[0] != "ndarray" or len(parts) > 3:
            raise SourceError(self.spec.name, path, None, f"tokens_field {self.field!r} is {enc!r}, not an ndarray")
        if len(parts) > 1 and np.dtype(parts[1]).kind not in "iu":
            raise SourceError(self.spec.name, path, None, f"tokens_field {self.field!r} stores {parts[1]}, not token ids")
        code = data[start] if len(parts) == 1 else np.full(len(rows), _code(parts[1]), np.int64)
        skip = (len(parts) == 1) * np.ones(len(rows), np.int64)
        if len(parts) == 3:
            count = np.full(len(rows), int(np.prod([int(d) for d in parts[2].split(",")])), np.int64)
        else:
            meta = data[np.minimum(start + skip, len(data) - 1)].astype(np.int64)
            ndim, shape_code = meta >> 2, meta & 3
            shape_bytes = 2 ** shape_code
            skip = skip + 1 + shape_bytes
            count = _uint_at(data, start + skip - shape_bytes, shape_bytes)
        item = np.array([np.dtype(ARRAY_DTYPES.get(int(c), "float64")).itemsize for c in code], np.int64) \
            if len(parts) == 1 else np.full(len(rows), np.dtype(parts[1]).itemsize, np.int64)
        good = np.isin(code, [c for c, d in ARRAY_DTYPES.items() if np.dtype(d).kind in "iu"])
        if len(parts) != 3:
            good &= ndim == 1
        good &= skip + count * item == size
        for r in rows[~good]:
            bad.append((int(r), f"the token array's header disagrees with its size or is not 1-d ints ({enc})"))
        start, count, item, code, rows = start[good] + skip[good], count[good], item[good], code[good], rows[good]
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(count, out=offsets[1:])
        flat = np.empty(int(offsets[-1]), np.int64)
        for c in np.unique(code):
            sel = np.flatnonzero(code == c)
            dt = np.dtype(ARRAY_DTYPES[int(c)]).newbyteorder("<")
            vals = _gather(data, start[sel], count[sel] * item[sel]).view(dt)
            flat[_ragged(offsets[:-1][sel], count[sel])] = vals
        values = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat))
        return values, rows

    def _derived_lengths(self, shard: _Shard, rows: np.ndarray, bad: list) -> tuple[np.ndarray, np.ndarray]:
        enc = shard.encodings[shard.names.index(self.field)].split(":")
        fixed = sum(s for s in shard.sizes if s is not None)
        if len(enc) == 3:
            return rows, np.full(len(rows), int(np.prod([int(d) for d in enc[2].split(",")])), np.int64)
        size = shard.ends[rows + 1] - shard.ends[rows] - 4 - fixed
        item = np.dtype(enc[1]).itemsize
        count = np.full(len(rows), -1, np.int64)
        for code, limit in enumerate((1 << 8, 1 << 16, 1 << 32, 1 << 63)):
            c, rem = np.divmod(size - 1 - 2 ** code, item)
            lower = 0 if code == 0 else 1 << (8 * 2 ** (code - 1))
            fit = (rem == 0) & (c >= max(lower, 1)) & (c < limit) & (count < 0)
            count[fit] = c[fit]
        for r in rows[count < 0]:
            bad.append((int(r), "the sample's size fits no token array of its encoding (a corrupt sample)"))
        return rows[count >= 0], count[count >= 0]

    def _derivable(self, entry: dict) -> bool:
        names, encodings, sizes = entry["column_names"], entry["column_encodings"], entry["column_sizes"]
        enc = encodings[names.index(self.field)].split(":")
        if enc[0] != "ndarray" or len(enc) == 1 or np.dtype(enc[1]).kind not in "iu":
            return False
        return len(enc) == 3 or sum(s is None for s in sizes) == 1

    # ----- files --------------------------------------------------------------------------------
    def _entry(self, path: str) -> dict:
        folder, base = posixpath.split(path)
        entries = self._indexes.get(folder)
        if entries is None:
            try:
                with self.fs.open(posixpath.join(folder, INDEX), "rb") as f:
                    index = json.loads(f.read())
                entries = {}
                for e in index["shards"]:
                    for key in ("raw_data", "zip_data"):
                        if e.get(key):
                            entries[e[key]["basename"]] = e
            except Exception as e:
                raise SourceError(self.spec.name, path, None, f"cannot read {INDEX} beside it: {describe(e)}") from None
            self._indexes[folder] = entries
        entry = entries.get(base)
        if entry is None:
            raise SourceError(self.spec.name, path, None, f"not listed in {posixpath.join(folder, INDEX)}")
        return entry

    def _shard(self, path: str) -> _Shard:
        shard = self._open.get(path)
        if shard is not None:
            self._open.move_to_end(path)
            return shard
        entry = self._entry(path)
        name = self.spec.name

        def fail(reason: str):
            raise SourceError(name, path, None, reason)

        if entry.get("format", "mds") != "mds":
            fail(f"index.json says format {entry.get('format')!r}, not 'mds'")
        for column in (self.field, self.spec.length_field):
            if column is not None and column not in entry["column_names"]:
                fail(f"no column {column!r} (columns: {entry['column_names']})")
        if not path.endswith(".mds"):
            codec = (entry.get("compression") or "").split(":")[0]
            with self.fs.open(path, "rb") as f:
                raw = f.read()
            try:
                if codec == "zstd":
                    raw = decompress(raw, "zstd")
                elif codec == "gz":
                    raw = gzip.decompress(raw)
                else:
                    fail(f"compression {codec!r} is not read (zstd, gz); decompress the shards first")
            except SourceError:
                raise
            except Exception as e:
                fail(f"cannot decompress ({codec}): {describe(e)}")
            data = np.frombuffer(raw, np.uint8)
        elif "://" not in path and self.fs.size(path) > 0:
            data = np.memmap(path, dtype=np.uint8, mode="r")
        else:
            with self.fs.open(path, "rb") as f:
                data = np.frombuffer(f.read(), np.uint8)
        if len(data) < 8:
            fail(f"holds {len(data)} bytes: not an MDS shard (truncated?)")
        n = int(data[:4].view("<u4")[0])
        if n != entry["samples"]:
            fail(f"the shard holds {n} samples; index.json says {entry['samples']}")
        if len(data) < 4 * (n + 2):
            fail(f"the sample offsets run past the shard's end ({len(data)} bytes; a truncated shard)")
        ends = data[4 : 4 * (n + 2)].view("<u4").astype(np.int64)
        if ends[0] < 4 * (n + 2) or np.any(np.diff(ends) < 0):
            fail("the sample offsets are not increasing from the header's end (a corrupt shard)")
        if n == 0:
            fail("the shard holds no samples (remove it from index.json, or set on_error: skip)")
        shard = _Shard(data, ends, entry["column_names"], entry["column_encodings"], entry["column_sizes"])
        self._open[path] = shard
        while len(self._open) > self.MAX_OPEN:
            self._open.popitem(last=False)
        return shard

    def close(self) -> None:
        self._open.clear()


def _code(dtype: str) -> int:
    return {d: c for c, d in ARRAY_DTYPES.items()}[np.dtype(dtype).name]


def _ragged(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated ranges starts[i] .. starts[i] + counts[i]."""
    total = int(counts.sum())
    return np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) + np.arange(total)


def _gather(data: np.ndarray, start: np.ndarray, size: np.ndarray) -> np.ndarray:
    return data[_ragged(start, size)] if len(start) else np.zeros(0, np.uint8)


def _uint_at(data: np.ndarray, at: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Little-endian unsigned ints of 1, 2, 4 or 8 bytes at byte offsets `at` (0 where out of range)."""
    out = np.zeros(len(at), np.int64)
    for k in range(8):
        has = (k < nbytes) & (at + k < len(data))
        out[has] |= data[at[has] + k].astype(np.int64) << (8 * k)
    return out


def _strings(data, start, size, rows, bad) -> tuple[pa.Array, np.ndarray]:
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(size, out=offsets[1:])
    values = pa.LargeStringArray.from_buffers(len(rows), pa.py_buffer(offsets), pa.py_buffer(_gather(data, start, size)))
    try:
        values.validate(full=True)
        return values, rows
    except pa.ArrowInvalid:
        pass
    keep = []
    for i, r in enumerate(rows):
        try:
            bytes(data[start[i] : start[i] + size[i]]).decode("utf-8")
            keep.append(i)
        except UnicodeDecodeError as e:
            bad.append((int(r), f"text is not utf-8: {e}"))
    keep = np.asarray(keep, np.int64)
    return values.take(pa.array(keep)), rows[keep]
