"""Which frames a video became travels with its batch: `stats["video_frames"]` holds, per video of the
micro-batch (in `video_grid`'s order), the source frame indices the rule sampled, from every reader (LLaVA
JSON, WebDataset members, Parquet bytes), through a Loader as a trainer gets it, and still aligned when a
sample is dropped at gather."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from video_data import VIDEOS, llava_video, parquet_video, video_spec, webdataset_video

import plait
from plait.runtime.local import LocalRuntime
from plait.media.video import VideoPolicy, probe

av = pytest.importorskip("av")
POLICY = VideoPolicy(**{k: VIDEOS[k] for k in ("fps", "min_frames", "max_frames", "min_pixels", "max_pixels",
                                                 "total_pixels")})


def llava_indices(src: dict, mb, d: int) -> list[int]:
    """The rule's frame indices of the LLaVA video of document d, from its file."""
    records = json.loads(Path(src["path"]).read_text())
    name = records[int(mb.sample_ids[d, 3])]["video"]
    return list(POLICY.plan(probe(str(Path(src["image_root"]) / name))).indices)


def test_every_reader_s_videos_carry_their_sampled_frames(tmp_path):
    sources = [llava_video(tmp_path / "l", n=4, with_images=True), webdataset_video(tmp_path / "w", shards=1),
               parquet_video(tmp_path / "p", n=3)]
    rt = LocalRuntime(plait.load_spec(video_spec(sources)))
    seen, checked = set(), 0
    for _ in range(2):
        plan = rt.plan()
        for r in range(plan.ranks):
            for mb in rt.build(plan, r):
                frames = mb.stats["video_frames"]
                assert len(frames) == len(mb.video_grid)
                for k, (d, grid) in enumerate(zip(mb.video_document, mb.video_grid)):
                    assert len(frames[k]) == grid[0] * 2 and frames[k] == sorted(frames[k])
                    assert frames[k][0] == 0  # linspace from the first frame
                    seen.add(int(mb.source_ids[d]))
                    if mb.source_ids[d] == 0:
                        assert frames[k] == llava_indices(sources[0], mb, d)
                        checked += 1
        rt.release()
    assert seen == {0, 1, 2} and checked >= 2


def test_a_loader_gives_the_frames_to_the_trainer(tmp_path):
    src = llava_video(tmp_path, n=4, with_images=False)
    with plait.Loader(video_spec([src], dp=1), steps=1) as loader:
        batches = list(loader)
    assert batches and all(len(b.stats["video_frames"]) == len(b.video_grid) for b in batches)
    for b in batches:
        for k, d in enumerate(b.video_document):
            assert b.stats["video_frames"][k] == llava_indices(src, b, d)


def test_frames_stay_aligned_when_a_sample_is_dropped_at_gather(tmp_path):
    src = llava_video(tmp_path, n=5, with_images=False)
    recs = json.loads((tmp_path / "data.json").read_text())
    path = tmp_path / recs[3]["video"]
    rt = LocalRuntime(plait.load_spec(video_spec([{**src, "on_error": "skip"}], dp=1)))
    plans = [rt.plan() for _ in range(3)]
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) * 2 // 5])  # cut after planning
    dropped = 0
    for plan in plans:
        for mb in rt.build(plan, 0):
            dropped += mb.stats["dropped_samples"]
            assert [list(f) for f in mb.stats["video_frames"]] == [llava_indices(src, mb, d) for d in mb.video_document]
    assert dropped > 0


def frames_of(rt, steps: int) -> list:
    out = []
    for _ in range(steps):
        plan = rt.plan()
        out += [(mb.stats["video_frames"], mb.video_grid.tolist()) for r in range(plan.ranks) for mb in rt.build(plan, r)]
        rt.release()
    return out


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_the_frames_cross_ray_s_loader_actors(tmp_path, ray_session):
    """The payload's frame indices travel from Ray's SourceLoader actors, merged over two loaders."""
    from plait.runtime import make_runtime

    spec = plait.load_spec(video_spec([llava_video(tmp_path / "l", n=4, with_images=True),
                                       webdataset_video(tmp_path / "w", shards=2, per_shard=2)]))
    local = frames_of(LocalRuntime(spec), 2)
    rt = make_runtime(spec, "ray", loaders=2)
    try:
        remote = frames_of(rt, 2)
    finally:
        rt.close()
    assert remote == local and sum(len(f) for f, _ in local) > 4
