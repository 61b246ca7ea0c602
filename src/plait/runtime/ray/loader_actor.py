"""The SourceLoader actor: a plait.roles.source_loader.SourceLoader owning some partitions of some sources,
behind a lock (the loader and its format readers are not thread-safe), plus `LoaderConfig`, the one
recipe every loader actor of a job (first ones, cold replacements, shadows) is started from.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import numpy as np

from plait.runtime.placement import LoaderLayout, loader_name
from plait.runtime.ray.common import actor_options, process_rss, ray_module, use_numpy_kernels
from plait.runtime.ray.pixel_rows import set_apart
from plait.spec import load_spec


def partitions_of(owned: list[tuple[int, int]], num_partitions: dict[int, int]) -> dict[int, tuple[int, set[int]]]:
    """(source, partition) pairs as SourceLoader's `partitions`: {source: (partitions, owned ones)}."""
    parts: dict[int, tuple[int, set[int]]] = {}
    for s, p in owned:
        parts.setdefault(s, (num_partitions[s], set()))[1].add(p)
    return parts


class LoaderActor:
    """A SourceLoader owning some partitions of some sources."""

    def __init__(self, spec_dict: dict, owned: list[tuple[int, int]], num_partitions: dict[int, int],
                 max_cached_blocks: int):
        use_numpy_kernels()
        from plait.roles.source_loader import SourceLoader
        from plait.sources.workers import resolve_workers

        spec = load_spec(spec_dict)
        cpus = ray_module().get_runtime_context().get_assigned_resources().get("CPU")  # its pool's size, when given
        self.loader = SourceLoader(spec, max_cached_blocks=max_cached_blocks, partitions=partitions_of(owned, num_partitions),
                                   workers=resolve_workers(spec.loading.workers, cpus=cpus))
        self.lock = threading.Lock()  # SourceLoader and its readers are not thread-safe

    def num_files(self) -> dict[int, int]:
        return self.loader.num_files()

    def first_keys(self, sources: list[int]) -> dict[int, tuple[int, int, int]]:
        with self.lock:
            return {s: self.loader.first_key(s) for s in sources}

    def block_meta(self, source: int, key):
        with self.lock:
            return self.loader.block_meta(source, tuple(key))

    # A gather's request, (source, keys, block_index, position, offset, length) as SourceLoader.gather
    # takes them, comes as ONE argument: Ray serializes each argument of a call on its own (a 256 KiB
    # msgpack buffer for each, and for each non-msgpack object in it: every array, every key tuple) and
    # the receiver reads each with a 1 MiB one; one tuple is pickled once. Per call 1.45x less of the
    # caller's CPU and 1.2x less of the loader's (benchmarks/ray_call_args.py, docs/soak.md).

    def gather(self, request: tuple) -> np.ndarray:
        with self.lock:
            return self.loader.gather(*request)

    def gather_payload(self, request: tuple):
        """Tokens and the requested documents' images, decoded here, once (plait.batch.Payload). Only the
        first half (tokens, and the media found in the blocks) holds the lock; the decode runs after it on
        the loader's pool, so the actor's other calls (up to max_concurrency gathers) read their blocks while
        it decodes and the pool stays busy between gathers, as in the local runtime."""
        with self.lock:
            gathered = self.loader.gather_media(*request)
        return self.loader.decode_gathered(gathered)

    def gather_batch(self, requests: list[tuple], images: bool) -> list:
        """`gather` (or `gather_payload` with `images`) of each request, in order: one Constructor's
        requests that waited for its previous call to this loader, sent as one call
        (plait.runtime.ray.payloads.LoaderCalls says why)."""
        serve = self.gather_payload if images else self.gather
        return [serve(request) for request in requests]

    def gather_images(self, requests: list[tuple], apart_bytes: int) -> tuple[list, list | None]:
        """`gather_batch` of image requests as two returns (called with num_returns=2): the answers,
        and their pixels when they add up to more than `apart_bytes` (then each answer's pixels name
        their entry there). The caller reads only the first: the pixels go to the trainer without it
        (plait.runtime.ray.pixel_rows)."""
        return set_apart(self.gather_batch(requests, True), apart_bytes)

    def retain(self, live, drawn=None) -> None:
        with self.lock:
            mine = {k for k in live if k[0] in self.loader.sources}
            self.loader.retain(mine, None if drawn is None else {k for k in drawn if k[0] in self.loader.sources})

    def stats(self) -> dict:
        with self.lock:
            return {"blocks_read": self.loader.blocks_read, "cached_bytes": self.loader.cached_bytes,
                    "images_decoded": self.loader.images_decoded,
                    "sources": sorted(self.loader.sources), "pid": os.getpid(), "rss": process_rss()}

    def telemetry(self) -> dict:
        """SourceLoader.telemetry() (buffer, busy ratio, skipped), for the job's /metrics. A scrape waits at
        most a second for a long gather to finish, then reads without the lock (plain numbers)."""
        locked = self.lock.acquire(timeout=1.0)
        try:
            return self.loader.telemetry()
        finally:
            if locked:
                self.lock.release()

    def error_report(self) -> dict:
        with self.lock:
            return self.loader.error_report(records=True)

    def close(self) -> None:
        with self.lock:
            self.loader.close()

    # differential checkpoints, for this loader's shadows (plait.state.deltas)
    def checkpoint_delta(self, step: int | None = None) -> dict:
        with self.lock:
            return self.loader.checkpoint_delta(step)

    def checkpoint_snapshot(self, step: int | None = None) -> dict:
        with self.lock:
            return self.loader.checkpoint_snapshot(step)


@dataclass(frozen=True)
class LoaderConfig:
    """What loader k of a job is made of (its partitions of the layout) and how its actor is placed."""

    job: str
    spec_dict: dict
    layout: LoaderLayout
    max_cached_blocks: int = 256
    cpus: float = 0  # CPUs each loader actor reserves (0: placement by spreading only)
    lifetime: str | None = None  # "detached" in a shared job: the loaders outlive their Planner
    version: int = 0  # the layout version (plait.runtime.ray.routing): 0 at start, +1 per rescale

    @classmethod
    def from_options(cls, job: str, spec_dict: dict, layout: LoaderLayout, options: dict) -> LoaderConfig:
        return cls(job, spec_dict, layout, int(options.get("max_cached_blocks", 256)),
                   options.get("loader_cpus", 0), options.get("lifetime"))

    def args(self, k: int) -> tuple:
        """LoaderActor's (and ShadowActor's first) constructor arguments for loader k."""
        return self.spec_dict, self.layout.owned[k], self.layout.num_partitions, self.max_cached_blocks

    def options(self, name: str | None = None) -> dict:
        """Actor options of a loader (named) or a shadow (unnamed, not detached: it dies with its Planner)."""
        return actor_options(name, self.lifetime if name else None, num_cpus=self.cpus, max_concurrency=4,
                             scheduling_strategy="SPREAD")

    def name(self, k: int, generation: int = 0) -> str:
        """Loader k's actor name; a later layout version's loaders get names of their own (`@v2`), so
        starting them never finds a retiring loader of the same index by name."""
        return loader_name(self.job, k, generation) + (f"@v{self.version}" if self.version else "")

    def start(self, k: int, generation: int = 0, name: str | None = None):
        """Start (or, by name, find) loader k's actor; a replacement has the next generation's name.
        `name`: the name it runs under already (a successor Planner finds a handed-over loader by it)."""
        ray = ray_module()
        name = name or self.name(k, generation)
        return ray.remote(LoaderActor).options(**self.options(name)).remote(*self.args(k))
