"""What a user reads about a bad video: a missing file is said to be missing (named), a 0-byte file is empty,
a video is called a video (never "image video ..."); and a LLaVA JSON's relative media paths without
`image_root` are its own folder's, whatever the working directory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from video_data import llava_video, video_spec

import plait
from plait.errors import SourceError
from plait.runtime.local import LocalRuntime
from plait.media.video import BadVideo, probe

av = pytest.importorskip("av")


def run_steps(spec_dict: dict, steps: int = 1):
    rt = LocalRuntime(plait.load_spec(spec_dict))
    try:
        batches = []
        for _ in range(steps):
            plan = rt.plan()
            batches += [mb for r in range(plan.ranks) for mb in rt.build(plan, r)]
            rt.release()
        return batches, rt.error_report()
    finally:
        rt.close()


def test_probe_says_missing_empty_and_folder(tmp_path):
    with pytest.raises(BadVideo, match=f"^missing file: no file at {tmp_path}/gone.mp4$"):
        probe(str(tmp_path / "gone.mp4"))
    (tmp_path / "empty.mp4").write_bytes(b"")
    for data in (str(tmp_path / "empty.mp4"), b""):
        with pytest.raises(BadVideo, match=r"^empty file \(0 bytes\)$"):
            probe(data)
    with pytest.raises(BadVideo, match="is a folder, not a video file"):
        probe(str(tmp_path))


@pytest.mark.parametrize("what,reason", [("missing", "missing file: no file at "), ("empty", "empty file (0 bytes)"),
                                         ("garbage", "not a readable video container")])
def test_a_bad_video_is_named_as_a_video_with_its_reason(tmp_path, what, reason):
    src = llava_video(tmp_path, n=4, with_images=False)
    bad = tmp_path / json.loads((tmp_path / "data.json").read_text())[1]["video"]
    if what == "missing":
        bad.unlink()
    else:
        bad.write_bytes(b"" if what == "empty" else b"\x00junk" * 64)
    with pytest.raises(SourceError) as e:
        run_steps(video_spec([src], dp=1))
    msg = str(e.value)
    assert f"record 1: video {bad}: {reason}" in msg, msg
    assert "image video" not in msg and "<none>" not in msg
    if what != "garbage":
        assert "not a readable video container" not in msg
    _, report = run_steps(video_spec([{**src, "on_error": "skip"}], dp=1))
    lines = report["llava_video"]["messages"]
    named = re.compile(rf"record 1( \(epoch \d+\))?: video {re.escape(str(bad))}: {re.escape(reason)}")
    assert lines and all(named.search(m) for m in lines), lines


def test_llava_paths_without_image_root_are_the_json_file_s_folder(tmp_path, monkeypatch):
    """The JSON names `videos/v00.mp4` and `img1.png`; run from another folder, they are still found."""
    src = llava_video(tmp_path / "data", n=4)
    del src["image_root"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    batches, report = run_steps(video_spec([src], dp=1), steps=2)
    assert not report["llava_video"]["skipped"]
    assert sum(len(mb.video_grid) for mb in batches) >= 4 and sum(mb.num_images for mb in batches) >= 2


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_plait_run_says_the_video_is_missing_in_one_line(tmp_path):
    """As a user runs it: `plait run` on a spec whose video is gone exits non-zero with the reason, no traceback."""
    src = llava_video(tmp_path / "data", n=4, with_images=False)
    del src["image_root"]
    gone = tmp_path / "data" / json.loads((tmp_path / "data" / "data.json").read_text())[2]["video"]
    gone.unlink()
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(video_spec([src], dp=1)))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    plait_cli = str(Path(sys.executable).parent / "plait")
    out = subprocess.run([plait_cli, "run", str(spec), "--steps", "1", "--quiet"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=110)
    assert out.returncode != 0
    assert f"record 2: video {gone}: missing file: no file at {gone}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
