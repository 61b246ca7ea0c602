"""`plait bench images --path` and `plait bench video --path`: a user measures on their own files (a folder,
searched recursively, or a glob); a file that fails is skipped and named; a path with no such files is one
sentence. `python -m benchmarks.video_resize` measures the reference resize against `fast_resize` on them."""

from __future__ import annotations

import json

import pytest

from plait.cli import main


@pytest.fixture
def photo_folder(tmp_path):
    from mm_data import image_bytes

    folder = tmp_path / "photos"
    (folder / "trip").mkdir(parents=True)
    for i in range(5):
        fmt = "PNG" if i % 2 else "JPEG"
        (folder / "trip" / f"p{i}.{fmt.lower().replace('jpeg', 'jpg')}").write_bytes(image_bytes(90 + 13 * i, 70, fmt, seed=i))
    (folder / "broken.jpg").write_bytes(b"not a jpeg" * 20)
    (folder / "notes.txt").write_text("not an image at all")
    return folder


def test_bench_images_on_a_folder_of_the_user_s_files(photo_folder, tmp_path, capsys):
    out = tmp_path / "images.json"
    rc = main(["bench", "images", "--path", str(photo_folder), "--steps", "1", "--dp", "2", "--seq-len", "2048",
               "--rounds", "1", "--workers", "1", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["images_files"] == 6 and r["path"] == str(photo_folder)  # 5 pictures + broken.jpg, not notes.txt
    assert r["delivered_images"] > 0 and r["decodes_per_image_local"] == 1.0
    assert r["skipped"] >= 1 and any("broken.jpg" in m for m in r["errors"])
    assert "broken.jpg" in capsys.readouterr().err


def test_bench_images_path_with_no_images_is_one_sentence(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["bench", "images", "--path", str(tmp_path / "empty"), "--quiet"]) != 0
    err = capsys.readouterr().err
    assert f"--path {tmp_path / 'empty'}: no image files there" in err and "Traceback" not in err


def test_bench_video_on_a_glob_of_the_user_s_files(tmp_path):
    pytest.importorskip("av")
    from video_data import KINDS, write_videos

    write_videos(tmp_path / "clips", KINDS[:4])  # v00.mp4 v01.mp4 v02.webm v03.mkv
    out = tmp_path / "video.json"
    rc = main(["bench", "video", "--path", str(tmp_path / "clips" / "*.mp4"), "--steps", "1", "--dp", "1",
               "--seq-len", "2048", "--quiet", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["video_files"] == 2 and r["delivered_videos"] > 0 and r["skipped"] == 0
    assert r["decodes_per_video"] == 1.0 and r["planning_frame_decodes"] == 0


def test_benchmarks_video_resize_on_the_user_s_files(tmp_path):
    pytest.importorskip("av")
    from benchmarks import video_resize  # the benchmark under test
    from benchmarks.common import main as bench_main
    from video_data import KINDS, write_videos

    write_videos(tmp_path / "clips", KINDS[:4])
    out = tmp_path / "resize.json"
    assert bench_main(video_resize, ["--path", str(tmp_path / "clips" / "*.mp4"), "--json", str(out)]) == 0
    z = json.loads(out.read_text())
    assert z["videos"] == 2 and z["frames"] > 0
    assert z["reference_frames_per_s"] > 0 and z["fast_frames_per_s"] > 0
    assert z["max_abs_diff"] > 0 and 0 < z["share_differing"] <= 1  # the one-pass pixels are not the reference's


def test_bench_video_path_with_no_videos_is_one_sentence(tmp_path, capsys):
    assert main(["bench", "video", "--path", str(tmp_path / "*.mp4"), "--quiet"]) != 0
    err = capsys.readouterr().err
    assert "no video files there" in err and "Traceback" not in err
