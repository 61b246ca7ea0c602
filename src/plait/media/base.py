"""What every medium shares: its error type, the decode counter and opening a container with PyAV.

Bad media are `MediaError` (a PlaitError: the CLI prints one line): the message starts with the name the
caller gave (a path, a tar member, a Parquet row) and says what is wrong. A Source wraps it in a SourceError
naming source, shard and record, and applies its bad-record policy; nothing here skips or substitutes.
"""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import threading
from typing import BinaryIO

from plait.errors import PlaitError

__all__ = ["DecodeCounter", "MediaData", "MediaError", "describe", "ffmpeg_reason", "field_media", "open_container", "peek"]

MediaData = bytes | bytearray | memoryview | str | os.PathLike | BinaryIO  # bytes, a local path, or a file-like


class MediaError(PlaitError):
    """A media file that cannot be used (empty, corrupt, truncated, unsupported). One line, naming it;
    with no `name` (a decoder that does not know where its bytes came from) the reader that called it
    puts the media's name in front (sources/multimodal.py)."""

    def __init__(self, name: str, reason: str):
        self.name, self.reason = name, reason
        super().__init__(f"{name}: {reason}" if name else reason)


class DecodeCounter:
    """A thread-safe count, read as `count`: decode passes or decoded frames, so a test can assert that
    planning added none."""

    def __init__(self):
        self._n = 0
        self._lock = threading.Lock()

    def add(self, n: int = 1) -> None:
        with self._lock:
            self._n += n

    @property
    def count(self) -> int:
        return self._n


def field_media(value, root: str | None, kind: str) -> list[bytes | str]:
    """A record's media field (images, videos, audio) as data: None -> none; a path, bytes, Hugging Face's
    {"bytes" | "path"} struct, or a list of them; relative paths joined to `root`. ValueError naming `kind`
    for anything else."""
    if value is None:
        return []
    out: list[bytes | str] = []
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, dict):
            v = v.get("bytes") if v.get("bytes") is not None else v.get("path")
        if isinstance(v, (bytes, bytearray)):
            out.append(bytes(v))
        elif isinstance(v, str) and v:
            out.append(v if (root is None or "://" in v or posixpath.isabs(v)) else posixpath.join(root, v))
        else:
            raise ValueError(f"{kind} field holds {type(v).__name__}, not a path or {kind} bytes")
    return out


def describe(data: MediaData, name: str | None) -> str:
    """The name errors use: the caller's, else the path, else what kind of object it came from."""
    if name:
        return name
    if isinstance(data, (str, os.PathLike)):
        return os.fspath(data)
    return getattr(data, "path", None) or getattr(data, "name", None) or f"<{type(data).__name__}>"


def _size(data: MediaData) -> int | None:
    """Bytes in `data`, where that is cheap to learn (a seekable file-like is put back where it was)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return memoryview(data).nbytes
    if isinstance(data, (str, os.PathLike)):
        return os.path.getsize(data)
    try:
        here = data.tell()
        end = data.seek(0, io.SEEK_END)
        data.seek(here)
        return end - here
    except (AttributeError, OSError, ValueError):
        return None


def peek(data: MediaData, start: int, length: int) -> tuple[bytes, int] | None:
    """`length` bytes of `data` from `start` (negative: from the end) and its size, for checks of a
    container's framing its headers cannot make; None for a stream that cannot seek. A file-like is put
    back where it was, and counts from there."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data).cast("B")
        begin = max(0, view.nbytes + start if start < 0 else start)
        return bytes(view[begin:begin + length]), view.nbytes
    if isinstance(data, (str, os.PathLike)):
        try:
            with open(data, "rb") as f:
                return peek(f, start, length)
        except OSError:  # open_container names what is wrong
            return None
    try:
        here = data.tell()
        size = data.seek(0, io.SEEK_END) - here
        data.seek(here + max(0, size + start if start < 0 else start))
        chunk = data.read(length)
        data.seek(here)
        return chunk, size
    except (AttributeError, OSError, ValueError):
        return None


@contextlib.contextmanager
def open_container(data: MediaData, name: str):
    """PyAV's input container for `data`, closed on exit (a file-like is then put back where it was, so
    that a probe and a later decode read the same bytes); a missing, empty or unreadable file is a
    MediaError."""
    try:
        import av
    except ImportError:
        raise MediaError(name, "media sources need PyAV: pip install 'plait[video]'") from None
    try:
        size = _size(data)
    except OSError as e:
        raise MediaError(name, f"cannot read: {e.strerror or e}") from None
    if size == 0:
        raise MediaError(name, "empty file (0 bytes)")
    if isinstance(data, (bytes, bytearray, memoryview)):
        source, start = io.BytesIO(data), None
    elif isinstance(data, (str, os.PathLike)):
        source, start = os.fspath(data), None
    else:
        source, start = data, data.tell()
    try:
        container = av.open(source, mode="r")
    except av.error.FFmpegError as e:
        raise MediaError(name, f"not a readable media file ({ffmpeg_reason(e)})") from None
    try:
        yield container
    finally:
        container.close()
        if start is not None:
            data.seek(start)


def ffmpeg_reason(error) -> str:
    """FFmpeg's own words for a failure, without the file name it repeats."""
    return getattr(error, "strerror", None) or str(error).split(":")[0] or type(error).__name__
