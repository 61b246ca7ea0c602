"""Giving freed heap pages back to the operating system in plait's long-running build loops.

A build allocates and frees megabytes per step (gathered payloads, packed token and pixel arrays, their
serialised copies) on several threads. glibc's malloc keeps what is freed inside its heaps for reuse and
returns memory to the OS only from the top of a heap: a few long-lived blocks placed above the freed
ones (a cached build, an interned string, a buffer of the next step) pin the pages below them, and the
resident size of a process that builds for weeks creeps up although its live data does not (the soak
bench measured +6 MiB/hour in Ray's Constructor, with its Python heap flat). `malloc_trim(0)` walks every
arena and releases the free pages inside them too (`madvise(MADV_DONTNEED)`), not only the top.

`HeapTrim.maybe()` does that at most once every `PLAIT_HEAP_TRIM_S` seconds (default 60; 0 turns every trim off),
called by the build workers after a build (plait.job.builds); a SourceLoader trims with `now()` each time
it has dropped 16 MiB of decoded blocks from its bounded buffer (plait.roles.source_loader), off the trainer's path and without the GIL
(ctypes releases it): a trim costs ~30 ms of CPU when it hands back ~190 MiB, less when little is free. Where the C library is not glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time

DEFAULT_EVERY_S = 60.0


def _glibc_malloc_trim():
    """glibc's `malloc_trim`, or None (another C library: musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class HeapTrim:
    """Rate-limited `malloc_trim(0)`: `maybe()` trims when `every_s` seconds have passed since the last
    trim (one caller at a time; the others return at once). `trims` counts the trims done."""

    def __init__(self, every_s: float = DEFAULT_EVERY_S):
        self.every_s = float(every_s)
        self.trim = _glibc_malloc_trim() if self.every_s > 0 else None
        self.lock = threading.Lock()
        self.last = time.monotonic()
        self.trims = 0

    @classmethod
    def from_env(cls) -> "HeapTrim":
        raw = os.environ.get("PLAIT_HEAP_TRIM_S", "")
        try:
            every = float(raw) if raw else DEFAULT_EVERY_S
        except ValueError:
            every = DEFAULT_EVERY_S  # a malformed value must not stop a build; the default applies
        return cls(every)

    @property
    def available(self) -> bool:
        return self.trim is not None

    def now(self) -> bool:
        """Trim now; True when the C library released memory. Arrow's own allocator (mimalloc or jemalloc)
        keeps the pages of freed row-group reads resident too: its unused pages go back as well."""
        if self.trim is None:
            return False
        self.trims += 1
        released = bool(self.trim(0))
        import pyarrow as pa

        pa.default_memory_pool().release_unused()
        return released

    def maybe(self) -> bool:
        """Trim when one is due; True when this call trimmed and memory was released."""
        if self.trim is None or time.monotonic() - self.last < self.every_s:
            return False
        if not self.lock.acquire(blocking=False):
            return False
        try:
            self.last = time.monotonic()
            return self.now()
        finally:
            self.lock.release()


HEAP_TRIM = HeapTrim.from_env()  # one per process: every build loop of the process shares its schedule
