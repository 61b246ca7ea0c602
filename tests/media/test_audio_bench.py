"""`python -m benchmarks.audio`: its smallest runs, on generated clips and on a folder of the user's files,
give every figure the issue asks for, with plait decoding each clip once and planning decoding none."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("av")
pytest.importorskip("transformers")

from benchmarks import audio as bench  # noqa: E402
from benchmarks.common import main as bench_main  # noqa: E402
from plait.media.audio_synth import encode, speech_like  # noqa: E402


def check(result: dict, clips: int) -> None:
    assert result["clips"] == clips
    assert result["planning_decodes"] == 0 and result["decodes_per_clip"] == 1.0
    assert result["max_feature_diff"] <= 1e-4 and result["plait_vs_float64"] < 3e-5
    assert result["ratio_wall"] > 0 and result["plait_wall_s"] > 0 and result["tokens"] > 0
    assert result["run"]["command"].startswith("python -m benchmarks.audio")


def test_generated_clips(tmp_path):
    out = tmp_path / "audio.json"
    assert bench_main(bench, ["--clips", "2", "--repeats", "1", "--max-seconds", "3", "--json", str(out)]) == 0
    check(json.loads(out.read_text()), 2)


def test_users_folder(tmp_path, capsys):
    (tmp_path / "clips" / "deeper").mkdir(parents=True)
    (tmp_path / "clips" / "a.flac").write_bytes(encode(speech_like(22050, 1.5, 2), 22050, "flac"))
    (tmp_path / "clips" / "deeper" / "b.m4a").write_bytes(encode(speech_like(16000, 2.5, 1), 16000, "m4a"))
    (tmp_path / "clips" / "notes.txt").write_text("not audio")
    out = tmp_path / "audio.json"
    argv = ["--path", str(tmp_path / "clips"), "--repeats", "1", "--policy", "chunked", "--mel-bins", "80"]
    assert bench_main(bench, [*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    check(result, 2)
    assert result["source"] == str(tmp_path / "clips") and result["policy"] == "chunked"
    (tmp_path / "none").mkdir()
    assert bench_main(bench, ["--path", str(tmp_path / "none")]) == 2
    assert "no audio files" in capsys.readouterr().err
