"""A video container cut short whose headers still read: caught while planning from the sizes it states.

The video medium's probe (media/video.py, `VideoMedium.probe`) runs `check_size` before FFmpeg's. FFmpeg's
probe reads the headers only, and `media.video.probe` demuxes the last keyframe's packets;
a file cut by a few hundred bytes (a faststart MP4 whose `mdat` lost its tail, a Matroska file missing
its last cluster's end) passes both, plans, and is found only when its frames are decoded at gather,
where the sample is dropped from a step whose loss normaliser already counted it. The containers say
how long they are, so comparing that with the file's size costs a few header reads:

  ISO BMFF (MP4, MOV)  every top-level box (`ftyp`, `moov`, `mdat`, ...) must end inside the file, and so
                       must every track's last sample (`moov`'s sample tables: chunk offsets `stco`/`co64`,
                       samples per chunk `stsc`, sample sizes `stsz`);
  Matroska, WebM       the Segment's stated size must end inside the file (unless it says "unknown");
  AVI                  the RIFF header's size must end inside the file.

Anything else, or headers too odd to read, is left to FFmpeg: this check only ever adds a reason.
"""

from __future__ import annotations

import io
import os
import struct

import numpy as np

from plait.media.base import MediaData as VideoData
from plait.media.image_policy import BadVideo

BMFF_TOP = {b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot", b"uuid", b"styp", b"moof", b"mfra", b"meta"}
BMFF_PATH = (b"trak", b"mdia", b"minf", b"stbl")  # where moov's sample tables live
MOOV_MAX = 256 << 20  # a moov larger than this is not read (its boxes' sizes are still checked)
EBML_ID, SEGMENT_ID = b"\x1a\x45\xdf\xa3", b"\x18\x53\x80\x67"


def check_size(data: VideoData) -> None:
    """BadVideo when the container's stated sizes reach past the end of the file (module docstring). It only
    ever adds a reason: a file it cannot read this way (unseekable, headers too short to parse) is left to
    `probe`, which names what is wrong with it."""
    try:
        stated_sizes_fit(data)
    except (OSError, EOFError, struct.error, ValueError, OverflowError, MemoryError):
        return


def stated_sizes_fit(data: VideoData) -> None:
    """check_size's reading, which raises what the file's bytes make it raise."""
    with _opened(data) as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        head = f.read(16)
        if head[4:8] in BMFF_TOP:
            _check_bmff(f, size)
        elif head[:4] == EBML_ID:
            _check_matroska(f, size)
        elif head[:4] == b"RIFF" and len(head) >= 8:
            _say_if_past(8 + struct.unpack("<I", head[4:8])[0], size, "its RIFF header")


def _say_if_past(end: int, size: int, what: str) -> None:
    if end > size:
        raise BadVideo(f"{what} ends at byte {end} but the file holds {size} bytes: truncated")


class _opened:
    """A seekable binary file over bytes, a local path or a file object (whose position is put back)."""

    def __init__(self, data: VideoData):
        self.data, self.f, self.pos = data, None, None

    def __enter__(self):
        if isinstance(self.data, (bytes, bytearray, memoryview)):
            self.f = io.BytesIO(self.data)
        elif isinstance(self.data, str):
            self.f = open(self.data, "rb")
        else:
            self.f, self.pos = self.data, self.data.tell()
        return self.f

    def __exit__(self, *exc):
        if self.pos is None:
            self.f.close()
        else:
            self.f.seek(self.pos)


def _boxes(f, start: int, end: int):
    """(type, payload start, box end) of the boxes between `start` and `end`; stops at an unreadable
    header (a size below 8, a 0 size running to the end is returned with `end`)."""
    pos = start
    while pos + 8 <= end:
        f.seek(pos)
        header = f.read(16)
        if len(header) < 8:
            return
        size, kind = struct.unpack(">I4s", header[:8])
        body = pos + 8
        if size == 1 and len(header) == 16:
            size, body = struct.unpack(">Q", header[8:16])[0], pos + 16
        elif size == 0:
            size = end - pos
        if size < body - pos:
            return
        yield kind, body, pos + size
        pos += size


def _check_bmff(f, size: int) -> None:
    for kind, body, box_end in _boxes(f, 0, size):
        if box_end > size:
            _say_if_past(box_end, size, f"its {kind.decode('latin-1')!r} box")
        if kind == b"moov" and box_end - body <= MOOV_MAX:
            last = _data_end(f, body, box_end)
            if last is not None and last > size:
                raise BadVideo(f"its sample table says its samples end at byte {last} but the file holds {size} "
                               "bytes: truncated")
        if box_end >= size:
            return


def _data_end(f, start: int, end: int, depth: int = 0) -> int | None:
    """Where the last sample of moov's tracks ends: per sample table (stbl), each chunk's offset (stco,
    co64) plus the sizes (stsz) of the samples it holds (stsc); the largest over the tracks."""
    last = None
    for kind, body, box_end in _boxes(f, start, end):
        if depth == len(BMFF_PATH) - 1 and kind == BMFF_PATH[-1]:
            found = _table_end({k: (b, e) for k, b, e in _boxes(f, body, box_end)}, f)
        elif depth < len(BMFF_PATH) - 1 and kind == BMFF_PATH[depth]:
            found = _data_end(f, body, box_end, depth + 1)
        else:
            continue
        if found is not None:
            last = found if last is None else max(last, found)
    return last


def _full_box(f, where: tuple[int, int], head: int, entry: str, per_entry: int = 1) -> tuple[tuple, np.ndarray]:
    """A full box's `head` header fields (after version and flags; the last one the entry count) and its
    table: `per_entry` values of type `entry` per entry, flat."""
    body, end = where
    f.seek(body + 4)
    fields = struct.unpack(f">{head}I", f.read(4 * head))
    count = fields[-1]
    dtype = np.dtype(">" + entry)
    table = np.frombuffer(f.read(max(0, min(count * per_entry * dtype.itemsize, end - f.tell()))), dtype)
    return fields, table


def _table_end(boxes: dict, f) -> int | None:
    offsets_box = boxes.get(b"stco") or boxes.get(b"co64")
    if offsets_box is None or b"stsc" not in boxes or b"stsz" not in boxes:
        return None
    _, offsets = _full_box(f, offsets_box, 1, "u4" if b"stco" in boxes else "u8")
    _, runs = _full_box(f, boxes[b"stsc"], 1, "u4", per_entry=3)
    (constant, count), sizes = _full_box(f, boxes[b"stsz"], 2, "u4")
    if not len(offsets) or len(runs) < 3:
        return None
    runs = runs[: len(runs) // 3 * 3].reshape(-1, 3).astype(np.int64)  # first chunk (1-based), samples, desc
    first = runs[:, 0] - 1
    per_run = np.diff(np.append(first, len(offsets))).clip(min=0)
    per_chunk = np.repeat(runs[:, 1], per_run)[: len(offsets)]
    if constant:  # every sample the same size: no table (a count read from a corrupt box can be huge)
        if per_chunk.sum() > count:
            return int(offsets.max())
        chunk_bytes = per_chunk.astype(np.int64) * int(constant)
        return int((offsets.astype(np.int64) + chunk_bytes).max())
    sizes = sizes.astype(np.int64)
    if per_chunk.sum() > len(sizes):
        return int(offsets.max())  # a table the sizes do not cover: the offsets alone
    bounds = np.concatenate([[0], np.cumsum(per_chunk)])
    chunk_bytes = np.diff(np.concatenate([[0], np.cumsum(sizes)])[bounds])
    return int((offsets.astype(np.int64) + chunk_bytes).max())


def _vint(f) -> tuple[int, bool]:
    """An EBML variable-size integer: its value, and whether it is the reserved 'unknown size'."""
    first = f.read(1)
    if not first:
        raise EOFError
    b = first[0]
    length = 8 - b.bit_length() + 1
    if b == 0 or length > 8:
        raise EOFError
    rest = f.read(length - 1)
    value = b & ((1 << (8 - length)) - 1)
    for c in rest:
        value = (value << 8) | c
    return value, value == (1 << (7 * length)) - 1


def _check_matroska(f, size: int) -> None:
    try:
        f.seek(4)
        header, _ = _vint(f)
        f.seek(f.tell() + header)
        if f.read(4) != SEGMENT_ID:
            return
        length, unknown = _vint(f)
    except EOFError:
        return
    if not unknown:
        _say_if_past(f.tell() + length, size, "its Segment")
