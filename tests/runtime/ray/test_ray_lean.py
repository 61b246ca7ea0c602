"""Ray lean per image (issue 41 item 2): a Constructor merges its loaders' pixels with one copy, and a Ray
instance plait starts returns a loader's gather inline (no object-store round trip per call)."""

from __future__ import annotations

import numpy as np
import pytest

from plait.batch import ImagePayload, Payload, merge_payloads
from plait.runtime.ray.payloads import copy_rows, merge_fetched

PATCH_ROW = 14 * 14 * 3


def image_part(rng, items: int, with_images: list[int], dropped: list[int] | None = None, video: bool = False):
    """A loader's part: tokens of `items` items (lengths 3..9), images for the items `with_images` (1-2
    images each, random grids), the dropped items' indices."""
    lengths = rng.integers(3, 10, items)
    owner = np.repeat(with_images, rng.integers(1, 3, len(with_images)))
    grid = np.stack([np.ones(len(owner), np.int64), rng.integers(1, 4, len(owner)), rng.integers(1, 5, len(owner))], 1)
    rows = int(grid.prod(axis=1).sum())
    pixels = rng.integers(0, 256, (rows, PATCH_ROW), dtype=np.uint8)
    pixels.flags.writeable = False  # as a loader's part arrives: a read-only view of what it sent
    kind = (np.arange(len(owner)) % 2).astype(np.int64) if video else None
    frames = np.arange(int(grid[kind == 1, 0].sum()), dtype=np.int64) if video else None
    images = ImagePayload(pixels, grid, owner.astype(np.int64), 151655, 14, kind, 151656, 2, frames)
    gone = None if dropped is None else np.asarray(dropped, np.int64)
    labels = None if dropped is None else np.full(len(dropped), 4, np.int64)
    keep = np.ones(items, bool)
    if dropped:
        keep[dropped] = False
    tokens = rng.integers(0, 1000, int(lengths[keep].sum())).astype(np.int32)
    return lengths, Payload(tokens, images, gone, labels)


def three_loaders(seed: int, video: bool = False):
    """A rank's request of 12 items spread over three loaders (interleaved, as blocks fall), one of which
    answered with tokens only and one with a dropped item."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(12)
    sels = [np.sort(order[:5]), np.sort(order[5:9]), np.sort(order[9:])]
    lengths = np.zeros(12, np.int64)
    l0, p0 = image_part(rng, 5, [0, 2, 4], video=video)
    l1, p1 = image_part(rng, 4, [1, 3], dropped=[3], video=video)
    l2 = rng.integers(3, 10, 3)
    p2 = rng.integers(0, 1000, int(l2.sum())).astype(np.int32)
    for sel, ln in zip(sels, (l0, l1, l2)):
        lengths[sel] = ln
    return lengths, list(zip(sels, (p0, p1, p2)))


def assert_same_payload(got: Payload, want: Payload) -> None:
    np.testing.assert_array_equal(got.tokens, want.tokens)
    for name in ("pixels", "grid", "item", "kind", "frames"):
        a, b = getattr(got.images, name), getattr(want.images, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, name
            np.testing.assert_array_equal(a, b, err_msg=name)
    for name in ("token_id", "patch", "video_token_id", "temporal_patch"):
        assert getattr(got.images, name) == getattr(want.images, name), name
    np.testing.assert_array_equal(got.dropped, want.dropped)
    np.testing.assert_array_equal(got.dropped_labels, want.dropped_labels)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("video", [False, True])
def test_merged_parts_are_merge_payloads_bit_for_bit(seed, video):
    """The one-copy merge gives merge_payloads' payload (tokens, every image's rows in item order, grids,
    owners, video kinds and frames, dropped items): the stream, and its digests, cannot tell them apart."""
    lengths, parts = three_loaders(seed, video)
    got, want = merge_fetched(lengths, parts), merge_payloads(lengths, parts)
    assert_same_payload(got, want)
    assert got.images.pixels.flags.writeable and got.images.pixels.flags.c_contiguous


def test_tokens_only_parts_merge_as_before():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 6, 6)
    sels = [np.array([0, 2, 4]), np.array([1, 3, 5])]
    parts = [(s, rng.integers(0, 99, int(lengths[s].sum())).astype(np.int32)) for s in sels]
    np.testing.assert_array_equal(merge_fetched(lengths, parts), merge_payloads(lengths, parts))


def test_rows_are_copied_by_runs_across_sources():
    """Runs that continue from one source's last row into the next source's first are cut there (the row
    numbers are consecutive, the arrays are not)."""
    a = np.arange(6 * 2, dtype=np.uint8).reshape(6, 2)
    b = 100 + np.arange(4 * 2, dtype=np.uint8).reshape(4, 2)
    bases = np.array([0, 6, 10])
    rows = np.array([4, 5, 6, 7, 0, 1, 9])
    np.testing.assert_array_equal(copy_rows([a, b], bases, rows), np.concatenate([a, b])[rows])
    assert copy_rows([a, b], bases, np.zeros(0, np.int64)).shape == (0, 2)


def test_a_ray_instance_plait_starts_returns_a_gather_inline():
    """A loader's gather of a few small images (~0.45 MiB) travels in the call's reply: Ray's 100 KiB default
    would put each into the object store (~1.2 CPU ms more per call); from ~1 MiB the store is cheaper
    (benchmarks/ray_inline_returns.py), and builds of several MiB stay there."""
    from plait.runtime.ray.common import INLINE_RETURN_BYTES, long_run_settings

    for dashboard in (False, True):
        init, _ = long_run_settings(dashboard)
        assert init["_system_config"]["max_direct_call_object_size"] == INLINE_RETURN_BYTES
    assert 256 * 1024 <= INLINE_RETURN_BYTES < 2**20


def test_build_ahead_is_the_ray_runtimes_name_too():
    """RayOptions takes `build_ahead` (every runtime's name for it); `prefetch` is its deprecated name."""
    from plait.errors import PlaitError
    from plait.runtime.ray.runtime import RayOptions

    assert RayOptions().build_ahead == 2 and RayOptions(build_ahead=0).build_ahead == 0
    with pytest.warns(DeprecationWarning, match="prefetch= is deprecated"):
        assert RayOptions(prefetch=3).build_ahead == 3
    with pytest.raises(PlaitError, match="both given"):
        RayOptions(prefetch=3, build_ahead=1)


def test_pixels_apart_is_a_number_of_bytes():
    from plait.errors import PlaitError
    from plait.runtime.ray.runtime import RayOptions

    assert RayOptions().pixels_apart is None and RayOptions(pixels_apart=0).pixels_apart == 0
    for bad in (-1, 1.5, "1MiB", True):
        with pytest.raises(PlaitError, match="pixels_apart must be a number of bytes"):
            RayOptions(pixels_apart=bad)


class FakeRef:
    """A call's answer, ready when the test says so (or failing)."""

    def __init__(self, requests, images):
        self.requests, self.images = requests, images
        self.ready = __import__("threading").Event()
        self.error: Exception | None = None


class FakeLoader:
    """A loader handle whose `gather_batch.remote(requests, False)` (text) and
    `gather_images.options(num_returns=2).remote(requests, apart_bytes)` record the call."""

    def __init__(self):
        self.calls: list[FakeRef] = []
        self.gather_batch = self
        self.gather_images = FakeImageCalls(self)

    def remote(self, requests, images):
        ref = FakeRef(requests, images)
        self.calls.append(ref)
        return ref


class FakeImageCalls:
    def __init__(self, loader):
        self.loader = loader

    def options(self, num_returns):
        assert num_returns == 2  # the answers, and the pixels sent apart (read by the trainer only)
        return self

    def remote(self, requests, apart_bytes):
        return self.loader.remote(requests, True), "pixels-ref"


def fake_get(ref):
    assert ref.ready.wait(10)
    if ref.error is not None:
        raise ref.error
    return [("answer", r, ref.images) for r in ref.requests]


def test_requests_that_wait_for_a_loader_go_together_in_its_next_call(monkeypatch):
    """One call in flight per loader: what arrives meanwhile is one call, sent when the first is read; each
    request gets its own answer; a failed call fails its requests and the loader's next call still goes."""
    from plait.runtime.ray import payloads

    monkeypatch.setattr(payloads, "get", fake_get)
    calls, loader = payloads.LoaderCalls(), FakeLoader()
    first = calls.submit(loader, "r1", True)
    assert [c.requests for c in loader.calls] == [["r1"]]  # an idle loader: sent at once
    later = [calls.submit(loader, r, True) for r in ("r2", "r3")]
    other = calls.submit(loader, "t1", False)  # tokens-only gathers are a call of their own
    assert [c.requests for c in loader.calls] == [["r1"], ["t1"]]
    loader.calls[0].ready.set()
    assert calls.result(first) == ("answer", "r1", True)
    assert [c.requests for c in loader.calls] == [["r1"], ["t1"], ["r2", "r3"]]
    loader.calls[2].error = RuntimeError("loader 0 died")
    loader.calls[2].ready.set()
    gone = calls.submit(loader, "r4", True)  # waits behind the failing call
    for g in later:
        with pytest.raises(RuntimeError, match="died"):
            calls.result(g)
    assert [c.requests for c in loader.calls][3:] == [["r4"]]
    loader.calls[3].ready.set()
    assert calls.result(gone) == ("answer", "r4", True)
    calls.settle([other])  # not read: the loader still takes its next call, at once
    calls.submit(loader, "t2", False)
    assert [c.requests for c in loader.calls][4:] == [["t2"]]
