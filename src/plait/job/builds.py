"""The build cache: each (generation, step, DP rank) built once, a few steps ahead of the rank's requests,
on a small pool of threads, and served cut to the asking CP rank (plait.context_parallel.shard_for_rank).

The workers are plain threads, not a concurrent.futures pool: that one refuses new work once the
interpreter starts to exit, and a node's host (plait.runtime.node_share) must keep building for the node's
other processes while its own process is finishing. Builds of different ranks overlap; what they share
(the Planner, the SourceLoader) is guarded by the caller's locks inside `build`.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future
from typing import Callable

from plait.batch import MicroBatch
from plait.context_parallel import shard_for_rank
from plait.heap import HEAP_TRIM

Key = tuple[int, int, int]  # (generation, step, dp_rank)
Built = tuple[dict | None, list[MicroBatch]]  # (state at the step's start, the rank's micro-batches)


def default_threads() -> int:
    """A few, at least 2: a build's gather holds the loader's lock only while it reads blocks; its media
    decode (on the loader's pool), packing and serialisation overlap with another rank's build."""
    return max(2, min(4, (os.cpu_count() or 2) // 2))


class BuildWorkers:
    """`threads` plain threads running queued calls; `submit` returns a Future."""

    def __init__(self, threads: int):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._work, name=f"plait-build-{i}", daemon=True)
                        for i in range(max(1, int(threads)))]
        for t in self.threads:
            t.start()

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        self.queue.put((fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(e)
            HEAP_TRIM.maybe()  # a build's freed pages back to the OS, every minute at most (plait.heap)

    def shutdown(self) -> None:
        """Cancel what has not started, finish what has."""
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self.threads:
            self.queue.put(None)
        for t in self.threads:
            t.join()


class BuildCache:
    """Builds by key with `build(gen, step, dp_rank, *extra) -> (state, batches)`. `ahead`: steps built ahead
    of a rank's request; a rank's builds more than `ahead + 1` steps behind its request are dropped
    (its other TP/PP/CP ranks may still ask for the last few). Not locked: the caller holds its lock
    around `request` and `forget`."""

    def __init__(self, build: Callable[..., Built], ahead: int, threads: int | None = None):
        self.build = build
        self.ahead = max(0, int(ahead))
        self.workers = BuildWorkers(default_threads() if threads is None else threads)
        self.builds: dict[Key, Future] = {}
        self.most = 0  # most builds held at once

    def ensure(self, key: Key, *extra) -> Future:
        """The build of `key` (`build(*key, *extra)`), queued when new."""
        fut = self.builds.get(key)
        if fut is None:
            fut = self.builds[key] = self.workers.submit(self.build, *key, *extra)
            self.most = max(self.most, len(self.builds))
        return fut

    def request(self, key: Key, ahead: Callable[[int], bool], *extra) -> Future:
        """The build of `key`, and the rank's next `ahead` steps for which `ahead(step)` holds queued
        behind it; the rank's old builds go."""
        gen, step, rank = key
        fut = self.ensure(key, *extra)
        for s in range(step + 1, step + self.ahead + 1):
            if not ahead(s):
                break
            self.ensure((gen, s, rank), *extra)
        for old in [k for k in self.builds if k[2] == rank and (k[0] != gen or k[1] < step - self.ahead - 1)]:
            self.builds.pop(old).cancel()
        return fut

    def forget(self, key: Key | None = None) -> None:
        """Drop one failed build (asked again, it is built again), or every build (a new generation)."""
        if key is not None:
            self.builds.pop(key, None)
            return
        for fut in self.builds.values():
            fut.cancel()
        self.builds.clear()

    @staticmethod
    def served(built: Built, cp: tuple[int, int], with_state: bool) -> Built:
        """A build as one CP rank receives it (state only when asked)."""
        state, batches = built
        return state if with_state else None, shard_for_rank(batches, *cp)

    def close(self) -> None:
        self.workers.shutdown()
