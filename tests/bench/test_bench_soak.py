"""`python -m benchmarks.soak`: processes by role, the slope fit, and a brief run end to end (shape only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.soak_sampler import MIB, actor_role, classify, role_table, slope_per_hour, band_slope_per_hour

ROOT = Path(__file__).resolve().parents[2]


def test_roles_come_from_what_started_a_process_or_its_ray_title():
    assert actor_role("ray::PlannerActor.step_plan") == "planner"
    assert actor_role("ray::PlannerHostActor") == "planner"
    assert actor_role("ray::LoaderActor.fetch") == "loader"
    assert actor_role("ray::ShadowActor") == "loader"
    assert actor_role("ray::ConstructorActor.get_batch") == "constructor"
    assert actor_role("ray::job-1dff1b3ae24a/planner:PlannerActor.__init__") == "planner"  # named actor's title
    assert actor_role("ray::job-1dff1b3ae24a/loader-1:LoaderActor.__init__") == "loader"
    assert actor_role("ray::IDLE") is None and actor_role("/usr/bin/python -m x") is None
    started = {10: "driver"}
    assert classify("python plait run", started, 10) == "driver"
    assert classify("ray::IDLE", started, 11) == "ray"
    assert classify("/venv/lib/ray/core/src/ray/gcs/gcs_server --session-dir=/tmp/x", started, 12) == "ray"


def test_slope_is_least_squares_in_mib_per_hour_and_the_warmup_is_left_out():
    t = [float(x) for x in range(0, 600, 10)]
    # 100 MiB during the warm-up (first 120 s), then 1 MiB more per minute: 60 MiB/hour
    rss = [(100 if x < 120 else 200) * MIB + x / 60 * MIB for x in t]
    assert slope_per_hour(t[12:], rss[12:]) == pytest.approx(60.0)
    samples = [{"t": x, "roles": {"driver": {"rss": r, "pss": r // 2, "n": 1}}} for x, r in zip(t, rss)]
    rows = {r["role"]: r for r in role_table(samples, warmup_s=120)}
    d = rows["driver"]
    assert d["slope_mib_per_hour"] == pytest.approx(60.0, abs=0.01) and d["growth_mib_per_day"] == pytest.approx(1440, abs=1)
    assert d["late_slope_mib_per_hour"] == pytest.approx(60.0, abs=0.01)  # steady growth: the 2nd half too
    assert d["rss_start_mib"] == pytest.approx(202.0) and d["samples"] == 48 and d["fit_from_s"] == 120
    assert d["pss_slope_mib_per_hour"] == pytest.approx(30.0, abs=0.01)
    assert d["band_slope_mib_per_hour"] == pytest.approx(60.0, rel=0.05)  # steady growth: the band's edges too


def test_a_band_with_a_tooth_at_the_end_tilts_the_fit_but_not_the_bands_edges():
    """A loader's buffers fill and are trimmed: RSS in a 10 MiB band; its last samples at the band's top."""
    t = np.arange(0.0, 1800.0, 5.0)
    rss = (400 + 10 * ((t // 100) % 2)) * MIB  # 100 s low, 100 s high, ...
    rss[-30:] = 410 * MIB  # the last 150 s high
    assert slope_per_hour(t, rss) > 3  # least squares: a few MiB/hour from one tooth
    assert band_slope_per_hour(t, rss) == pytest.approx(0.0, abs=0.5)


def test_the_fit_starts_a_warmup_after_the_last_role_appeared_and_its_second_half_shows_flattening():
    """A role that starts late (Ray's Constructor at the first build) would turn its start-up into a slope;
    a warm-up that flattens has a steep first half and a flat second one."""
    t = [float(x) for x in range(0, 900, 10)]
    # the driver rises 60 MiB over its first 400 s, then stays; the constructor appears at 300 s
    samples = [{"t": x, "roles": {"driver": {"rss": (200 + min(x, 400) * 0.15) * MIB, "pss": None, "n": 1},
                                  **({"constructor": {"rss": 150 * MIB, "pss": None, "n": 1}} if x >= 300 else {})}}
               for x in t]
    rows = {r["role"]: r for r in role_table(samples, warmup_s=60)}
    assert rows["constructor"]["fit_from_s"] == 360 and rows["constructor"]["slope_mib_per_hour"] == 0
    d = rows["driver"]
    assert d["samples"] == 54 and d["rss_start_mib"] == pytest.approx(254.0)
    assert d["slope_mib_per_hour"] > 5 and d["late_slope_mib_per_hour"] == pytest.approx(0.0, abs=1e-6)
    assert "pss_start_mib" not in d
    # too few samples after the last role's warm-up: the warm-up counts from the start instead
    assert role_table(samples[:38], warmup_s=60)[0]["fit_from_s"] == 60


@pytest.mark.subprocess
def test_a_brief_local_soak_reports_every_role_with_samples(tmp_path):
    out = tmp_path / "soak.json"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.soak", "--minutes", "0.1", "--interval-s", "0.5",
                           "--exit-grace-s", "1", "--runtime", "local", "--sources", "4", "--json", str(out), "--plot",
                           str(tmp_path / "soak.png")], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["runtime"] == "local" and got["minutes"] == pytest.approx(0.1)
    assert [r["role"] for r in got["roles"]] == ["driver"]
    row = got["roles"][0]
    for key in ("rss_start_mib", "rss_end_mib", "slope_mib_per_hour", "growth_mib_per_day"):
        assert isinstance(row[key], float)
    assert row["rss_start_mib"] > 10 and row["samples"] >= 3
    assert len(got["samples"]) >= 5 and all("driver" in s["rss_mib"] for s in got["samples"][:3])
    assert isinstance(got["left_after_exit"], list) and got["exit_grace_s"] == 1
    assert (tmp_path / "soak.png").stat().st_size > 0
    assert "slope" in proc.stdout and "2nd half" in proc.stdout and "driver" in proc.stdout  # headers may wrap


def test_memory_trace_names_the_site_that_keeps_growing(tmp_path):
    """PLAIT_TRACEMALLOC's dump: a list that grows between the baseline and the dump is the top site,
    with this file's line in its stack; a test that could not find it would fail."""
    import tracemalloc

    from plait.telemetry import MemoryTrace

    held = []
    trace = MemoryTrace(str(tmp_path), every=3600.0)  # the thread sleeps past the test: dumps are called here
    trace.start()
    try:
        trace.dump()  # the baseline
        for _ in range(200):
            held.append(bytearray(16_384))  # ~3 MiB held
        trace.dump()
    finally:
        tracemalloc.stop()
    (out,) = tmp_path.iterdir()
    text = out.read_text()
    head, first = text.splitlines()[:2]
    assert head.startswith("=== t=") and "traced=" in head and "rss=" in head
    growth_kib = float(first.split("KiB")[0])
    assert growth_kib > 3000, first
    stack = []
    for line in text.splitlines()[2:]:
        if "KiB" in line:
            break
        stack.append(line)
    assert any("test_bench_soak.py" in frame for frame in stack), stack
    assert len(held) == 200


def test_rays_own_processes_are_fitted_by_name():
    from benchmarks.soak_sampler import ray_process_table

    t = [float(x) for x in range(0, 600, 10)]
    samples = [{"t": x, "roles": {"ray": {"rss": 1, "pss": None, "n": 2}},
                "ray_processes": {"gcs_server": 100 * MIB + x / 3600 * 36 * MIB, "raylet": 50 * MIB}} for x in t]
    rows = {r["name"]: r for r in ray_process_table(samples, warmup_s=120)}
    assert rows["gcs_server"]["slope_mib_per_hour"] == pytest.approx(36.0, abs=0.01)
    assert rows["raylet"]["slope_mib_per_hour"] == pytest.approx(0.0, abs=1e-6)
    assert rows["raylet"]["rss_end_mib"] == 50.0
