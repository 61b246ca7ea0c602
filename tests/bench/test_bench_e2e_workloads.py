"""`python -m benchmarks.e2e_workloads`: the project's end-to-end workloads beyond `plait bench e2e`
(long-context with fixed and dynamic CP, cpu-pool, node-images): its command line, a tiny long-context run,
a failed workload reported with the rows it ran, and the cpu-pool cluster's object store. The node-images and
cpu-pool runs (~40-80 s on 2 cores) are `lab` tests: `pytest -m lab`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import e2e_workloads  # the benchmark under test
from benchmarks.common import main as bench_main

ROOT = Path(__file__).resolve().parents[2]


def run(*argv: str) -> int:
    return bench_main(e2e_workloads, list(argv))


def test_help_lists_the_workloads_and_measures_nothing():
    done = subprocess.run([sys.executable, "-m", "benchmarks.e2e_workloads", "--help"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0 and "cpu-pool" in done.stdout and "--long-seq" in done.stdout
    assert run("--workloads", "mine") == 2  # a PlaitError: one line, no measurement


def test_long_context_rows_and_ratios(tmp_path):
    """The four strategies on one length mix, the dynamic-CP figures in every row, ratios naming strategy,
    mix, seq_len, DP and micro-batches, and a planning-time row (a tiny run)."""
    out = tmp_path / "e2e.json"
    assert run("--workloads", "long-context", "--long-mixes", "long-tail", "--long-seq", "8192", "--long-dp", "4",
               "--long-steps", "2", "--long-microbatches", "1", "--long-plan-ranks", "16", "--long-plan-steps", "2",
               "--cache", str(tmp_path / "data"), "--quiet", "--json", str(out)) == 0
    result = json.loads(out.read_text())
    rows = [r for r in result["rows"] if r["workload"] == "long-context"]
    assert {(r["mix"], r["strategy"]) for r in rows} == {
        ("long-tail", s) for s in ("per-rank", "plait", "plait-fixed-cp", "plait-dcp")}
    for r in rows:
        assert r["clock"] == "simulated" and r["steps"] == 2 and r["steps_per_s"] > 0
        assert r["interconnect"]["bandwidth_gbps"] == 450 and r["interconnect"]["ranks_per_node"] == 8
        assert r["max_over_lb"] >= 1 - 1e-9
        if r["strategy"] != "per-rank":
            assert {"plan_ms", "comm_share", "padding", "waves"} <= set(r)
    dcp = [r for r in rows if r["strategy"] == "plait-dcp"]
    assert all(r["waves"] >= 1 and r["padding"] < 0.05 and 0 <= r["comm_share"] < 1 for r in dcp)
    assert next(r for r in rows if r["strategy"] == "plait-fixed-cp")["cp"] == 4
    ratios = [q for q in result["ratios"] if q["workload"] == "long-context"]
    assert len(ratios) == 3 and all({"strategy", "mix", "seq_len", "dp", "microbatches", "steps_per_s_ratio"} <= set(q)
                                    for q in ratios)
    assert all("over_plait" in q for q in ratios if q["strategy"] == "plait-dcp")
    planning = [r for r in result["rows"] if r["workload"] == "long-context-planning"]
    assert len(planning) == 1 and planning[0]["ranks"] == 16
    assert planning[0]["plan_ms_p95"] >= planning[0]["plan_ms_p50"] > 0 < planning[0]["plan_cpu_ms_p50"]


def test_a_workload_whose_plait_side_fails_is_reported_and_keeps_the_rows_that_ran(tmp_path, monkeypatch):
    def ray_did_not_start(args, spec, clock, autoscale, err):
        e = RuntimeError("The current node timed out during startup")
        e.rows = [{"workload": "cpu-pool", "dp": 2, "seq_len": 2048, "strategy": "per-rank", "steps_per_s": 1.0,
                   "tokens_per_s": 1.0, "wait_fraction": 0.0, "balance_loss": 0.0}]
        raise e

    monkeypatch.setattr(e2e_workloads, "run_cpu_pool", ray_did_not_start)
    out = tmp_path / "e2e.json"
    assert run("--workloads", "cpu-pool", "--dp", "2", "--images", "16", "--cache", str(tmp_path / "data"), "--quiet",
               "--json", str(out)) == 1
    result = json.loads(out.read_text())
    assert [(r["workload"], r["strategy"]) for r in result["rows"]] == [("cpu-pool", "per-rank")]
    assert [f["workload"] for f in result["failures"]] == ["cpu-pool"] and "timed out" in result["failures"][0]["error"]


def test_cpu_pool_ray_nodes_get_more_object_store_than_ray_cluster_utils_150_mib(monkeypatch):
    """ray.cluster_utils gives each node 150 MiB: the cpu-pool Ray row's head spilled a step's image batches
    to disk and stalled (0.1 steps/s). Each node now gets 30% of the available memory over the cluster's
    3 nodes, 1-4 GiB (e2e_workloads.node_object_store)."""
    from benchmarks.e2e_workloads import MAX_NODE_STORE, MIN_NODE_STORE, node_object_store

    assert MIN_NODE_STORE <= node_object_store() <= MAX_NODE_STORE and MIN_NODE_STORE >= 1 << 30
    gib, page = 1 << 30, 4096
    for available, per_node in ((2 * gib, MIN_NODE_STORE), (20 * gib, 2 * gib), (100 * gib, MAX_NODE_STORE)):
        monkeypatch.setattr(e2e_workloads.os, "sysconf",
                            lambda name, a=available: a // page if name == "SC_AVPHYS_PAGES" else page)
        assert node_object_store() == pytest.approx(per_node, abs=1), available


@pytest.mark.subprocess
@pytest.mark.lab
def test_node_images_runs_torchrun_style_processes_both_ways(tmp_path):
    out = tmp_path / "e2e.json"
    assert run("--quick", "--workloads", "node-images", "--node-dp", "2", "--node-workers", "2", "--node-steps", "3",
               "--seq-len", "4096", "--cache", str(tmp_path / "data"), "--quiet", "--json", str(out)) == 0
    result = json.loads(out.read_text())
    rows = {r["strategy"]: r for r in result["rows"]}
    assert set(rows) == {"per-rank", "plait"} and all(r["workload"] == "node-images" for r in rows.values())
    assert all(r["images_per_s"] > 0 and r["workers"] == 2 for r in rows.values()), rows
    [q] = result["ratios"]
    assert q["steps_per_s_ratio"] == pytest.approx(rows["plait"]["images_per_s"] / rows["per-rank"]["images_per_s"])


@pytest.mark.subprocess
@pytest.mark.lab
def test_cpu_pool_serves_plaits_local_data_plane_from_the_pool_over_flight(tmp_path):
    """cpu-pool without Ray: per-rank pinned to the trainers' core; plait's `plait serve --runtime local` on the
    pool's cores and the trainers' (as the Ray row's loaders), the rank threads reading over Flight; the same
    steps, the ratio names its runtime."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("cpu-pool needs 2 cores")
    out = tmp_path / "e2e.json"
    assert run("--workloads", "cpu-pool", "--cpu-pool-runtimes", "serve", "--dp", "2", "--cpus", "2", "--steps", "3",
               "--warmup", "1", "--images", "24", "--cache", str(tmp_path / "data"), "--quiet", "--json", str(out)) == 0
    result = json.loads(out.read_text())
    rows = {r["strategy"]: r for r in result["rows"]}
    assert set(rows) == {"per-rank", "plait"} and all(r["workload"] == "cpu-pool" for r in rows.values())
    served = rows["plait"]
    assert served["runtime"] == "serve" and served["server_cores"] == cores and served["pool_cores"] == cores[1:]
    assert served["steps"] == rows["per-rank"]["steps"] == 3 and served["images_delivered"] > 0
    assert sorted(os.sched_getaffinity(0)) == cores  # this process's cores are given back
    [q] = result["ratios"]
    assert q["workload"] == "cpu-pool" and q["runtime"] == "serve"
    assert q["steps_per_s_ratio"] == pytest.approx(served["steps_per_s"] / rows["per-rank"]["steps_per_s"])
