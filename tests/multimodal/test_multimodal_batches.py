"""Batches with images: placeholder runs in input_ids with their labels masked, pixels decoded exactly once
per delivered image (and never while planning), both capacities held in every micro-batch, exact resume
with pixels, the digest over pixels, metrics, and the same stream on the ray runtime."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from mm_data import TOKEN_ID, llava, mm_spec, parquet, webdataset

import plait
from plait.metrics import RunStats, batch_digest_update
from plait.packing import IGNORE_INDEX
from plait.runtime.local import LocalRuntime
from plait.media.image import DECODES, ImagePolicy, decode

PATCH_DIM = 14 * 14 * 3


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    base = tmp_path_factory.mktemp("mm")
    return [llava(base / "l", n=30), webdataset(base / "w", shards=3, per_shard=8), parquet(base / "p", n=16)]


def stream(spec_dict, steps: int, state: dict | None = None):
    """(batches of every rank per step, data state after each step, runtime)."""
    rt = LocalRuntime(plait.load_spec(spec_dict))
    if state is not None:
        rt.load_state_dict(state)
    out, states = [], []
    for _ in range(steps):
        plan = rt.plan()
        out.append([mb for r in range(plan.ranks) for mb in rt.build(plan, r)])
        states.append(rt.state_dict())
        rt.release()
    return out, states, rt


def test_placeholders_labels_and_image_fields(sources):
    steps, _, _ = stream(mm_spec(sources), 3)
    images = 0
    for mb in (mb for step in steps for mb in step):
        assert mb.pixel_values.dtype == np.uint8 and mb.pixel_values.shape[1] == PATCH_DIM
        grid = mb.image_grid
        assert int(grid.prod(axis=1).sum()) == mb.num_patches
        assert mb.image_cu_seqlens.dtype == np.int32 and mb.image_cu_seqlens[-1] == mb.num_patches
        assert int((mb.input_ids == TOKEN_ID).sum()) == mb.num_patches // 4  # merge 2: 4 patches, one token
        # per document: its placeholders are its images' tokens
        for d in range(len(mb.cu_seqlens) - 1):
            ids = mb.input_ids[mb.cu_seqlens[d]: mb.cu_seqlens[d + 1]]
            mine = mb.image_document == d
            assert int((ids == TOKEN_ID).sum()) == int(grid[mine].prod(axis=1).sum()) // 4
        # a label never asks for a placeholder; the text after an image is still a label
        assert not (mb.labels == TOKEN_ID).any()
        follows = np.flatnonzero((mb.input_ids[:-1] == TOKEN_ID) & (mb.input_ids[1:] == TOKEN_ID))
        assert (mb.labels[follows] == IGNORE_INDEX).all()
        after = np.flatnonzero((mb.input_ids[:-1] == TOKEN_ID) & (mb.input_ids[1:] != TOKEN_ID))
        assert (mb.labels[after] == mb.input_ids[after + 1]).all()
        images += mb.num_images
    assert images > 20


def test_pixels_are_the_decoded_images(sources):
    """Image i of a micro-batch is exactly `decode` of the image its document names."""
    steps, _, rt = stream(mm_spec(sources[:1]), 1)
    pol = ImagePolicy(patch=14, merge=2, min_pixels=28 * 28, max_pixels=28 * 28 * 16)
    src = rt.loader.sources[0]
    root = Path(src.spec.image_root)
    checked = 0
    for mb in steps[0]:
        rows = np.concatenate([[0], np.cumsum(mb.image_grid.prod(axis=1))])
        for i, d in enumerate(mb.image_document):
            shard, row = mb.sample_ids[d, 2], mb.sample_ids[d, 3]
            names = json.loads(Path(src.files[shard]).read_text())[row]["image"]
            names = [names] if isinstance(names, str) else names
            k = i - int(np.flatnonzero(mb.image_document == d)[0])
            want = decode((root / names[k]).read_bytes(), pol).patches
            np.testing.assert_array_equal(mb.pixel_values[rows[i]: rows[i + 1]], want)
            checked += 1
    assert checked > 5


def test_each_delivered_image_is_decoded_exactly_once(sources):
    rt = LocalRuntime(plait.load_spec(mm_spec(sources, dp=2)))
    before = DECODES.count
    plans = [rt.plan() for _ in range(3)]
    assert DECODES.count == before  # planning decodes nothing
    delivered = patches = 0
    for plan in plans:
        mine = rt.build(plan, 0)  # one rank builds only its own micro-batches: decodes only its images
        assert DECODES.count - before == delivered + sum(mb.num_images for mb in mine)
        delivered += sum(mb.num_images for mb in mine)
        other = rt.build(plan, 1)
        delivered += sum(mb.num_images for mb in other)
        patches += sum(mb.num_patches for mb in mine + other)
        assert patches == sum(int(p.items.patches.sum()) for p in plans[: plans.index(plan) + 1])
    assert DECODES.count - before == delivered == rt.loader.images_decoded


def test_both_capacities_hold(sources):
    """Tokens <= seq_len and patches <= max_patches in every micro-batch, with the patch capacity binding."""
    spec = mm_spec(sources, seq_len=256, microbatches=3, dp=2, max_patches=160)
    steps, _, _ = stream(spec, 5)
    most = 0
    for step in steps:
        for mb in step:
            assert mb.num_tokens <= 256 and mb.num_patches <= 160
            most = max(most, mb.num_patches)
        stats = step[0].stats
        assert stats["max_microbatch_patches"] <= 160 and stats["max_over_capacity_lb"] >= 1.0
        assert 0.0 < stats["encoder_share"] < 1.0
    assert most > 120  # the patch capacity was close to binding


def test_exact_resume_with_images(sources):
    """Sample ids and pixel bytes after a resume equal the uninterrupted run's."""
    spec = mm_spec(sources)
    full, states, _ = stream(spec, 6)
    _, head_states, _ = stream(spec, 2)
    assert head_states[-1] == states[1]
    tail, _, _ = stream(spec, 4, state=head_states[-1])

    def fingerprint(steps):
        return [(mb.sample_ids.tolist(), hashlib.sha256(mb.pixel_values.tobytes()).hexdigest(), mb.input_ids.tolist())
                for step in steps for mb in step]

    assert fingerprint(full[2:]) == fingerprint(tail)


def test_carried_items_keep_their_patches_in_the_state(sources):
    """A carried item with images is written as a 13-integer row and read back with its patches."""
    from plait.plan import Items

    items = Items.from_rows([[0, 0, 0, 0, 1, 0, 1, 0, 0, 50, 0, 12, 144]])
    assert items.patches.tolist() == [12] and items.to_rows()[0][-2:] == [12, 144]
    text = Items.from_rows([[0, 0, 0, 0, 1, 0, 1, 0, 0, 50, 0]])
    assert len(text.to_rows()[0]) == 11 and text.patches.tolist() == [0]


def test_digest_includes_pixels_and_text_batches_are_unchanged(sources):
    steps, _, _ = stream(mm_spec(sources[:1]), 1)
    mb = steps[0][0]
    a, b = hashlib.sha256(), hashlib.sha256()
    batch_digest_update(a, mb)
    mb.pixel_values = mb.pixel_values.copy()
    mb.pixel_values[0, 0] ^= 1
    batch_digest_update(b, mb)
    assert a.hexdigest() != b.hexdigest()
    text = type(mb)(0, 0, 1, 0, mb.input_ids, mb.labels, mb.position_ids, mb.cu_seqlens, mb.sample_ids, mb.source_ids)
    c, d = hashlib.sha256(), hashlib.sha256()
    batch_digest_update(c, text)
    for x in (text.input_ids, text.labels, text.position_ids, text.cu_seqlens, text.sample_ids):
        d.update(np.ascontiguousarray(x).tobytes())
    assert c.hexdigest() == d.hexdigest() and text.pixel_values is None


def test_to_torch_pixels(sources):
    torch = pytest.importorskip("torch")
    steps, _, _ = stream(mm_spec(sources[:1]), 1)
    mb = next(mb for mb in steps[0] if mb.num_images)
    raw = mb.to_torch()
    assert raw["pixel_values"].dtype == torch.uint8 and raw["image_grid"].shape == (mb.num_images, 3)
    norm = mb.to_torch(normalize=((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)))
    x = norm["pixel_values"]
    assert x.dtype == torch.float32
    want = (mb.pixel_values.astype(np.float32).reshape(len(mb.pixel_values), -1, 3) / 255 - 0.5) / 0.25
    np.testing.assert_allclose(x.numpy(), want.reshape(len(mb.pixel_values), -1), rtol=1e-5, atol=1e-5)
    # a micro-batch of an image job that holds text only: zero patches, still normalised (no reshape error)
    empty = dataclasses.replace(mb, pixel_values=mb.pixel_values[:0], image_grid=mb.image_grid[:0])
    none = empty.to_torch(normalize=((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)))["pixel_values"]
    assert tuple(none.shape) == (0, mb.pixel_values.shape[1]) and none.dtype == torch.float32


def test_metrics_count_images(sources):
    spec = plait.load_spec(mm_spec(sources))
    rt = LocalRuntime(spec)
    stats = RunStats(spec.source_names, 2)
    for _ in range(2):
        plan = rt.plan()
        stats.add_plan(plan, np.ones(3) / 3)
        for r in range(2):
            for mb in rt.build(plan, r):
                stats.add_batch(mb)
    s = stats.summary()
    assert s["images"] > 0 and s["images_per_s"] > 0 and 0 < s["encoder_share"] < 1
    total = sum(rt.telemetry.registry.get_sample_value("plait_source_images_total", {"source": n}) or 0
                for n in spec.source_names)
    assert total == s["images"]


@pytest.mark.timeout(300)
@pytest.mark.ray
def test_same_stream_on_ray(sources, ray_session):
    """Local and ray give the same digest with images (pixels included); the images are decoded in the
    loader actors' gather."""
    from plait.cli.stream import stream as run_stream
    from plait.metrics import combined_digest

    spec = plait.load_spec(mm_spec(sources)).with_overrides(steps=3)
    local = run_stream(spec, steps=3, runtime="local", progress=False)
    remote = run_stream(spec, steps=3, runtime="ray", progress=False, runtime_options={"loaders": 2})
    assert remote["images"] == local["images"] > 0
    assert combined_digest(remote["digests"]) == combined_digest(local["digests"])


def test_payloads_from_several_loaders_merge_in_item_order(sources):
    """One loader per source (the images of a micro-batch come from several loaders) builds the same
    micro-batches, pixels included, as one shared loader."""
    from plait.roles.constructor import Constructor, LoaderPayloads
    from plait.roles.planner import Planner
    from plait.roles.source_loader import SourceLoader

    spec = plait.load_spec(mm_spec(sources))
    shared = SourceLoader(spec)
    own = {i: SourceLoader(spec, [i]) for i in range(3)}
    plan = Planner(spec, shared).plan_step()
    one = Constructor(LoaderPayloads(lambda s: shared)).build(plan.for_rank(0))
    split = Constructor(LoaderPayloads(lambda s: own[s])).build(plan.for_rank(0))
    for a, b in zip(one, split):
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.pixel_values, b.pixel_values)
        np.testing.assert_array_equal(a.image_document, b.image_document)
    assert sum(mb.num_images for mb in one) > 0
