"""`plait demo --audio`, and what `plait run` and `plait inspect` show of audio: the demo's audio spec adds
generated clips as an audio+text source and leaves demo.yaml alone; a run reports the seconds of audio it
delivered (the clips' planned durations) and per second; inspect shows each previewed clip's duration,
windows and tokens as the window policy plans them from the headers."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import yaml

from plait.cli import main

pytest.importorskip("av")

from plait.cli.audio_data import audio_source_spec, demo_audio_spec, write_audio_source  # noqa: E402
from plait.media.audio import AudioPolicy, probe  # noqa: E402
from plait.spec import load_spec  # noqa: E402


def test_demo_audio_spec_adds_an_audio_source(tmp_path):
    base = {"sources": [{"name": "t", "path": "t.jsonl", "text_field": "text"}], "images": {"image_token_id": 300}}
    (tmp_path / "demo.yaml").write_text(yaml.safe_dump(base))
    (tmp_path / "demo-video.yaml").write_text(yaml.safe_dump(base))
    before = (tmp_path / "demo.yaml").read_text()
    path = demo_audio_spec(tmp_path / "demo.yaml", 302, clips=5)
    assert path.name == "demo-audio.yaml" and (tmp_path / "demo.yaml").read_text() == before
    spec = load_spec(path)
    assert spec.sources[-1].audio_field == "audio" and spec.audio.audio_token_id == 302
    records = json.loads((tmp_path / "audio" / "audio.json").read_text())
    assert len(records) == 5 and all("<audio>" in r["conversations"][0]["value"] for r in records)
    exts = {r["audio"].rsplit(".", 1)[1] for r in records}
    assert exts == {"wav", "flac", "mp3", "ogg", "m4a"}
    assert demo_audio_spec(tmp_path / "demo-video.yaml", 302).name == "demo-video-audio.yaml"  # clips written once
    assert len(list((tmp_path / "audio" / "audio").iterdir())) == 5


def seconds_of(summary_text: str) -> float:
    found = re.search(r"audio clips delivered \(seconds of audio\)\s*│\s*([\d,]+) \(([\d,.]+) s\)", summary_text)
    assert found, summary_text
    return float(found.group(2).replace(",", ""))


def test_demo_audio_streams_and_reports_audio_seconds(demo_spec_path, tmp_path, monkeypatch, capsys):
    import plait.cli.audio_data as audio_data

    cache = tmp_path / "demo"
    shutil.copytree(demo_spec_path.parent, cache)
    monkeypatch.setattr(audio_data, "DEMO_CLIPS", 6)  # few clips: the test's time is the encoding's
    out = tmp_path / "demo.json"
    assert main(["demo", "--audio", "--steps", "1", "--cache", str(cache), "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["audio_clips"] > 0 and summary["audio_seconds"] > 0 and summary["audio_seconds_per_s"] > 0
    assert summary["mixture"]["audio"]["achieved"] > 0
    assert seconds_of(capsys.readouterr().out) == pytest.approx(summary["audio_seconds"], abs=0.05)
    assert "audio" not in (cache / "demo.yaml").read_text()

    # plait run on the same spec: the same clips' seconds, from the same deterministic plan
    run_out = tmp_path / "run.json"
    assert main(["run", str(cache / "demo-audio.yaml"), "--steps", "1", "--json", str(run_out)]) == 0
    ran = json.loads(run_out.read_text())
    assert ran["audio_seconds"] == pytest.approx(summary["audio_seconds"]) and ran["digests"] == summary["digests"]
    assert "seconds of audio per second" in capsys.readouterr().out


def test_inspect_shows_each_clips_duration_windows_and_tokens(tmp_path, capsys):
    source = write_audio_source(tmp_path, 3, longest=40.0, seed=3)  # one clip over 30 s: two windows
    spec = {"sources": [audio_source_spec(source)], "audio": {"audio_token_id": 300, "policy": "chunked"},
            "images": {"image_token_id": 301}, "packing": {"seq_len": 4096}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    assert main(["inspect", str(tmp_path / "spec.yaml"), "--docs", "3"]) == 0
    out = capsys.readouterr().out
    assert "audio clips of the first documents" in out
    plans = {p.name: AudioPolicy("chunked").plan(probe(p)) for p in (tmp_path / "audio").iterdir()}
    assert max(p.windows for p in plans.values()) == 2
    for name, plan in plans.items():
        row = next(line for line in out.splitlines() if name in line)
        cells = [c.strip() for c in row.split("│") if c.strip()]
        assert [cells[3], cells[5], cells[6]] == [f"{plan.seconds:.2f}", str(plan.windows), f"{plan.tokens:,}"]
