"""plait.heap: freed heap pages handed back to the OS, rate-limited, and called by the build workers."""

from __future__ import annotations

import threading

import psutil
import pytest

from plait.heap import HeapTrim
from plait.job import builds


def test_trim_releases_pages_pinned_below_live_blocks():
    """glibc keeps freed blocks below a live one; malloc_trim(0) releases their pages (RSS falls)."""
    trim = HeapTrim(every_s=3600)
    if not trim.available:
        pytest.skip("not glibc: the trim is a no-op")
    proc = psutil.Process()
    blocks = [bytes(1000) + bytes([i % 256]) for i in range(200_000)]  # ~200 MiB of malloc'd (not pymalloc) blocks
    pinned = blocks[::64]  # one live block in every ~64 KiB keeps the heap's top where it is
    del blocks
    before = proc.memory_info().rss
    assert trim.now()
    after = proc.memory_info().rss
    assert before - after > 100 * 2**20, (before >> 20, after >> 20)
    assert len(pinned) == 3125 and trim.trims == 1


def test_maybe_is_rate_limited_and_off_with_zero(monkeypatch):
    trim = HeapTrim(every_s=3600)
    assert not trim.maybe() and trim.trims == 0  # not due: created just now
    trim.last -= 3601
    trim.maybe()
    assert trim.trims == (1 if trim.available else 0)
    assert not trim.maybe()  # due again only an hour later
    monkeypatch.setenv("PLAIT_HEAP_TRIM_S", "0")
    off = HeapTrim.from_env()
    assert not off.available and not off.now()
    monkeypatch.setenv("PLAIT_HEAP_TRIM_S", "twelve")
    assert HeapTrim.from_env().every_s == 60.0


def test_build_workers_trim_after_builds(monkeypatch):
    """Every build worker asks for a trim after each call (the trim itself decides whether one is due)."""
    asked = []

    class Counting:
        def maybe(self):
            asked.append(threading.current_thread().name)
            return False

    monkeypatch.setattr(builds, "HEAP_TRIM", Counting())
    workers = builds.BuildWorkers(2)
    try:
        assert [workers.submit(pow, 2, k).result() for k in range(5)] == [1, 2, 4, 8, 16]
    finally:
        workers.shutdown()
    assert len(asked) == 5 and all(name.startswith("plait-build-") for name in asked)
