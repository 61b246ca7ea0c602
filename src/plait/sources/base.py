"""A source: its shards, its deterministic order, and decoded blocks of documents.

Order. A source's documents come in a fixed, seed-determined order per epoch:
files (shards) are shuffled, each file's blocks (Parquet row groups; a whole JSONL file) are shuffled,
and each block's rows are shuffled. A position in that order is a *block key*
(epoch, file_pos, block_pos) plus a row position inside the block; a cursor is exactly that, four
integers. Nothing is indexed up front: a file's footer is read when the order first reaches it.

Blocks. `read_block(key)` returns a DocBlock: the block's documents, tokenized, in shuffled order, as one
flat int32 token array with offsets, plus each document's data coordinates (shard, row in the file),
which become its sample id. Bad records are dropped from the block (policy `skip`, counted) or raise
(policy `raise`) with source, shard and record named.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import fsspec
import numpy as np
import pyarrow as pa

from plait.errors import SourceError
from plait.spec import SourceSpec
from plait.transforms.tokenize import TextEncoder, add_special_tokens

BlockKey = tuple[int, int, int]  # (epoch, file_pos, block_pos)


def _rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in key])))


@dataclass
class DocBlock:
    """Decoded documents of one block, in the source's shuffled order.

    Document i (in shuffled order) is tokens[starts[i] : starts[i] + lengths[i]], sample id
    (shard, rows[i]), at shuffled position positions[i]. `tokens` stays in file order (for token-id
    sources it is the Arrow buffer itself, zero-copy); only the small index arrays are shuffled.
    Positions of dropped (bad) records are absent from `positions`.
    """

    source: int
    key: BlockKey
    shard: int
    positions: np.ndarray  # int64 [n] shuffled positions of kept docs (increasing)
    rows: np.ndarray  # int64 [n] row index inside the file
    tokens: np.ndarray  # int32 flat, file order
    starts: np.ndarray  # int64 [n]
    lengths: np.ndarray  # int64 [n]
    num_positions: int  # shuffled positions in the block, bad records included (what a cursor counts)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.tokens, self.starts, self.lengths, self.rows, self.positions))


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
    """Reads blocks of one file format. Subclasses: ParquetReader, JsonlReader."""

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


class Source:
    """One source's files, order, and block decoding. Cheap to create: lists files, reads nothing."""

    def __init__(self, spec: SourceSpec, index: int, seed: int):
        from plait.sources import reader_for  # late: formats register there

        self.spec = spec
        self.index = index
        self.name = spec.name
        self.seed = seed
        self.files, self.fs = _list_files(spec)
        self.reader: FormatReader = reader_for(spec, self.files[0], self.fs)
        self.encoder = _make_encoder(spec)
        self._num_blocks: dict[int, int] = {}
        self._file_orders: OrderedDict[int, np.ndarray] = OrderedDict()
        self.errors: Counter[str] = Counter()
        self.error_log: list[str] = []
        self._seen_bad: set[tuple[str, str | None]] = set()

    # ----- order -------------------------------------------------------------------------------
    def file_order(self, epoch: int) -> np.ndarray:
        order = self._file_orders.get(epoch)
        if order is None:
            order = _rng(self.seed, self.index, epoch).permutation(len(self.files))
            self._file_orders[epoch] = order
            while len(self._file_orders) > 2:
                self._file_orders.popitem(last=False)
        return order

    def num_blocks(self, file_idx: int) -> int:
        n = self._num_blocks.get(file_idx)
        if n is None:
            path = self.files[file_idx]
            try:
                n = self.reader.num_blocks(path)
            except SourceError as e:  # e.g. the column is missing: the policy decides, as for any bad shard
                self._bad(path, e.record, e.reason)
                n = 0
            except Exception as e:  # corrupt footer, unreadable file, ...
                self._bad(path, None, f"cannot open: {_describe(e)}")
                n = 0
            self._num_blocks[file_idx] = n
        return n

    def block_order(self, epoch: int, file_idx: int) -> np.ndarray:
        return _rng(self.seed, self.index, epoch, file_idx, 0x5EED).permutation(self.num_blocks(file_idx))

    def first_key(self, epoch: int = 0) -> BlockKey:
        return self._settle((epoch, 0, 0))

    def next_key(self, key: BlockKey) -> BlockKey:
        epoch, fpos, bpos = key
        return self._settle((epoch, fpos, bpos + 1))

    def _settle(self, key: BlockKey) -> BlockKey:
        """Move a key past file ends (and epoch ends) to the next block that exists."""
        epoch, fpos, bpos = key
        scanned = 0
        while True:
            if fpos >= len(self.files):
                epoch, fpos, bpos = epoch + 1, 0, 0
            file_idx = int(self.file_order(epoch)[fpos])
            if bpos < self.num_blocks(file_idx):
                return (epoch, fpos, bpos)
            fpos, bpos = fpos + 1, 0
            scanned += 1
            if scanned > len(self.files):
                raise SourceError(self.name, None, None, "no readable blocks in any file" + self._skipped_hint())

    # ----- decoding ----------------------------------------------------------------------------
    def read_block(self, key: BlockKey) -> DocBlock:
        epoch, fpos, bpos = key
        file_idx = int(self.file_order(epoch)[fpos])
        block_idx = int(self.block_order(epoch, file_idx)[bpos])
        path = self.files[file_idx]
        try:
            raw = self.reader.read_block(path, block_idx)
        except SourceError:
            raise
        except Exception as e:
            self._bad(path, f"block {block_idx}", f"cannot read: {_describe(e)}")
            raw = self._empty_raw()
        for record, reason in raw.bad:
            self._bad(path, str(record), reason)
        values = raw.values
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        ok_index = raw.ok_index
        null_mask = _null_mask(values)
        values, ok_index = self._drop(values, ok_index, null_mask, path, raw.first_row,
                                      f"field {self.reader.field!r} is null or missing")
        if self.encoder is None and _is_int_list(values.type):
            for mask, reason in _bad_token_lists(values):
                values, ok_index = self._drop(values, ok_index, mask, path, raw.first_row, reason)
        try:
            tokens, offsets = self._tokens(values, path, raw.first_row)
        except SourceError as e:  # wrong column type, ids out of range: the whole block is bad
            self._bad(path, e.record or f"block {block_idx}", e.reason)
            raw, ok_index = self._empty_raw(), np.zeros(0, np.int64)
            tokens, offsets = self._tokens(raw.values, path, 0)
        # Shuffle over every record position of the block, bad ones included, so that a record's
        # position never depends on which other records were readable.
        perm = _rng(self.seed, self.index, epoch, file_idx, block_idx + 1).permutation(raw.num_records)
        position_of_record = np.empty(raw.num_records, dtype=np.int64)
        position_of_record[perm] = np.arange(raw.num_records, dtype=np.int64)
        kept_pos = position_of_record[ok_index]
        order = np.argsort(kept_pos, kind="stable")
        return DocBlock(
            source=self.index,
            key=key,
            shard=file_idx,
            positions=kept_pos[order],
            rows=raw.first_row + ok_index[order].astype(np.int64),
            tokens=tokens,
            starts=offsets[:-1][order],
            lengths=np.diff(offsets)[order],
            num_positions=raw.num_records,
        )

    def _drop(self, values: pa.Array, ok_index: np.ndarray, bad: np.ndarray, path: str, first_row: int, reason: str):
        """Report the records flagged in `bad` (policy: raise, or skip and count) and leave them out."""
        if not bad.any():
            return values, ok_index
        for i in np.flatnonzero(bad):
            self._bad(path, str(first_row + int(ok_index[i])), reason)
        keep = np.flatnonzero(~bad)
        return values.take(pa.array(keep)), ok_index[keep]

    def _tokens(self, values: pa.Array, path: str, first_row: int) -> tuple[np.ndarray, np.ndarray]:
        if self.encoder is not None:
            if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
                raise SourceError(self.name, path, None, f"text_field {self.reader.field!r} is {values.type}, not a string")
            flat, offsets = self.encoder.encode(values)
        else:
            if not (pa.types.is_list(values.type) or pa.types.is_large_list(values.type)):
                raise SourceError(
                    self.name, path, None, f"tokens_field {self.reader.field!r} is {values.type}, not a list of ints"
                )
            if not pa.types.is_integer(values.type.value_type):
                raise SourceError(self.name, path, None, f"tokens_field values are {values.type.value_type}, not ints")
            offsets = np.asarray(values.offsets.to_numpy(), dtype=np.int64)
            child = values.values
            flat = child.to_numpy(zero_copy_only=False)
            base = offsets[0]
            flat = flat[base : offsets[-1]]
            offsets = offsets - base
            if flat.dtype != np.int32:
                if len(flat) and (flat.min() < 0 or flat.max() > np.iinfo(np.int32).max):
                    raise SourceError(self.name, path, None, "token ids out of int32 range")
                flat = flat.astype(np.int32)
        return add_special_tokens(flat, offsets, self.spec.bos, self.spec.eos)

    def _skipped_hint(self) -> str:
        if not self.error_log:
            return ""
        return f" ({self.errors['skipped']} skipped; first: {self.error_log[0]})"

    def _empty_raw(self) -> RawBlock:
        value_type = pa.string() if self.encoder is not None else pa.list_(pa.int32())
        return RawBlock(0, 0, np.zeros(0, np.int64), pa.array([], value_type))

    # ----- errors ------------------------------------------------------------------------------
    def _bad(self, path: str, record: str | None, reason: str) -> None:
        err = SourceError(self.name, path, record, reason)
        if self.spec.on_error == "raise":
            raise err
        # Count each bad record (or shard) once, however often it is read again (next epochs, a block
        # evicted from the cache and decoded again, a resume), so the count is a fact about the data.
        where = (path, record)
        if where in self._seen_bad:
            return
        self._seen_bad.add(where)
        self.errors["skipped"] += 1
        if len(self.error_log) < 100:
            self.error_log.append(str(err))

    def close(self) -> None:
        self.reader.close()


def _is_int_list(t: pa.DataType) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)


def _bad_token_lists(values: pa.Array) -> list[tuple[np.ndarray, str]]:
    """Per-record masks of token lists holding a null or an id outside 0..2^31-1, with the reason.

    Vectorised: one pass over the ids; only a block that has such ids pays for finding their records.
    """
    offsets = np.asarray(values.offsets.to_numpy(), dtype=np.int64)
    ids = values.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    n = len(values)
    out = []

    def records(token_mask: np.ndarray) -> np.ndarray:
        owner = np.repeat(np.arange(n), np.diff(offsets))
        mask = np.zeros(n, dtype=bool)
        mask[owner[token_mask]] = True
        return mask

    if ids.null_count:
        out.append((records(_null_mask(ids)),
                    "token list holds a null id"))
        ids = ids.fill_null(0)
    flat = ids.to_numpy(zero_copy_only=False)
    if len(flat) and (flat.min() < 0 or flat.max() > np.iinfo(np.int32).max):
        out.append((records((flat < 0) | (flat > np.iinfo(np.int32).max)), "token id out of range 0..2^31-1"))
    return out


def _make_encoder(spec: SourceSpec) -> TextEncoder | None:
    if not spec.text_field:
        return None
    try:
        return TextEncoder(spec.tokenizer, spec.storage_options)
    except Exception as e:  # missing or invalid tokenizer.json: a problem with this source, named as such
        raise SourceError(spec.name, None, None, f"cannot load tokenizer {spec.tokenizer!r}: {_describe(e)}") from None


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def _list_files(spec: SourceSpec) -> tuple[list[str], fsspec.AbstractFileSystem]:
    files: list[str] = []
    fs = None
    for pattern in spec.paths:
        try:
            fs_i, _ = fsspec.core.url_to_fs(pattern, **spec.storage_options)
        except Exception as e:  # unknown protocol, its package missing, bad storage_options
            raise SourceError(spec.name, pattern, None, f"cannot open the filesystem: {_describe(e)}") from None
        fs = fs or fs_i
        try:
            if any(ch in pattern for ch in "*?["):
                matches = fs_i.glob(pattern)
            elif fs_i.isdir(pattern):
                matches = _data_files(fs_i.find(pattern), spec)
            elif fs_i.exists(pattern):
                matches = [pattern]
            else:
                raise SourceError(spec.name, pattern, None, "no such file or folder")
        except SourceError:
            raise
        except Exception as e:
            raise SourceError(spec.name, pattern, None, f"cannot list: {type(e).__name__}: {e}") from None
        protocol = fs_i.protocol if isinstance(fs_i.protocol, str) else fs_i.protocol[0]
        for m in matches:
            files.append(m if protocol in ("file", "local") or "://" in m else f"{protocol}://{m}")
    files = sorted(set(files))
    if not files:
        raise SourceError(spec.name, ", ".join(spec.paths), None, "matches no files (empty source)")
    return files, fs


def _data_files(paths: list[str], spec: SourceSpec) -> list[str]:
    """The files of a folder that hold this source's data: those of its format (by extension)."""
    from plait.sources import infer_format

    kinds = {p: infer_format(p) for p in paths}
    formats = {k for k in kinds.values() if k is not None}
    if spec.format is None and len(formats) > 1:
        raise SourceError(spec.name, None, None, f"the folder holds several formats {sorted(formats)}; set `format`")
    wanted = spec.format or (formats.pop() if formats else None)
    return [p for p, k in kinds.items() if k is not None and k == wanted]


def _null_mask(values: pa.Array) -> np.ndarray:
    """Which entries are null, read straight from the validity bitmap (nothing to do without nulls)."""
    n = len(values)
    if values.null_count == 0:
        return np.zeros(n, dtype=bool)
    bitmap = values.buffers()[0]
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), bitorder="little")
    return bits[values.offset : values.offset + n] == 0

