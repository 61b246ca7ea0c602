"""A Constructor's payloads on Ray: pulled from the owning SourceLoader actors in parallel, never through
the Planner. `RayPayloads` is plait.roles.constructor.PayloadSource for the Ray runtime."""

from __future__ import annotations

import numpy as np

from plait.runtime.placement import PartitionMap
from plait.runtime.ray.common import dead_errors, get
from plait.runtime.ray.routing import Route


class RayPayloads:
    """A Constructor's payloads (plait.roles.constructor.PayloadSource), pulled from the owning loader
    actors in parallel, routed by `route` (plait.runtime.ray.routing.Route: the layout version, its
    PartitionMap and loader handles; updated with each build order). A gather that finds its loader dead
    (it died, or its layout was retired by a rescale) gets the current routing from the Planner and is
    repeated there: loaders decode a block the same whoever owns it."""

    def __init__(self, route: Route, planner=None):
        self.route = route
        self.planner = planner  # asked to replace a loader found dead (None: errors propagate)

    def fetch(self, items):
        """Tokens (text), or a Payload (tokens and images) when an item holds images: the images are
        decoded in the owning loader actors' gather (roles/constructor.py has the contract)."""
        if not len(items):
            return np.zeros(0, dtype=np.int32)
        while True:
            out = self._fetch(items, *self.route.now)
            if out is not None:
                return out

    def _fetch(self, items, version: int, pmap: PartitionMap, loaders: list):
        """The payload routed by one routing version, or None when a loader was dead (the routing was
        refreshed: ask again)."""
        from plait.batch import merge_payloads

        keys, block_index = items.block_keys()
        owner_of_block = np.array([pmap.loader_of(k[0], k[1], k[2]) for k in keys], dtype=np.int64)
        owner = owner_of_block[block_index]
        images = items.has_images
        refs, sels, owners = [], [], []
        for k in np.unique(owner):
            sel = np.flatnonzero(owner == k)
            sels.append(sel)
            owners.append((int(k), loaders[int(k)]))
            refs.append(self._gather(loaders[int(k)], items, keys, block_index, sel, images))
        parts = self._collect(refs, owners, version)
        if parts is None:
            return None
        if len(parts) == 1:
            return parts[0]
        return merge_payloads(items.length, list(zip(sels, parts)))

    @staticmethod
    def _gather(handle, items, keys, block_index, sel, images: bool = False):
        call = handle.gather_payload if images else handle.gather
        return call.remote((items.source[sel], keys, block_index[sel], items.position[sel],  # one argument:
                            items.offset[sel], items.length[sel]))  # LoaderActor.gather says why

    def _collect(self, refs, owners, version: int) -> list | None:
        """Each loader's part; None after a loader was found dead (the Planner replaced it, or it belonged
        to a retired layout) and the routing was refreshed."""
        try:
            return get(refs)
        except dead_errors():
            if self.planner is None:
                raise
        for ref, (k, handle) in zip(refs, owners):
            try:
                get(ref)
            except dead_errors():
                self.route.update(get(self.planner.replace_loader.remote(k, handle, version)))
                return None
        return None  # every part answered on a second look (a transient error): ask again
