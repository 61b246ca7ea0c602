"""A Constructor's payloads on Ray: pulled from the owning SourceLoader actors in parallel, never through
the Planner. `RayPayloads` is plait.roles.constructor.PayloadSource for the Ray runtime."""

from __future__ import annotations

import numpy as np

from plait.batch import Payload, merge_payloads
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
        return merge_fetched(items.length, list(zip(sels, parts)))

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


def merge_fetched(lengths: np.ndarray, parts: list[tuple[np.ndarray, np.ndarray | Payload]]) -> np.ndarray | Payload:
    """plait.batch.merge_payloads of the loaders' parts, each image's pixel rows copied once, by runs.

    The parts' pixels arrive as read-only views of what the loaders sent; merge_payloads would concatenate
    them and then gather every 588-byte patch row on its own (two copies, the second row by row: a fifth of
    a Constructor's build time). Here merge_payloads orders stand-ins (each part's row numbers, 8 bytes a
    row) and the pixels are copied once from where they arrived, one slice per run of consecutive rows."""
    imaged = [p.images.pixels for _, p in parts if isinstance(p, Payload) and p.images is not None]
    if not imaged:
        return merge_payloads(lengths, parts)
    bases = np.cumsum([0] + [len(x) for x in imaged])
    stand_ins, k = [], 0
    for sel, part in parts:
        if isinstance(part, Payload) and part.images is not None:
            rows = np.arange(bases[k], bases[k + 1], dtype=np.int64)[:, None]
            part = part._replace(images=part.images._replace(pixels=rows))
            k += 1
        stand_ins.append((sel, part))
    merged = merge_payloads(lengths, stand_ins)
    if merged.images is None:
        return merged
    return merged._replace(images=merged.images._replace(pixels=copy_rows(imaged, bases, merged.images.pixels[:, 0])))


def copy_rows(sources: list[np.ndarray], bases: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Rows `rows` of the sources stacked (row r of the stack is row r - bases[j] of sources[j]), copied
    once: one slice per run of consecutive rows of one source (an image's rows are one run)."""
    out = np.empty((len(rows), sources[0].shape[1]), dtype=sources[0].dtype)
    if not len(rows):
        return out
    source = np.searchsorted(bases, rows, side="right") - 1
    cut = np.flatnonzero((np.diff(rows) != 1) | (np.diff(source) != 0)) + 1
    starts, ends = np.concatenate([[0], cut]), np.concatenate([cut, [len(rows)]])
    for a, b in zip(starts.tolist(), ends.tolist()):
        j = int(source[a])
        lo = int(rows[a] - bases[j])
        out[a:b] = sources[j][lo:lo + b - a]
    return out
