"""Megatron-Core indexed datasets: a `.bin` of token ids and its `.idx`, read by memory map.

A source's "file" is the pair's prefix (`corpus_text_document` for corpus_text_document.bin/.idx).
The `.idx` layout (megatron.core.datasets.indexed_dataset, `_IndexWriter`), little-endian:

    b"MMIDIDX\\x00\\x00"  uint64 version = 1  uint8 dtype code
    uint64 sequence_count  uint64 document_count
    int32 sizes[sequence_count]  int64 pointers[sequence_count]  int64 document_indices[document_count]
    [int8 modes[sequence_count]]  (multimodal datasets only)

Sequence i is sizes[i] ids of the dtype at byte pointers[i] of the `.bin`; each sequence is one
document (sample id: prefix, sequence index). Blocks are runs of BLOCK sequences, so a block is read
again from its key alone; the index gives every length, so planning never touches the `.bin`.

Checked on open (a bad pair is a whole-file error): the magic, the version, the dtype (an integer type),
the `.idx` size against its counts. Checked per sequence (a bad record): a negative size, a pointer
outside the `.bin` (the index disagrees with the data: a truncated `.bin`) or not on an id boundary.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from plait.errors import SourceError
from plait.sources.reader import FormatReader, RawBlock, RawLengths

MAGIC = b"MMIDIDX\x00\x00"
DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16),
}
HEADER = len(MAGIC) + 8 + 1 + 8 + 8
BLOCK = 4096  # sequences per block


@dataclass
class _Pair:
    sizes: np.ndarray  # int32 [n] (a view of the .idx map)
    pointers: np.ndarray  # int64 [n]
    dtype: np.dtype
    bin: np.ndarray  # uint8 map of the .bin (or its bytes, for a remote file)


class MegatronReader(FormatReader):
    MAX_OPEN = 8

    def __init__(self, spec, fs):
        super().__init__(spec, fs)
        self._open: OrderedDict[str, _Pair] = OrderedDict()

    def reads_lengths(self, path: str) -> bool:
        return True

    def num_blocks(self, path: str) -> int:
        return -(-len(self._pair(path).sizes) // BLOCK)

    def read_lengths(self, path: str, block: int) -> RawLengths:
        pair = self._pair(path)
        first, ok, bad = self._check(path, pair, block)
        return RawLengths(first, len(ok) + len(bad), ok - first, pair.sizes[ok].astype(np.int64), bad)

    def read_block(self, path: str, block: int) -> RawBlock:
        pair = self._pair(path)
        first, ok, bad = self._check(path, pair, block)
        sizes = pair.sizes[ok].astype(np.int64)
        starts = pair.pointers[ok] // pair.dtype.itemsize
        offsets = np.zeros(len(ok) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        ids = pair.bin[: len(pair.bin) - len(pair.bin) % pair.dtype.itemsize].view(pair.dtype)
        if len(ok) and np.array_equal(starts[1:], starts[:-1] + sizes[:-1]):  # contiguous: one slice, no copy
            flat = ids[starts[0] : starts[0] + offsets[-1]]
        else:
            flat = ids[np.repeat(starts - offsets[:-1], sizes) + np.arange(offsets[-1])]
        list_type = pa.large_list if offsets[-1] > np.iinfo(np.int32).max else pa.list_
        values = pa.Array.from_buffers(
            list_type(pa.from_numpy_dtype(pair.dtype)), len(ok),
            [None, pa.py_buffer(offsets.astype(np.int64 if list_type is pa.large_list else np.int32))],
            children=[pa.array(np.ascontiguousarray(flat))],
        )
        return RawBlock(first, len(ok) + len(bad), ok - first, values, bad)

    def _check(self, path: str, pair: _Pair, block: int) -> tuple[int, np.ndarray, list[tuple[int, str]]]:
        """The block's first sequence, its readable sequences (indices in the file) and the bad ones."""
        first = block * BLOCK
        stop = min(first + BLOCK, len(pair.sizes))
        sizes = pair.sizes[first:stop].astype(np.int64)
        pointers = pair.pointers[first:stop]
        item = pair.dtype.itemsize
        end = pointers + sizes * item
        bad_mask = (sizes < 0) | (pointers < 0) | (pointers % item != 0) | (end > len(pair.bin))
        bad = []
        for i in np.flatnonzero(bad_mask):
            s, p = int(sizes[i]), int(pointers[i])
            why = (f"negative size {s} in the .idx" if s < 0 else
                   f"the .idx points at bytes {p}..{p + s * item} but {path}.bin holds {len(pair.bin)} "
                   f"(the index disagrees with the data: a truncated .bin?)" if p >= 0 and p % item == 0 else
                   f"the .idx points at byte {p}, not a {pair.dtype} boundary")
            bad.append((first + int(i), why))
        ok = first + np.flatnonzero(~bad_mask).astype(np.int64)
        return first, ok, bad

    def _pair(self, path: str) -> _Pair:
        pair = self._open.get(path)
        if pair is not None:
            self._open.move_to_end(path)
            return pair
        idx = self._map(path + ".idx")
        name = self.spec.name

        def fail(reason: str):
            raise SourceError(name, path, None, reason)

        if len(idx) < HEADER or bytes(idx[: len(MAGIC)]) != MAGIC:
            fail(f"{path}.idx is not a Megatron index (no {MAGIC!r} header, or shorter than it)")
        version, code, n, docs = struct.unpack_from("<QBQQ", bytes(idx[len(MAGIC) : HEADER]))
        if version != 1:
            fail(f"{path}.idx has version {version}; only version 1 is read")
        dtype = DTYPES.get(code)
        if dtype is None:
            fail(f"{path}.idx has the unknown dtype code {code} (known: {sorted(DTYPES)})")
        if dtype.kind == "f":
            fail(f"{path}.idx stores {dtype} values, not token ids (an integer dtype)")
        expected = HEADER + 12 * n + 8 * docs
        if len(idx) not in (expected, expected + n):  # + n: the multimodal modes
            fail(f"{path}.idx holds {len(idx)} bytes; its counts ({n} sequences, {docs} documents) need "
                 f"{expected} (a truncated or corrupt index)")
        if n == 0:
            fail(f"{path}.idx lists no sequences (an empty dataset: remove it, or set on_error: skip)")
        sizes = idx[HEADER : HEADER + 4 * n].view(np.int32)
        pointers = idx[HEADER + 4 * n : HEADER + 12 * n].view(np.int64)
        pair = _Pair(sizes, pointers, dtype, self._map(path + ".bin"))
        self._open[path] = pair
        while len(self._open) > self.MAX_OPEN:
            self._open.popitem(last=False)
        return pair

    def _map(self, path: str) -> np.ndarray:
        """The whole file as uint8: memory-mapped when local, read when remote."""
        if "://" not in path:
            if not self.fs.exists(path):
                raise SourceError(self.spec.name, path, None, "no such file (a Megatron dataset is a .bin/.idx pair)")
            if self.fs.size(path) == 0:
                return np.zeros(0, dtype=np.uint8)
            return np.memmap(path, dtype=np.uint8, mode="r")
        with self.fs.open(path, "rb") as f:
            return np.frombuffer(f.read(), dtype=np.uint8)

    def close(self) -> None:
        self._open.clear()
