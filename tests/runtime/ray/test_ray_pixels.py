"""Pixels go from the SourceLoaders to the trainer on Ray without the Constructor reading them (issue 41
item 2): a loader call's pixels above `pixels_apart` bytes are an object of their own, the Constructor's
reply places them (object references and row numbers), the trainer-side client assembles them with one
copy; the stream is bit for bit the local runtime's."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from mm_data import llava, mm_spec, parquet, webdataset

from plait.batch import ImagePayload, Payload, merge_payloads
from plait.runtime.ray.payloads import merge_fetched, placed
from plait.runtime.ray.pixel_rows import Apart, PixelRows, set_apart

PATCH_ROW = 14 * 14 * 3


def payload(rng, rows: int) -> Payload:
    pixels = rng.integers(0, 256, (rows, PATCH_ROW), dtype=np.uint8)
    grid = np.array([[1, 1, rows]], np.int64)
    return Payload(np.arange(5, dtype=np.int32), ImagePayload(pixels, grid, np.array([0]), 7, 14))


def test_a_call_s_pixels_go_apart_above_the_limit_only():
    rng = np.random.default_rng(0)
    answers = [payload(rng, 3), np.arange(4, dtype=np.int32), payload(rng, 2)]  # the middle one: text only
    same, none = set_apart(answers, limit=5 * PATCH_ROW)
    assert none is None and same is answers  # 5 rows: small calls keep their pixels in the answer
    kept, apart = set_apart(answers, limit=5 * PATCH_ROW - 1)
    assert [a.shape for a in apart] == [(3, PATCH_ROW), (2, PATCH_ROW)]
    assert kept[0].images.pixels == Apart(0, 3, PATCH_ROW, "|u1") and kept[2].images.pixels == Apart(1, 2, PATCH_ROW, "|u1")
    np.testing.assert_array_equal(apart[1], answers[2].images.pixels)
    assert kept[1] is answers[1] and kept[0].tokens is answers[0].tokens
    assert sum(len(pickle.dumps(a)) for a in kept) < 2000  # what the Constructor reads: no pixel bytes


def test_placed_rows_slice_pickle_and_assemble_as_the_array():
    """A PixelRows over a local array and two pixel objects (fake references here) behaves as the rows it
    stands for: sliced, fancy-indexed, pickled with only the sources it uses, assembled with one copy."""
    rng = np.random.default_rng(1)
    a, b, c = (rng.integers(0, 256, (n, 6), dtype=np.uint8) for n in (4, 5, 3))
    fetched = {"ref-1": [b, c]}
    stack = np.concatenate([a, b, c])
    rows = np.array([5, 6, 7, 0, 1, 9, 10, 11, 2])
    placed_rows = PixelRows([a, ("ref-1", 0), ("ref-1", 1)], np.array([4, 5, 3]), rows, 6, np.uint8)
    assert placed_rows.shape == (9, 6) and len(placed_rows) == 9 and placed_rows.nbytes == 54
    np.testing.assert_array_equal(placed_rows.assemble(fetched), stack[rows])
    np.testing.assert_array_equal(placed_rows[3:6].assemble(fetched), stack[rows[3:6]])
    np.testing.assert_array_equal(placed_rows[np.array([8, 0])].assemble(fetched), stack[rows[[8, 0]]])
    only_objects = pickle.loads(pickle.dumps(placed_rows[:3]))  # rows of b only: a and c are left behind
    assert only_objects.sources == [("ref-1", 0)] and only_objects.refs() == ["ref-1"]
    np.testing.assert_array_equal(only_objects.assemble(fetched), stack[rows[:3]])
    empty = pickle.loads(pickle.dumps(placed_rows[:0]))
    assert empty.sources == [] and empty.assemble({}).shape == (0, 6)


def test_merging_placed_parts_is_merge_payloads_bit_for_bit():
    """Parts whose pixels went apart (and one answered inline) merge into the payload merge_payloads makes
    of the arrays, once the trainer assembles the pixels; the Constructor copied no pixel row."""
    from test_ray_lean import assert_same_payload, three_loaders

    for seed in range(3):
        lengths, parts = three_loaders(seed)
        want = merge_payloads(lengths, parts)
        (s0, p0), (s1, p1), rest = parts
        fetched = {"ref-0": [p0.images.pixels]}
        apart = p0._replace(images=p0.images._replace(pixels=Apart(0, len(p0.images.pixels), PATCH_ROW, "|u1")))
        got = merge_fetched(lengths, [(s0, placed(apart, "ref-0")), (s1, p1), rest])
        pixels = got.images.pixels
        assert isinstance(pixels, PixelRows) and pixels.refs() == ["ref-0"]
        assert_same_payload(got._replace(images=got.images._replace(pixels=pixels.assemble(fetched))), want)


# ----- on Ray -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def image_spec(tmp_path_factory):
    import plait

    base = tmp_path_factory.mktemp("pixels")
    sources = [llava(base / "l", n=30), webdataset(base / "w", shards=3, per_shard=8), parquet(base / "p", n=16)]
    return plait.load_spec(mm_spec(sources)).with_overrides(steps=3)


@pytest.mark.timeout(300)
def test_apart_pixels_give_the_local_stream(image_spec, ray_session):
    """Every call's pixels apart (`pixels_apart=0`): the same digest as the local runtime, pixels included."""
    from plait.cli.stream import stream as run_stream
    from plait.metrics import combined_digest

    local = run_stream(image_spec, steps=3, runtime="local", progress=False)
    remote = run_stream(image_spec, steps=3, runtime="ray", progress=False,
                        runtime_options={"loaders": 2, "pixels_apart": 0})
    assert remote["images"] == local["images"] > 0
    assert combined_digest(remote["digests"]) == combined_digest(local["digests"])


@pytest.mark.timeout(300)
def test_the_constructor_places_pixels_it_never_reads_and_they_outlive_the_loaders(image_spec, ray_session):
    """The Constructor's reply holds object references (no pixel bytes) for pixels sent apart; the
    Constructor owns those objects, so after every loader is killed the trainer still assembles the
    local runtime's pixels from them."""
    import ray

    from plait.runtime import make_runtime
    from plait.runtime.local import LocalRuntime
    from plait.runtime.ray.pixel_rows import resolve

    local = LocalRuntime(image_spec)
    want = local.build(local.plan(), 0)
    rt = make_runtime(image_spec, "ray", loaders=2, pixels_apart=0)
    try:
        plan = rt.plan()
        gen = ray.get(rt.planner.base.remote())[0]
        (constructor,) = rt.builders().values()
        _, raw = ray.get(constructor.get.remote(gen, plan.step, 0))
        imaged = [mb for mb in raw if mb.num_patches]
        assert imaged
        for mb in imaged:
            assert isinstance(mb.pixel_values, PixelRows)
            assert all(isinstance(s, tuple) and isinstance(s[0], ray.ObjectRef) for s in mb.pixel_values.sources)
        assert len(pickle.dumps(imaged[0].pixel_values)) < imaged[0].pixel_values.nbytes  # rows, not pixels
        for loader in ray.get(rt.planner.get_loaders.remote()):
            ray.kill(loader)
        got = resolve(raw)
    finally:
        rt.close()
    assert_local_batches(got, want)


def assert_local_batches(got: list, want: list) -> None:
    """The micro-batches (pixels assembled: writable uint8 arrays) are the local runtime's."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        assert (a.pixel_values is None) == (b.pixel_values is None)
        if b.pixel_values is not None:
            assert a.pixel_values.flags.writeable and a.pixel_values.dtype == np.uint8
            np.testing.assert_array_equal(a.pixel_values, b.pixel_values)


def lost_pixels(ref, timeout: float = 30.0) -> None:
    """Wait until the pixel object `ref` is gone with its owner (ray.kill returns before the actor is dead,
    and its objects are freed after that)."""
    import time

    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get(ref, timeout=5)
        except ray.exceptions.ObjectLostError:
            return
        time.sleep(0.2)
    pytest.fail("the dead Constructor's pixel object is still there")


@pytest.mark.timeout(120)
def test_a_constructor_dead_before_its_pixels_are_fetched_is_replaced_and_the_step_built_again(image_spec, ray_session):
    """The Constructor answered (its reply places pixels it owns) and died before the trainer fetched them:
    the trainer sees them lost, a new Constructor builds the step again, and the batches are the local
    runtime's. (The trainer used to fetch the same lost pixels again, forever.)"""
    import ray

    from plait.runtime import make_runtime
    from plait.runtime.local import LocalRuntime

    local = LocalRuntime(image_spec)
    want = local.build(local.plan(), 0)
    rt = make_runtime(image_spec, "ray", loaders=2, pixels_apart=0, constructors="node")
    try:
        plan = rt.plan()  # asks every rank's build
        gen = ray.get(rt.planner.base.remote())[0]
        (constructor,) = rt.builders().values()
        _, raw = ray.get(constructor.get.remote(gen, plan.step, 0))  # answered: the pixels are its objects
        assert any(isinstance(mb.pixel_values, PixelRows) for mb in raw)
        ray.kill(constructor, no_restart=True)
        lost_pixels(next(mb.pixel_values for mb in raw if isinstance(mb.pixel_values, PixelRows)).refs()[0])
        got = rt.build(plan, 0)
        assert [e["role"] for e in rt.recovery_log] == ["constructor"]
    finally:
        rt.close()
    assert_local_batches(got, want)
