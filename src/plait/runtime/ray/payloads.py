"""A Constructor's payloads on Ray: pulled from the owning SourceLoader actors in parallel, never through
the Planner. `RayPayloads` is plait.roles.constructor.PayloadSource for the Ray runtime."""

from __future__ import annotations

import threading

import numpy as np

from plait.batch import Payload, merge_payloads
from plait.runtime.placement import PartitionMap
from plait.runtime.ray.common import dead_errors, get
from plait.runtime.ray.pixel_rows import PIXELS_APART_BYTES, Apart, PixelRows, copy_runs
from plait.runtime.ray.routing import Route


class RayPayloads:
    """A Constructor's payloads (plait.roles.constructor.PayloadSource), pulled from the owning loader
    actors in parallel, routed by `route` (plait.runtime.ray.routing.Route: the layout version, its
    PartitionMap and loader handles; updated with each build order). A gather that finds its loader dead
    (it died, or its layout was retired by a rescale) gets the current routing from the Planner and is
    repeated there: loaders decode a block the same whoever owns it."""

    def __init__(self, route: Route, planner=None, pixels_apart: int | None = None):
        self.route = route
        self.planner = planner  # asked to replace a loader found dead (None: errors propagate)
        self.calls = LoaderCalls(PIXELS_APART_BYTES if pixels_apart is None else int(pixels_apart))

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
            refs.append(self.calls.submit(loaders[int(k)], request_of(items, keys, block_index, sel), images))
        parts = self._collect(refs, owners, version)
        if parts is None:
            return None
        if len(parts) == 1:
            return parts[0]
        return merge_fetched(items.length, list(zip(sels, parts)))

    def _collect(self, gathers: list["Gather"], owners, version: int) -> list | None:
        """Each loader's part; None after a loader was found dead (the Planner replaced it, or it belonged
        to a retired layout) and the routing was refreshed."""
        try:
            return [self.calls.result(g) for g in gathers]
        except dead_errors():
            if self.planner is None:
                raise
        finally:
            self.calls.settle(gathers)
        for g, (k, handle) in zip(gathers, owners):
            try:
                self.calls.result(g)
            except dead_errors():
                self.route.update(get(self.planner.replace_loader.remote(k, handle, version)))
                return None
        return None  # every part answered on a second look (a transient error): ask again


def request_of(items, keys, block_index, sel) -> tuple:
    """A gather's request for the items `sel`: (source, keys, block_index, position, offset, length), one
    tuple (LoaderActor.gather says why)."""
    return (items.source[sel], keys, block_index[sel], items.position[sel], items.offset[sel], items.length[sel])


class Gather:
    """One request's place in a call to a loader: set once the call that carries it is sent."""

    def __init__(self, request: tuple):
        self.request = request
        self.sent = threading.Event()
        self.call: LoaderCall | None = None
        self.index = 0


class LoaderCall:
    """One call to a loader carrying several requests: its answer, read once for all of them, and whether
    the loader's next call went out. `pixels`: an image call's second return, the pixels it sent apart
    (never read here: plait.runtime.ray.pixel_rows)."""

    def __init__(self, key: tuple, ref, pixels=None):
        self.key, self.ref, self.pixels = key, ref, pixels
        self.reading = threading.Lock()
        self.answer: tuple | None = None  # (answers, None) or (None, the error)
        self.done = False


class LoaderCalls:
    """A Constructor's gathers, at most one call in flight per loader: the requests for a loader that arrive
    while its call is out (the other ranks' builds of the step, on their own threads) go together in the
    next call, sent as soon as the current call's answer is read. A call costs the loader, the Constructor
    and the raylet a few CPU ms whatever it carries (serialisation; the object store's create, seal, map and
    free: benchmarks/ray_inline_returns.py), about a millisecond per image when each call carried one
    rank's three images. No timer: a request that finds its loader idle is sent at once. Each request gets
    the answer a call of its own would have had (LoaderActor.gather_batch serves them in order). Whoever
    submits must `result` or `settle` every gather, in the order of the loaders' indices (RayPayloads
    does): a loader's next call waits for its current one to be read."""

    def __init__(self, pixels_apart: int = PIXELS_APART_BYTES):
        self.pixels_apart = pixels_apart  # an image call's pixels above this many bytes go apart
        self.lock = threading.Lock()
        self.waiting: dict[tuple, list[Gather]] = {}
        self.busy: set[tuple] = set()

    def submit(self, handle, request: tuple, images: bool) -> Gather:
        gather = Gather(request)
        key = (handle, images)  # an actor handle hashes as its actor
        with self.lock:
            self.waiting.setdefault(key, []).append(gather)
            idle = key not in self.busy
            self.busy.add(key)
        if idle:
            self._send(key)
        return gather

    def _send(self, key: tuple) -> None:
        """Send what waits for this loader as one call (the caller holds its turn), or leave it idle."""
        with self.lock:
            batch = self.waiting.pop(key, [])
            if not batch:
                self.busy.discard(key)
                return
        handle, images = key
        requests = [g.request for g in batch]
        if images:
            call = LoaderCall(key, *handle.gather_images.options(num_returns=2).remote(requests, self.pixels_apart))
        else:
            call = LoaderCall(key, handle.gather_batch.remote(requests, False))
        for i, gather in enumerate(batch):
            gather.call, gather.index = call, i
            gather.sent.set()

    def _finish(self, call: LoaderCall) -> None:
        with self.lock:
            first, call.done = not call.done, True
        if first:
            self._send(call.key)

    def result(self, gather: Gather):
        """The answer to `gather`'s request (its loader's error raised)."""
        gather.sent.wait()
        call = gather.call
        try:
            with call.reading:
                if call.answer is None:
                    try:
                        call.answer = (get(call.ref), None)
                    except BaseException as e:  # noqa: BLE001 - every request of the call gets it
                        call.answer = (None, e)
        finally:
            self._finish(call)
        answers, error = call.answer
        if error is not None:
            raise error
        return placed(answers[gather.index], call.pixels)

    def settle(self, gathers: list[Gather]) -> None:
        """Let the loaders of gathers whose answers are not wanted (a fetch that failed) take their next call."""
        for gather in gathers:
            gather.sent.wait()
            self._finish(gather.call)


def placed(answer, pixels_ref):
    """A loader's answer whose pixels went apart (pixel_rows.Apart) with a PixelRows standing for them."""
    images = getattr(answer, "images", None)
    if images is None or not isinstance(images.pixels, Apart):
        return answer
    apart = images.pixels
    rows = PixelRows.of_source((pixels_ref, apart.index), apart.rows, apart.width, apart.dtype)
    return answer._replace(images=images._replace(pixels=rows))


def merge_fetched(lengths: np.ndarray, parts: list[tuple[np.ndarray, np.ndarray | Payload]]) -> np.ndarray | Payload:
    """plait.batch.merge_payloads of the loaders' parts, each image's pixel rows copied once, by runs, or
    not at all where a part's pixels went apart (then the merged pixels are a PixelRows).

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
    rows = merged.images.pixels[:, 0]
    if any(isinstance(x, PixelRows) for x in imaged):
        return merged._replace(images=merged.images._replace(pixels=place_rows(imaged, rows)))
    return merged._replace(images=merged.images._replace(pixels=copy_rows(imaged, bases, rows)))


def copy_rows(sources: list[np.ndarray], bases: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Rows `rows` of the sources stacked (row r of the stack is row r - bases[j] of sources[j]), copied
    once: one slice per run of consecutive rows of one source (an image's rows are one run)."""
    return copy_runs(sources, bases, rows, sources[0].shape[1], sources[0].dtype)


def place_rows(parts: list, rows: np.ndarray) -> PixelRows:
    """Rows `rows` of the parts' pixels stacked (arrays, or PixelRows of pixels sent apart), placed: a
    PixelRows over every part's sources, nothing copied."""
    sources, counts, lookup, offset = [], [], [], 0
    for p in parts:
        if isinstance(p, PixelRows):
            sources += p.sources
            counts.append(np.diff(p.bases))
            lookup.append(p.rows + offset)
            offset += int(p.bases[-1])
        else:
            sources.append(p)
            counts.append(np.array([len(p)]))
            lookup.append(np.arange(len(p), dtype=np.int64) + offset)
            offset += len(p)
    first = parts[0]
    return PixelRows(sources, np.concatenate(counts), np.concatenate(lookup)[rows], first.shape[1], first.dtype)
