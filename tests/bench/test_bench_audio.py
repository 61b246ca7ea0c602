"""`plait bench audio`: its smallest runs, on generated clips and on a folder of the user's files, give every
figure the issue asks for (plait decoding each clip once, planning decoding none, features within 1e-4 of
transformers' extractor); a bad file is named and left out; without transformers plait's own rate remains."""

from __future__ import annotations

import json
import sys

import pytest

from plait.cli import main

pytest.importorskip("av")
pytest.importorskip("transformers")

from plait.media.audio_synth import encode, speech_like  # noqa: E402


def bench(argv: list[str], out) -> dict:
    assert main(["bench", "audio", "--repeats", "1", "--quiet", "--json", str(out), *argv]) == 0
    return json.loads(out.read_text())


def test_generated_clips(tmp_path):
    r = bench(["--clips", "3", "--min-seconds", "0.5", "--max-seconds", "2"], tmp_path / "audio.json")
    assert r["clips"] == 3 and r["source"] == "generated" and r["skipped"] == 0
    assert r["planning_decodes"] == 0 and r["decodes_per_clip"] == 1.0
    assert r["max_feature_diff"] <= 1e-4 and r["plait_vs_float64"] < 3e-5
    assert r["ratio_wall"] > 0 and r["plain_audio_s_per_s"] > 0 and r["tokens"] >= 3 * 12
    assert r["baseline"].startswith("PyAV + transformers")


def test_users_folder_names_a_bad_file_and_measures_the_rest(tmp_path, capsys):
    clips = tmp_path / "clips"
    (clips / "deeper").mkdir(parents=True)
    (clips / "a.flac").write_bytes(encode(speech_like(22050, 1.5, 2), 22050, "flac"))
    (clips / "deeper" / "b.m4a").write_bytes(encode(speech_like(16000, 2.5, 6), 16000, "m4a"))
    (clips / "broken.mp3").write_bytes(b"ID3" + bytes(500))
    (clips / "tiny.wav").write_bytes(encode(speech_like(16000, 0.01, 1), 16000, "wav"))  # too short for a token
    (clips / "notes.txt").write_text("not audio")
    r = bench(["--path", str(clips), "--policy", "chunked", "--mel-bins", "80"], tmp_path / "audio.json")
    assert r["clips"] == 2 and r["source"] == str(clips) and r["policy"] == "chunked" and r["mel_bins"] == 80
    assert r["planning_decodes"] == 0 and r["decodes_per_clip"] == 1.0 and r["max_feature_diff"] <= 1e-4
    assert r["skipped"] == 2 and "broken.mp3" in r["errors"][0] and "tiny.wav: " in r["errors"][1]
    glob = bench(["--path", str(clips / "**" / "*.m4a")], tmp_path / "glob.json")
    assert glob["clips"] == 1 and glob["tokens"] == 62  # 2.5 s: the Qwen2-Audio processor's count
    (tmp_path / "none").mkdir()
    assert main(["bench", "audio", "--path", str(tmp_path / "none"), "--quiet"]) == 2
    assert "no audio files there" in capsys.readouterr().err


def test_without_transformers_plait_rate_only(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    r = bench(["--clips", "1", "--min-seconds", "1", "--max-seconds", "1"], tmp_path / "audio.json")
    assert r["ratio_wall"] is None and r["max_feature_diff"] is None and r["plain_wall_s"] is None
    assert "not installed" in r["baseline"] and r["plait_audio_s_per_s"] > 0 and r["decodes_per_clip"] == 1.0


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "audio", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "WhisperFeatureExtractor" in out and "--path" in out


def test_a_clip_a_few_samples_past_a_window_is_measured(tmp_path):
    """30.005 s: the last 80 samples are too short for a token, so plait keeps one window; the check compares
    the same samples on both sides instead of failing the whole run on the tail."""
    (tmp_path / "long.wav").write_bytes(encode(speech_like(16000, 30.005, 1, seed=3), 16000, "wav"))
    r = bench(["--path", str(tmp_path)], tmp_path / "audio.json")
    assert r["clips"] == 1 and r["skipped"] == 0 and r["max_feature_diff"] <= 1e-4
