"""The command line with videos: `plait run` counts the videos delivered and their rate (in its table and its
JSON, a video-only spec included), `plait inspect` shows each previewed video's sampled frames, size, grid
and tokens."""

from __future__ import annotations

import json

import pytest
import yaml
from video_data import VIDEOS, llava_video, video_spec

from plait.cli import main
from plait.media.video import VideoPolicy, probe

av = pytest.importorskip("av")
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def spec_file(tmp_path):
    src = llava_video(tmp_path / "data", n=4, with_images=False)  # videos only: no image delivered
    spec = video_spec([src], dp=1)
    del spec["cost"]["encoder"]  # no encoder cost either: nothing else puts media in the summary
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path, src


def test_plait_run_reports_videos_and_videos_per_second(spec_file, tmp_path, capsys):
    path, _ = spec_file
    out = tmp_path / "summary.json"
    assert main(["run", str(path), "--steps", "2", "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["videos"] > 0 and s["videos_per_s"] > 0
    assert s["videos_per_s"] == pytest.approx(s["videos"] / s["seconds"], rel=0.05)
    cells = {c[1].strip(): c[2].strip() for c in (line.split("│") for line in capsys.readouterr().out.splitlines())
             if len(c) == 4}
    assert cells["videos delivered"] == f"{s['videos']:,}"
    assert cells["videos/s"] == f"{s['videos_per_s']:,.1f}"


def test_plait_inspect_shows_each_video_s_frames_grid_and_tokens(spec_file, capsys):
    path, src = spec_file
    assert main(["inspect", str(path), "--docs", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if ".mp4" in line or ".webm" in line or ".mkv" in line or ".mov" in line]
    assert len(rows) == 4
    policy = VideoPolicy(**{k: VIDEOS[k] for k in ("fps", "min_frames", "max_frames", "min_pixels", "max_pixels",
                                                     "total_pixels")})
    records = json.loads(open(src["path"]).read())
    for rec in records:
        plan = policy.plan(probe(f"{src['image_root']}/{rec['video']}"))
        row = next(r for r in rows if rec["video"] in r)
        cells = [c.strip() for c in row.split("│")]
        shown = " ".join(map(str, plan.indices[:6])) + (f" ... {plan.indices[-1]}" if len(plan.indices) > 6 else "")
        assert f"{len(plan.indices)}: {shown}" in cells
        assert f"{plan.width}x{plan.height}" in cells and " x ".join(map(str, plan.grid)) in cells
        assert f"{plan.tokens:,}" in cells
