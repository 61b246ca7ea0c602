"""`python -m benchmarks.multimodal`: image + text steps placed three ways (naive, llm-only, plait) under the
encoder + LLM cost and both capacities; plait beats a text-only balancer where the encoder dominates."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import multimodal  # the benchmark under test
from benchmarks.common import main as bench_main

ROOT = Path(__file__).resolve().parents[2]


def test_plait_beats_llm_only(tmp_path):
    out = tmp_path / "mm.json"
    assert bench_main(multimodal, ["--workloads", "caption,hires", "--dp", "8", "--seq-len", "8192",
                                   "--max-patches", "16384", "--repeats", "1", "--quiet", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {r["strategy"] for r in rows} == {"naive", "llm-only", "plait"}
    for workload in ("caption", "hires"):
        by = {r["strategy"]: r for r in rows if r["workload"] == workload}
        assert by["plait"]["encoder_share"] > 0.5  # the encoder dominates
        assert by["plait"]["max_over_lb"] < by["llm-only"]["max_over_lb"]
        if by["plait"]["samples_per_rank"] >= 8:
            assert by["plait"]["max_over_lb"] <= 1.02
        assert set(by["plait"]) >= {"workload", "dp", "strategy", "max_over_lb", "max_over_mean", "fill", "plan_ms"}


def test_help_runs_nothing_and_a_bad_workload_is_named():
    done = subprocess.run([sys.executable, "-m", "benchmarks.multimodal", "--help"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0 and "--workloads" in done.stdout
    assert bench_main(multimodal, ["--workloads", "mine", "--quiet"]) == 2
    assert bench_main(multimodal, ["--workloads", "audio-text", "--audio-policies", "whisper", "--quiet"]) == 2


def test_audio_rows_under_both_window_policies_and_plait_beats_llm_only(tmp_path):
    """Audio + text and audio + text + images (issue 42), each under qwen2audio (padded 30 s windows) and
    chunked: the audio encoder's cost is in the total; plait within 1.02 of the bound, the text-only
    balancer worse on every row and far worse where images join."""
    out = tmp_path / "audio.json"
    assert bench_main(multimodal, ["--workloads", "audio-text,audio-images", "--dp", "8", "--repeats", "1",
                                   "--quiet", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    steps = {(r["workload"], r["audio_policy"]) for r in rows}
    assert steps == {(w, p) for w in ("audio-text", "audio-images") for p in ("qwen2audio", "chunked")}
    share = {}
    for workload, policy in steps:
        by = {r["strategy"]: r for r in rows if (r["workload"], r["audio_policy"]) == (workload, policy)}
        share[workload, policy] = by["plait"]["encoder_share"]
        assert by["plait"]["max_over_lb"] <= 1.02
        assert by["plait"]["max_over_lb"] < by["llm-only"]["max_over_lb"]
        if workload == "audio-images":
            assert by["llm-only"]["max_over_lb"] > 1.05
    # padded windows cost the encoder more than chunks growing with the duration, on the same clips
    assert share["audio-text", "qwen2audio"] > 2 * share["audio-text", "chunked"] > 0


def test_video_and_audio_video_rows_within_two_percent_of_the_bound(tmp_path):
    """Where the patch capacity binds (video: ~40% of a step fits nowhere), the first pass's cost cap is set
    from all the step's items and too loose for the ones that fit: plait was 1.07 over the bound on video
    at dp 64 and 1.023 on audio-video at dp 8 (issue 42) until the pass capped at the placed items' bound."""
    out = tmp_path / "video.json"
    assert bench_main(multimodal, ["--workloads", "video,audio-video", "--dp", "8,64", "--repeats", "1",
                                   "--quiet", "--json", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text()) if r["strategy"] == "plait"]
    assert len(rows) == 2 + 2 * 2
    for r in rows:
        assert r["max_over_lb"] <= 1.02, r


def test_audio_takes_an_encoder_capacity_of_its_own(tmp_path):
    """--max-audio-spans gives the audio encoder its own capacity beside the patches (two encoder capacities,
    one vector balance): under qwen2audio each clip holds >= 1,500 positions, so 6,000 per micro-batch binds
    (far fewer samples fit a step) and plait still balances within 1.02."""
    rows = {}
    for extra in ([], ["--max-audio-spans", "6000"]):
        out = tmp_path / f"audio{len(extra)}.json"
        assert bench_main(multimodal, ["--workloads", "audio-text", "--dp", "8", "--audio-policies", "qwen2audio",
                                       "--repeats", "1", "--quiet", "--json", str(out), *extra]) == 0
        rows[bool(extra)] = {r["strategy"]: r for r in json.loads(out.read_text())}
    assert "max_audio_spans" not in rows[False]["plait"] and rows[True]["plait"]["max_audio_spans"] == 6000
    assert rows[True]["plait"]["placed"] < 0.5 * rows[False]["plait"]["placed"]
    assert rows[True]["plait"]["max_over_lb"] <= 1.02
    assert bench_main(multimodal, ["--workloads", "audio-text", "--max-audio-spans", "100", "--quiet"]) == 2
