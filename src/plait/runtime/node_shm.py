"""Micro-batches in shared memory: how a node's data host hands a step to the trainers on its machine.

The host (plait.runtime.node_shm_host) writes one rank's step once into a segment, a file of the node's
shared-memory file system (/dev/shm, or PLAIT_SHM_DIR): every array field of its micro-batches, one after
another at 64-byte boundaries. What the arrays are (field, offset, dtype, shape, and each micro-batch's
scalars and stats) travels beside it, over the control connection (plait.runtime.node_shm_client). A
trainer maps the segment read-only and hands out numpy views of it: no copy, no pyarrow, no socket
carrying payloads. Once mapped, the segment's name is removed (the host unlinks it when its last reader
has mapped it); its pages live on while the trainer holds a view and go with the last one.

Names: `plait-<host pid>-<job tag>-<n>`, and beside them the host's lock `plait-<host pid>-<job tag>.lock`,
which the host holds (flock) while it lives: the kernel lets go of it when the process dies, whatever PID
namespace it ran in. That is what makes crash cleanup safe: the segments of a host whose lock is free are
leftovers, and whoever meets them removes them (a new host, a rank that saw its host die:
`remove_leftovers`). A pid alone would not do: containers that share /dev/shm (`docker --ipc=host`) each
number their processes, and one would take another's live host for a dead one.
"""

from __future__ import annotations

import dataclasses
import fcntl
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from plait.batch import MicroBatch

SHM_DIR_ENV = "PLAIT_SHM_DIR"
PREFIX = "plait-"
ALIGN = 64  # every array starts on a cache line (and on any dtype's alignment)
SCALARS = ("step", "microbatch", "num_microbatches", "dp_rank")

Layout = dict[str, Any]  # one micro-batch: its scalars, stats and {field: (offset, dtype, shape) or None}


def shm_dir() -> Path | None:
    """Where segments live: PLAIT_SHM_DIR, else /dev/shm; None where there is none (then the node's ranks
    read over Flight)."""
    path = Path(os.environ.get(SHM_DIR_ENV) or "/dev/shm")
    return path if path.is_dir() and os.access(path, os.W_OK) else None


def segment_prefix(host_pid: int, job_tag: str) -> str:
    return f"{PREFIX}{host_pid}-{job_tag}-"


def host_of(name: str) -> int | None:
    """The host pid in a segment's name, or None for a file that is not a plait segment."""
    if not name.startswith(PREFIX):
        return None
    pid = name[len(PREFIX):].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def lock_path(folder: Path, prefix: str) -> Path:
    """The lock of the host whose segments start with `prefix` (`plait-<pid>-<tag>-`)."""
    return folder / (prefix.rstrip("-") + ".lock")


def hold_host_lock(folder: Path, prefix: str) -> int:
    """Take the host's lock for as long as the returned descriptor stays open (the process's life)."""
    fd = os.open(lock_path(folder, prefix), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def release_host_lock(folder: Path, prefix: str, fd: int) -> None:
    lock_path(folder, prefix).unlink(missing_ok=True)
    os.close(fd)


def host_gone(folder: Path, prefix: str, pid: int) -> bool:
    """Whether the host that wrote segments `prefix` is gone: its lock is free (or, for a segment with no
    lock beside it, its pid names no process here)."""
    from plait.job.consumers import process_alive

    try:
        fd = os.open(lock_path(folder, prefix), os.O_RDWR)
    except FileNotFoundError:
        return not process_alive(pid)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def remove_leftovers(folder: Path, only_pid: int | None = None) -> int:
    """Remove the segments (and locks) of hosts that are gone (of `only_pid`'s only, when given); how many
    segments."""
    removed, gone = 0, {}
    for path in sorted(folder.glob(PREFIX + "*")):
        pid = host_of(path.name)
        if pid is None or (only_pid is not None and pid != only_pid):
            continue
        is_lock = path.suffix == ".lock"  # a host's lock, perhaps with no segment left beside it
        prefix = path.stem + "-" if is_lock else path.name[: path.name.rindex("-") + 1]
        if prefix not in gone:
            gone[prefix] = host_gone(folder, prefix, pid)
        if gone[prefix] and not is_lock:
            try:
                path.unlink()
                removed += 1
            except OSError:
                pass  # another process removed it first
    for prefix, dead in gone.items():
        if dead:
            lock_path(folder, prefix).unlink(missing_ok=True)
    return removed


def _array_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(MicroBatch) if f.name not in SCALARS and f.name != "stats"]


ARRAY_FIELDS = _array_fields()


def write_segment(path: Path, batches: list[MicroBatch]) -> tuple[int, list[Layout]]:
    """Write the arrays of `batches` into a new segment at `path` (mode 0600; an existing file is an
    error); (its size, each micro-batch's layout). A step without array bytes gets no file (size 0)."""
    layouts, chunks, size = [], [], 0
    for mb in batches:
        fields: dict[str, tuple | None] = {}
        for name in ARRAY_FIELDS:
            a = getattr(mb, name, None)
            if a is None:
                fields[name] = None
                continue
            a = np.ascontiguousarray(a)
            fields[name] = (size, a.dtype.str, a.shape)
            if a.nbytes:
                chunks.append((size, a))
                size += -(-a.nbytes // ALIGN) * ALIGN
        layouts.append({"scalars": {k: int(getattr(mb, k)) for k in SCALARS}, "stats": mb.stats, "fields": fields})
    if size == 0:
        return 0, layouts
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        for offset, a in chunks:  # written, not mapped: the host's memory never holds the segment's pages
            view = memoryview(a.reshape(-1).view(np.uint8))
            while view:
                done = os.pwrite(fd, view, offset)
                view, offset = view[done:], offset + done
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return size, layouts


def map_segment(path: Path | None, size: int, layouts: list[Layout]) -> list[MicroBatch]:
    """The micro-batches of a segment as read-only numpy views of its mapping (`path` None when `size` is
    0). The mapping lives as long as any of the views."""
    buf = None
    if size:
        fd = os.open(path, os.O_RDONLY)
        try:
            buf = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
    batches = []
    for layout in layouts:
        kwargs: dict[str, Any] = dict(layout["scalars"])
        for name, where in layout["fields"].items():
            if where is None:
                kwargs[name] = None
                continue
            offset, dtype, shape = where
            dtype = np.dtype(dtype)
            count = int(np.prod(shape, dtype=np.int64))
            if count == 0:
                a = np.empty(shape, dtype)
                a.flags.writeable = False
            else:
                a = np.frombuffer(buf, dtype, count=count, offset=offset).reshape(shape)
            kwargs[name] = a
        kwargs["stats"] = layout["stats"] or {}
        batches.append(MicroBatch(**kwargs))
    return batches
