"""The preprocessing pool of one SourceLoader: threads for the work that releases the GIL.

What a loader spends its CPU on, per delivered byte: decoding and resizing images (Pillow releases the
GIL in decode and resize), patchifying them (numpy copies), reading Parquet/Arrow (pyarrow reads on its
own thread pool) and tokenizing (`tokenizers`' batch encode runs on its own Rayon threads). So threads are
enough: the pool runs a gather's image decodes at once, each into its own slice of the payload's pixel
buffer, and the result is the same bytes in the same places for any number of workers (the batches and
their digests do not depend on `loading.workers`). Nothing here holds the GIL long enough to need
processes.

Not a concurrent.futures pool: that one refuses new work once the interpreter starts to exit, and a
node's host (plait.runtime.node_share) keeps serving the node's other processes while its own finishes.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def resolve_workers(setting: str | int, cpus: float | None = None, env: dict | None = None) -> int:
    """`loading.workers` as a thread count. A number is taken as it is; `auto` is the CPUs left after
    the trainers: `cpus` when the caller was given a CPU budget (a Ray actor's CPUs), else this
    machine's CPUs less the node's trainer processes (torchrun's LOCAL_WORLD_SIZE, else this one
    process); at least 1."""
    if setting != "auto":
        return max(1, int(setting))
    if cpus is not None and cpus > 0:
        return max(1, int(cpus))
    env = os.environ if env is None else env
    try:
        trainers = int(env.get("LOCAL_WORLD_SIZE", 1))
    except ValueError:
        trainers = 1
    return max(1, available_cpus() - max(trainers, 1))


class WorkerPool:
    """`map(fn, items)`: fn over items on `workers` daemon threads, results in item order; the first
    exception (in item order) is raised after every call has ended. With one worker fn runs inline."""

    def __init__(self, workers: int):
        self.workers = max(1, int(workers))
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.closed = False
        self.starting = threading.Lock()  # several builds may map at once (their gathers decode concurrently)

    def _start(self) -> None:
        with self.starting:
            while len(self.threads) < self.workers:
                t = threading.Thread(target=self._work, name=f"plait-preprocess-{len(self.threads)}", daemon=True)
                t.start()
                self.threads.append(t)

    def _work(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            fn, item, results, k, done = job
            try:
                results[k] = (True, fn(item))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread, in item order
                results[k] = (False, e)
            done.release()

    def map(self, fn: Callable[[Any], Any], items: Sequence) -> list:
        if self.workers == 1 or len(items) <= 1 or self.closed:
            return [fn(item) for item in items]
        self._start()
        results: list = [None] * len(items)
        done = threading.Semaphore(0)
        for k, item in enumerate(items):
            self.queue.put((fn, item, results, k, done))
        for _ in items:
            done.acquire()
        for ok, value in results:
            if not ok:
                raise value
        return [value for _, value in results]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for _ in self.threads:
            self.queue.put(None)
