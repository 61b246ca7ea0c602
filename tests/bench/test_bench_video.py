"""`plait bench video` and `plait demo --video`: one decode pass per delivered video, none while planning;
the demo's video spec streams videos and leaves demo.yaml alone."""

from __future__ import annotations

import json

import pytest

from plait.cli import main

pytest.importorskip("av")


def test_bench_video_decodes_once_per_delivered_video(tmp_path):
    out = tmp_path / "video.json"
    rc = main(["bench", "video", "--videos", "4", "--max-seconds", "2", "--steps", "1", "--dp", "1",
               "--seq-len", "2048", "--quiet", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["delivered_videos"] > 0
    assert r["planning_frame_decodes"] == 0 and r["decodes_per_video"] == 1.0
    assert r["ratio_wall"] > 0 and r["loader_frames_per_s"] > 0 and r["pyav_frames_per_s"] > 0
    assert len(r["loadavg"]) == 6


def test_demo_video_spec_adds_a_video_source(tmp_path):
    import yaml

    from plait.cli.video_data import demo_video_spec
    from plait.spec import load_spec

    (tmp_path / "demo.yaml").write_text(yaml.safe_dump({"sources": [{"name": "t", "path": "t.jsonl",
                                                                     "text_field": "text"}],
                                                        "images": {"image_token_id": 300}}))
    before = (tmp_path / "demo.yaml").read_text()
    path = demo_video_spec(tmp_path, 300)
    spec = load_spec(path)
    assert spec.sources[-1].video_field == "video" and spec.videos.video_token_id == 301
    assert len(json.loads((tmp_path / "video" / "videos.json").read_text())) == 12
    assert (tmp_path / "demo.yaml").read_text() == before


def test_bench_video_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "video", "--help"])
    assert e.value.code == 0 and "PyAV" in capsys.readouterr().out
