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


def test_the_audio_workload_is_balanced_and_llm_only_is_not(tmp_path):
    """Audio + text + images (issue 42): the audio encoder's cost (padded 30 s windows) in the total; plait's
    max/LB within 1.02 of the bound, the text-only balancer visibly worse."""
    out = tmp_path / "audio.json"
    assert bench_main(multimodal, ["--workloads", "audio", "--dp", "8", "--seq-len", "8192", "--repeats", "1",
                                   "--quiet", "--json", str(out)]) == 0
    by = {r["strategy"]: r for r in json.loads(out.read_text())}
    assert 0.3 < by["plait"]["encoder_share"] < 0.9
    assert by["plait"]["max_over_lb"] <= 1.02 < by["llm-only"]["max_over_lb"]
