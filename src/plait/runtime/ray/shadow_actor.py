"""The shadow actor: a standby SourceLoader for the same partitions as its primary (plait.roles.shadow).

It follows the primary's differential checkpoints (decoding the blocks the primary buffers) and serves
nothing until the Planner `promote`s it, after which it is the partitions' owner, a LoaderActor like any
other. When shadows start, follow and take over is plait.runtime.ray.recovery.
"""

from __future__ import annotations

import threading

from plait.runtime.ray.common import ray_module, use_numpy_kernels
from plait.runtime.ray.loader_actor import LoaderActor, LoaderConfig, partitions_of
from plait.spec import load_spec


class ShadowActor(LoaderActor):
    """A standby loader for the same partitions as its primary; a LoaderActor once promoted."""

    def __init__(self, spec_dict: dict, owned: list[tuple[int, int]], num_partitions: dict[int, int],
                 max_cached_blocks: int, primary: str):
        use_numpy_kernels()
        from plait.roles.shadow import ShadowLoader

        self.loader = ShadowLoader(load_spec(spec_dict), max_cached_blocks=max_cached_blocks,
                                   partitions=partitions_of(owned, num_partitions), primary=primary)
        self.lock = threading.Lock()

    def follow(self, delta: dict) -> int:
        with self.lock:
            return self.loader.follow(delta) if self.loader.standby else 0

    def sync(self, snapshot: dict) -> int:
        with self.lock:
            return self.loader.sync(snapshot) if self.loader.standby else 0

    def promote(self) -> dict:
        with self.lock:
            return self.loader.promote()

    def shadow_stats(self) -> dict:
        with self.lock:
            ld = self.loader
            return {"deltas": ld.deltas_applied, "delta_bytes": ld.delta_bytes, "prefetched": ld.blocks_prefetched,
                    "standby": ld.standby, "buffered": len(ld.buffered_keys())}


def start_shadow(config: LoaderConfig, k: int, primary: str):
    """Start a shadow of loader k (whose actor is named `primary`)."""
    ray = ray_module()
    return ray.remote(ShadowActor).options(**config.options()).remote(*config.args(k), primary)
