"""Batches with videos: LLaVA-Video JSON (videos and images in one sample), WebDataset video members and
Parquet video columns (bytes and paths); placeholder runs and labels, `video_grid` / `video_cu_seqlens`,
pixels equal to a plain PyAV decode, no frame decoded while planning, one decode pass per delivered
video, exact resume and the digest with videos, bad videos under raise and skip, the same stream on ray."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from video_data import (
    EOS,
    TOKEN_ID,
    VIDEO_TOKEN_ID,
    VIDEOS,
    audio_only,
    llava_video,
    parquet_video,
    video_spec,
    webdataset_video,
)

import plait
from plait.errors import SourceError
from plait.metrics import batch_digest_update
from plait.runtime.local import LocalRuntime
from plait.media.video import FRAME_DECODES, VIDEO_DECODES, VideoPolicy, patchify_frames, probe

av = pytest.importorskip("av")
POLICY = VideoPolicy(fps=VIDEOS["fps"], min_frames=VIDEOS["min_frames"], max_frames=VIDEOS["max_frames"],
                     min_pixels=VIDEOS["min_pixels"], max_pixels=VIDEOS["max_pixels"],
                     total_pixels=VIDEOS["total_pixels"])
ROW = 14 * 14 * 3


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    base = tmp_path_factory.mktemp("video")
    return [llava_video(base / "l", n=6), webdataset_video(base / "w", shards=2, per_shard=3),
            parquet_video(base / "p", n=5, inline=True), parquet_video(base / "q", n=4, inline=False)]


def stream(spec_dict, steps: int, state: dict | None = None):
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


def reference_rows(data) -> np.ndarray:
    """A plain PyAV decode of every frame, the rule's frames at full size in RGB resized by Pillow's BICUBIC
    (the reference's resize) and patchified: the video's rows as Qwen2-VL takes them, [t*h*w, 2*14*14*3]."""
    from PIL import Image

    plan = POLICY.plan(probe(data))
    with av.open(io.BytesIO(data) if isinstance(data, bytes) else data) as c:
        frames = list(c.decode(video=0))
    pix = np.stack([np.asarray(frames[i].to_image().resize((plan.width, plan.height), Image.Resampling.BICUBIC))
                    for i in plan.indices])
    return patchify_frames(pix, 14, 2).reshape(-1, 2 * ROW)


def test_placeholders_labels_and_video_fields(sources):
    steps, _, _ = stream(video_spec(sources), 3)
    videos = images = 0
    for mb in (mb for step in steps for mb in step):
        assert mb.pixel_values_videos.dtype == np.uint8 and mb.pixel_values_videos.shape[1] == 2 * ROW
        grid = mb.video_grid
        assert int(grid.prod(axis=1).sum()) == len(mb.pixel_values_videos)
        assert mb.video_cu_seqlens[-1] == len(mb.pixel_values_videos)
        assert len(mb.video_cu_seqlens) == int(grid[:, 0].sum()) + 1  # one sequence per temporal patch
        assert set(np.diff(mb.video_cu_seqlens)) <= set((grid[:, 1] * grid[:, 2]).tolist())
        for d in range(len(mb.cu_seqlens) - 1):
            ids = mb.input_ids[mb.cu_seqlens[d]: mb.cu_seqlens[d + 1]]
            assert int((ids == VIDEO_TOKEN_ID).sum()) == int(grid[mb.video_document == d].prod(axis=1).sum()) // 4
            if mb.image_grid is not None:
                assert int((ids == TOKEN_ID).sum()) == int(mb.image_grid[mb.image_document == d].prod(axis=1).sum()) // 4
        assert not np.isin(mb.labels, (VIDEO_TOKEN_ID, TOKEN_ID)).any()
        after = np.flatnonzero((mb.input_ids[:-1] == VIDEO_TOKEN_ID) & (mb.input_ids[1:] != VIDEO_TOKEN_ID))
        assert (mb.labels[after] == mb.input_ids[after + 1]).all() and len(after) == len(grid)
        patches = len(mb.pixel_values_videos) + mb.num_patches
        assert mb.num_tokens <= 512 and patches <= 800  # both capacities, videos included
        videos += len(grid)
        images += mb.num_images
    assert videos > 20 and images > 0


def test_a_sample_with_an_image_then_a_video(sources):
    """LLaVA record 1 is "<image> and <video>...": the image's run comes before the video's."""
    steps, _, _ = stream(video_spec(sources[:1]), 1)
    seen = 0
    for mb in steps[0]:
        for d in np.flatnonzero(np.isin(np.arange(len(mb.cu_seqlens) - 1), mb.image_document)):
            ids = mb.input_ids[mb.cu_seqlens[d]: mb.cu_seqlens[d + 1]]
            assert np.flatnonzero(ids == TOKEN_ID).max() < np.flatnonzero(ids == VIDEO_TOKEN_ID).min()
            assert ids[-1] == EOS
            seen += 1
    assert seen > 0


def test_pixels_equal_a_plain_pyav_decode(sources):
    steps, _, rt = stream(video_spec(sources[:1]), 1)
    src = rt.loader.sources[0]
    root = Path(src.spec.image_root)
    checked = 0
    for mb in steps[0]:
        rows = np.concatenate([[0], np.cumsum(mb.video_grid.prod(axis=1))])
        for i, d in enumerate(mb.video_document):
            shard, row = mb.sample_ids[d, 2], mb.sample_ids[d, 3]
            name = json.loads(Path(src.files[shard]).read_text())[row]["video"]
            want = reference_rows(str(root / name))
            np.testing.assert_array_equal(mb.pixel_values_videos[rows[i]: rows[i + 1]], want)
            checked += 1
    assert checked >= 4


def test_no_frame_decoded_while_planning_and_one_pass_per_delivered_video(sources):
    rt = LocalRuntime(plait.load_spec(video_spec(sources)))
    frames, passes = FRAME_DECODES.count, VIDEO_DECODES.count
    plans = [rt.plan() for _ in range(3)]
    assert FRAME_DECODES.count == frames and VIDEO_DECODES.count == passes  # planning: headers only
    assert all(p.items.patches.sum() > 0 for p in plans)
    delivered = 0
    for plan in plans:
        for r in range(plan.ranks):
            delivered += sum(len(mb.video_grid) for mb in rt.build(plan, r))
            assert VIDEO_DECODES.count - passes == delivered  # each delivered video decoded once
    assert delivered > 10 and FRAME_DECODES.count > frames


def digest(steps) -> str:
    import hashlib

    h = hashlib.sha256()
    for step in steps:
        for mb in step:
            batch_digest_update(h, mb)
    return h.hexdigest()


def test_exact_resume_with_videos(sources):
    spec = video_spec(sources)
    full, states, _ = stream(spec, 4)
    resumed, _, _ = stream(spec, 2, state=states[1])
    assert digest(full[2:]) == digest(resumed)
    ids = [tuple(map(tuple, mb.sample_ids)) for step in full for mb in step]
    flat = [i for mb in ids for i in mb]
    assert len(flat) == len(set(flat))  # exactly once, by sample id


def test_digest_covers_video_pixels(sources):
    steps, _, _ = stream(video_spec(sources[:1]), 1)
    mb = next(mb for mb in steps[0] if len(mb.video_grid))
    import hashlib

    a, b = hashlib.sha256(), hashlib.sha256()
    batch_digest_update(a, mb)
    mb.pixel_values_videos = mb.pixel_values_videos.copy()
    mb.pixel_values_videos[0, 0] ^= 1
    batch_digest_update(b, mb)
    assert a.hexdigest() != b.hexdigest()


def test_to_torch_videos(sources):
    torch = pytest.importorskip("torch")
    steps, _, _ = stream(video_spec(sources[:1]), 1)
    mb = next(mb for mb in steps[0] if len(mb.video_grid))
    t = mb.to_torch()
    assert t["pixel_values_videos"].dtype == torch.uint8 and t["video_grid"].shape == (len(mb.video_grid), 3)
    assert t["video_cu_seqlens"].dtype == torch.int32


# ----- bad input -----------------------------------------------------------------------------------
def run_all(spec_dict, steps=2):
    rt = LocalRuntime(plait.load_spec(spec_dict))
    out = []
    for _ in range(steps):
        plan = rt.plan()
        for r in range(plan.ranks):
            out += rt.build(plan, r)
    return rt, out


@pytest.mark.parametrize("what", ["corrupt", "truncated", "cut webm", "missing", "no video stream"])
def test_bad_video_headers_follow_on_error(tmp_path, what):
    src = llava_video(tmp_path, n=4, with_images=False)
    path = tmp_path / json.loads((tmp_path / "data.json").read_text())[2]["video"]
    data = path.read_bytes()
    if what == "corrupt":
        path.write_bytes(b"\x00garbage" * 100)
    elif what in ("truncated", "cut webm"):  # record 2 is a WebM: its headers survive the cut
        path.write_bytes(data[: len(data) // (3 if what == "truncated" else 2)])
    elif what == "missing":
        path.unlink()
    else:
        path.write_bytes(audio_only())
    with pytest.raises(SourceError) as e:
        run_all(video_spec([src], dp=1))
    msg = str(e.value)
    assert "source 'llava_video'" in msg and "data.json" in msg and "record 2" in msg and "video" in msg
    rt, batches = run_all(video_spec([{**src, "on_error": "skip"}], dp=1))
    source = rt.loader.sources[0]
    # one bad record, counted once per epoch that planned it (docs/states-and-errors.md)
    report = rt.loader.error_report()["llava_video"]
    assert report["bad_records"] == 1 and any("record 2" in line for line in source.error_log)
    assert report["skipped"] == len({epoch for _, _, epoch in report["records"]}) >= 1
    delivered = {int(r) for mb in batches for r in mb.sample_ids[:, 3]}
    assert 2 not in delivered and delivered  # nothing of the bad sample, the others delivered


def test_bad_webdataset_video_member_is_named(tmp_path):
    src = webdataset_video(tmp_path, shards=1, per_shard=3,
                           extra={0: [("bad01.mp4", b"not a video" * 30), ("bad01.json", b'{"caption": "x"}')]})
    with pytest.raises(SourceError, match=r"shards-000000.tar.*record bad01.*not a readable video"):
        run_all(video_spec([src], dp=1), steps=1)


def test_video_cut_after_planning_is_found_at_gather(tmp_path):
    """A file cut short after the Planner read its headers: the gather finds its frames missing (a seek
    past the end) and stops naming source, shard and record under raise."""
    src = llava_video(tmp_path, n=5, with_images=False)
    recs = json.loads((tmp_path / "data.json").read_text())
    path = tmp_path / recs[3]["video"]  # KINDS[3]: an mkv of 4 s
    rt = LocalRuntime(plait.load_spec(video_spec([src], dp=1)))
    plans = [rt.plan() for _ in range(3)]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 5])
    with pytest.raises(SourceError, match=r"record 3.*(stream ends|cannot decode)"):
        for plan in plans:
            rt.build(plan, 0)


def test_video_cut_after_planning_is_dropped_under_skip(tmp_path):
    """Under skip, a video that fails at gather (after planning) never reaches a trainer: its whole sample
    leaves its micro-batch (no zeroed frames), the error names it, the other samples are delivered."""
    src = llava_video(tmp_path, n=5, with_images=False)
    recs = json.loads((tmp_path / "data.json").read_text())
    path = tmp_path / recs[3]["video"]
    rt = LocalRuntime(plait.load_spec(video_spec([{**src, "on_error": "skip"}], dp=1)))
    plans = [rt.plan() for _ in range(3)]
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) * 2 // 5])
    batches = [mb for plan in plans for mb in rt.build(plan, 0)]
    delivered = [(int(r[1]), int(r[3])) for mb in batches for r in mb.sample_ids]
    assert all(row != 3 for _, row in delivered) and delivered
    for mb in batches:  # no zero frame was delivered
        pixels = getattr(mb, "pixel_values_videos", None)
        if pixels is not None and len(pixels):
            assert (pixels.reshape(len(pixels), -1).max(axis=1) > 0).all()
    assert any("record 3" in line for line in rt.loader.sources[0].error_log)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_same_stream_on_ray(sources, ray_session):
    """Local and ray give the same digest with videos (pixels included), decoded in the loader actors."""
    ray = pytest.importorskip("ray")
    from plait.cli.stream import stream as run_stream
    from plait.metrics import combined_digest

    spec = plait.load_spec(video_spec(sources[:2])).with_overrides(steps=2)
    local = run_stream(spec, steps=2, runtime="local", progress=False)
    remote = run_stream(spec, steps=2, runtime="ray", progress=False, runtime_options={"loaders": 2})
    assert combined_digest(remote["digests"]) == combined_digest(local["digests"])
    assert remote["videos"] == local["videos"] > 0


def test_clip_windows_are_samples_of_their_own(tmp_path):
    """clip: a video whose frames at fps 2 exceed max_frames 4 becomes one sample per window, each with
    its own id (epoch 0 holds every window of every record once), and the windows' frames together are
    the unclipped rule's frames."""
    src = llava_video(tmp_path, n=5, with_images=False)
    spec = video_spec([src], dp=1, microbatches=1, seq_len=1024, max_patches=2000,
                      videos={**VIDEOS, "clip": True, "max_frames": 4, "min_frames": 2})
    steps, _, rt = stream(spec, 3)
    docs = [(tuple(mb.sample_ids[d]), mb.video_grid[mb.video_document == d])
            for step in steps for mb in step for d in range(len(mb.cu_seqlens) - 1)]
    ids = [i for i, _ in docs]
    assert len(ids) == len(set(ids))
    clip = VideoPolicy(**{**POLICY.__dict__, "clip": True, "max_frames": 4, "min_frames": 2})
    recs = json.loads((tmp_path / "data.json").read_text())
    infos = [probe(str(tmp_path / r["video"])) for r in recs]
    windows = [clip.windows(info) for info in infos]
    assert max(windows) >= 2  # some records are clipped
    assert sorted(i[3] for i in ids if i[1] == 0) == list(range(sum(windows)))  # epoch 0: every window once
    for info in infos:
        frames = [i for w in range(clip.windows(info)) for i in clip.plan(info, w).indices]
        assert frames == list(np.linspace(0, info.frames - 1, len(frames)).round().astype(int))
    assert all(g[:, 0].sum() * 2 <= 4 for _, g in docs)  # no window over max_frames


def test_encoder_cost_of_a_video_is_per_temporal_patch(sources):
    """The Planner's quadratic encoder term of a video document is t * (h*w)**2 (attention per temporal
    patch), its patch count t*h*w; the cost probe decodes videos, so a video source costs more than text."""
    from plait.runtime.scaling import probe_costs
    from plait.sources import Source

    spec = plait.load_spec(video_spec(sources[:1]))
    src = Source.of_job(spec, 0)
    block = src.read_block(src.first_key())
    t = block.images
    for d in range(len(t.start)):
        grids = t.grid[t.start[d]: t.start[d] + t.count[d]]
        assert t.doc_sums(1)[d] == int(grids.prod(axis=1).sum())
        assert t.doc_sums(2)[d] == int((grids[:, 0] * (grids[:, 1] * grids[:, 2]) ** 2).sum())
    before = FRAME_DECODES.count
    text = {"name": "text", "path": str(Path(sources[0]["path"]).parent / "t.jsonl"), "format": "jsonl",
            "text_field": "text"}
    Path(text["path"]).write_text("\n".join(json.dumps({"text": "words " * 40}) for _ in range(200)))
    costs, _ = probe_costs(plait.load_spec(video_spec([sources[0], text])), budget_s=1.0)
    assert FRAME_DECODES.count > before  # the probe decodes frames: what a loader does per delivered video
    assert costs[0] > 10 * costs[1]


def test_webdataset_sample_with_an_image_and_a_video(tmp_path):
    """A WebDataset sample holding key.jpg and key.mp4 beside key.json (caption template): the image's
    run, then the video's, then the caption."""
    from mm_data import image_bytes
    from video_data import KINDS, encode

    src = webdataset_video(tmp_path, shards=1, per_shard=0, extra={0: [
        item for k in range(4) for item in ((f"s{k}.jpg", image_bytes(60 + 10 * k, 40, "JPEG", seed=k)),
                                             (f"s{k}.mp4", encode(*KINDS[0])),
                                             (f"s{k}.json", json.dumps({"caption": f"sample {k}"}).encode()))]})
    steps, _, _ = stream(video_spec([{**src, "image_field": "jpg"}], dp=1), 1)
    docs = 0
    for mb in steps[0]:
        for d in range(len(mb.cu_seqlens) - 1):
            ids = mb.input_ids[mb.cu_seqlens[d]: mb.cu_seqlens[d + 1]]
            img, vid = np.flatnonzero(ids == TOKEN_ID), np.flatnonzero(ids == VIDEO_TOKEN_ID)
            assert len(img) and len(vid) and img.max() < vid.min() and vid.max() < len(ids) - 2
            docs += 1
    assert docs >= 4
