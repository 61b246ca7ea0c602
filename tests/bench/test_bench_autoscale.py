"""`python -m benchmarks.autoscale`: its pure parts, and its smallest run on Ray (the three configurations deliver
the same stream: one digest; the JSON has every field the issue asks for)."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.common import main as bench_main
from benchmarks import autoscale as bench  # the benchmark under test
from plait.errors import PlaitError


def parsed(*argv: str):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(list(argv))


def test_sizes_and_their_validation():
    full, quick = bench.resolve(parsed()), bench.resolve(parsed("--quick"))
    assert 0 < full["warmup"] < full["change_at"] < full["steps"]
    assert quick["steps"] < full["steps"] and quick["images"] < full["images"]
    assert "rate" not in full  # calibrated in the run
    assert bench.resolve(parsed("--rate", "4"))["wait_tol_s"] == pytest.approx(0.025)
    with pytest.raises(PlaitError, match="change_at"):
        bench.resolve(parsed("--steps", "10", "--change-at", "12"))
    with pytest.raises(PlaitError, match="image-share"):
        bench.resolve(parsed("--image-share", "0.6"))
    with pytest.raises(PlaitError, match="rate"):
        bench.resolve(parsed("--rate", "0"))


def test_wait_windows_split_at_warmup_change_and_three_intervals():
    sizes = {"wait_tol_s": 0.05, "change_at": 10, "warmup": 2, "interval_s": 1.0, "rate": 2.0}
    waited = [True, True] + [False] * 7 + [True] + [True] * 6 + [False] * 4  # warm-up, step 9, 10..15
    fetch = [0.01] * 16 + [0.2] * 4  # slow transfers at the end, not waits
    w = bench.wait_windows(waited, fetch, sizes)
    assert w["wait_fraction_warm"] == pytest.approx(1 / 8)  # steps 2..9: step 9 waited
    assert w["transition_steps"] == [10, 16]  # 3 intervals x 2 steps/s
    assert w["wait_fraction_transition"] == 1.0
    assert w["wait_fraction_after"] == 0.0
    assert w["wait_fraction_all"] == pytest.approx(7 / 18)
    assert w["slow_fetch_fraction_warm"] == 0.0 and w["slow_fetch_fraction_after"] == 1.0


def test_cost_ratio_pools_the_loaders_counters_and_targets_compare_auto_with_fixed():
    rows = [{"produced": {"text": {"busy_s": 1.0, "tokens": 1e7}, "image": {"busy_s": 2.0, "tokens": 2e5}}},
            {"produced": {"text": {"busy_s": 1.0, "tokens": 1e7}, "image": {"busy_s": 2.0, "tokens": 2e5}}}]
    r = bench.cost_ratio(rows)
    assert r["ratio"] == pytest.approx(100.0) and r["image_us_per_token"] == pytest.approx(10.0)
    assert bench.cost_ratio([{"produced": None}]) is None
    auto = {"available": True, "wait_fraction_warm": 0.0, "wait_fraction_after": 0.1, "loader_cpu_s": 5.0,
            "loader_reserved_cpu_s": 9.0}
    t = bench.targets({"auto": auto, "fixed": dict(auto, loader_cpu_s=6.0, loader_reserved_cpu_s=8.0)})
    assert t == {"auto_waits_after_warmup_lt_5pct": True, "auto_back_under_5pct_within_3_intervals": False,
                 "auto_cpu_le_fixed": True, "auto_reserved_le_fixed": False}
    assert bench.targets({"auto": {"available": False}}) is None


def test_the_schedule_doubles_the_image_share_at_the_change(tmp_path):
    from plait.mixture import MixtureSchedule

    sizes = bench.resolve(parsed("--quick"))
    spec = bench.bench_spec(bench.make_data(tmp_path, 16, image_shards=4, text_files=2), sizes)
    mix = MixtureSchedule(spec)
    image = spec.source_names.index("image")
    before, after = mix.weights(sizes["change_at"] - 1)[image], mix.weights(sizes["change_at"])[image]
    assert after == pytest.approx(2 * before) and before == pytest.approx(sizes["image_share"])
    assert len(list((tmp_path / "image").glob("captions-*.jsonl"))) == 4  # partitionable
    cal = bench.calibrate(spec, sizes, steps=1)
    assert cal["image_s_per_token"] > 0 and 0.5 <= cal["rate"] <= 8.0
    # a quarter of the cores at the change -> a lower rate (within the clamp)
    cal2 = bench.calibrate(spec, dict(sizes, image_cores=sizes["image_cores"] / 4), steps=1)
    assert cal2["rate"] < cal["rate"] or cal["rate"] == 0.5


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_smallest_run_gives_one_digest_and_every_field(tmp_path, ray_session):
    """On the session's Ray instance (the bench starts one only where none runs)."""
    out = tmp_path / "autoscale.json"
    rc = bench_main(bench, ["--steps", "6", "--change-at", "3", "--warmup", "1", "--images", "16",
                     "--rate", "10", "--seq-len", "1024", "--cpus", "2", "--quiet", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    rows = {c["config"]: c for c in r["configs"]}
    assert set(rows) == {"fixed", "probe", "auto"}
    ran = [c for c in rows.values() if c["available"]]
    assert {"fixed", "probe"} <= {c["config"] for c in ran}
    assert r["same_digest"] is True and len({c["digest"] for c in ran}) == 1
    for c in ran:
        for field in ("wait_fraction_warm", "wait_fraction_transition", "wait_fraction_after", "loader_cpu_s",
                      "build_wait_s", "slow_fetch_fraction_after",
                      "loader_reserved_cpu_s", "rescale_events", "tokens_per_s", "digest", "peak_loaders"):
            assert field in c, (c["config"], field)
        assert c["loader_cpu_s"] > 0 and c["loader_reserved_cpu_s"] > 0 and c["tokens_per_s"] > 0
        assert c["tokens"] == rows["fixed"]["tokens"]
    if rows["auto"]["available"]:
        assert rows["fixed"]["loaders_at_start"] == rows["auto"]["peak_loaders"]  # fixed: auto's peak
