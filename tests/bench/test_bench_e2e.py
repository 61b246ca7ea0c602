"""`plait bench e2e`: a short whole run (both strategies, DP 4, a few steps, ~10 s with Ray's start), and
the pure parts: the synchronous step clock, balance loss, the summary, the per-rank greedy packer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from plait.cli.bench.e2e_run import (
    GpuClock,
    Trace,
    balance_loss,
    run_synchronous,
    summarize,
)
from plait.cli.bench.e2e_per_rank import Document, pack_greedy
from plait.cost import CostModel, EncoderCost
from plait.errors import PlaitError


ROW_KEYS = {"workload", "dp", "seq_len", "strategy", "steps_per_s", "tokens_per_s", "wait_fraction", "balance_loss"}


@pytest.mark.ray
def test_short_run_feeds_both_strategies_the_same_steps_and_plait_balances_better(tmp_path):
    from plait.cli import main

    out = tmp_path / "e2e.json"
    # --gpu-tflops high: tiny simulated compute, so the run is short (rates are not asserted: benchmarks)
    argv = ["bench", "e2e", "--quick", "--workloads", "gpu-bound,long-context", "--dp", "4", "--steps", "4",
            "--warmup", "1", "--gpu-tflops", "4000", "--cpus", "2", "--long-seq", "4096", "--long-dp", "4", "--long-steps", "2",
            "--cache", str(tmp_path / "data"), "--quiet", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert len(result["load_average"]["before"]) == 3 and len(result["load_average"]["after"]) == 3
    assert all(ROW_KEYS <= set(r) for r in result["rows"])
    rows = {(r["workload"], r["strategy"], r["dp"], r["seq_len"]): r for r in result["rows"]}
    assert set(rows) == {("gpu-bound", s, 4, 8192) for s in ("per-rank", "plait")} | {
        ("long-context", s, 4, 4096) for s in ("per-rank", "plait", "plait-fixed-cp", "plait-dcp")}
    per_rank, plait = rows["gpu-bound", "per-rank", 4, 8192], rows["gpu-bound", "plait", 4, 8192]
    assert per_rank["steps"] == plait["steps"] == 4 and per_rank["measured_steps"] == plait["measured_steps"] == 3
    # a budget of 2 CPUs: per-rank still has one worker process a rank (at least one), plait 2 loaders at most
    assert per_rank["processes"] == 4 and per_rank["workers_per_rank"] == 1 and plait["loaders_at_start"] <= 2
    assert plait["balance_loss"] <= per_rank["balance_loss"]
    capacity = 4 * 2 * 8192  # dp x micro-batches x seq_len
    for r in (per_rank, plait):
        assert 0.5 * capacity < r["tokens_per_step"] <= capacity
        assert 0.0 <= r["wait_fraction"] <= 1.0 and r["steps_per_s"] > 0
    long_pr, long_plait = rows["long-context", "per-rank", 4, 4096], rows["long-context", "plait", 4, 4096]
    assert long_plait["clock"] == long_pr["clock"] == "simulated" and long_plait["steps"] == long_pr["steps"] == 2
    ratios = {(q["workload"], q["dp"], q["seq_len"]): q for q in result["ratios"]}
    assert set(ratios) == {("gpu-bound", 4, 8192), ("long-context", 4, 4096)}
    assert ratios["gpu-bound", 4, 8192]["steps_per_s_ratio"] == pytest.approx(plait["steps_per_s"] / per_rank["steps_per_s"])


@pytest.mark.subprocess
def test_node_images_runs_torchrun_style_processes_both_ways(tmp_path):
    from plait.cli import main

    out = tmp_path / "e2e.json"
    argv = ["bench", "e2e", "--quick", "--workloads", "node-images", "--node-dp", "2", "--node-workers", "2",
            "--node-steps", "3", "--seq-len", "4096", "--cache", str(tmp_path / "data"), "--quiet", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    rows = {r["strategy"]: r for r in result["rows"]}
    assert set(rows) == {"per-rank", "plait"} and all(r["workload"] == "node-images" for r in rows.values())
    assert all(r["images_per_s"] > 0 and r["workers"] == 2 for r in rows.values()), rows
    [q] = result["ratios"]
    assert q["steps_per_s_ratio"] == pytest.approx(rows["plait"]["images_per_s"] / rows["per-rank"]["images_per_s"])


@pytest.mark.subprocess
def test_cpu_pool_serves_plaits_local_data_plane_from_the_pool_over_flight(tmp_path):
    """cpu-pool without Ray: per-rank pinned to the trainers' core; plait's `plait serve --runtime local` on the
    pool's cores and the trainers' (as the Ray row's loaders), the rank threads reading over Flight; the same
    steps, the ratio names its runtime."""
    import os

    from plait.cli import main

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("cpu-pool needs 2 cores")
    out = tmp_path / "e2e.json"
    argv = ["bench", "e2e", "--workloads", "cpu-pool", "--cpu-pool-runtimes", "serve", "--dp", "2", "--cpus", "2",
            "--steps", "3", "--warmup", "1", "--images", "24", "--cache", str(tmp_path / "data"), "--quiet",
            "--json", str(out)]
    assert main(argv) == 0
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


@pytest.mark.subprocess
def test_data_bound_runs_plait_on_the_local_runtime_with_the_per_rank_budget(tmp_path):
    """data-bound without Ray: plait in this process (LocalRuntime all_ranks) decoding on --cpus threads,
    per-rank with --cpus worker processes; each image decoded once per delivery; the ratio names its runtime."""
    from plait.cli import main

    out = tmp_path / "e2e.json"
    argv = ["bench", "e2e", "--workloads", "data-bound", "--data-bound-runtimes", "local", "--dp", "2", "--cpus", "2",
            "--steps", "3", "--warmup", "1", "--images", "64", "--seq-len", "4096", "--cache", str(tmp_path / "data"),
            "--quiet", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert all(ROW_KEYS <= set(r) for r in result["rows"])
    rows = {r["strategy"]: r for r in result["rows"]}
    assert set(rows) == {"per-rank", "plait"} and all(r["workload"] == "data-bound" for r in rows.values())
    plait, per_rank = rows["plait"], rows["per-rank"]
    assert plait["runtime"] == "local" and plait["workers"] == 2 == per_rank["processes"]  # the same budget
    assert plait["images_delivered"] > 0 and plait["images_decoded"] == plait["images_delivered"]
    assert plait["steps"] == per_rank["steps"] == 3
    [q] = result["ratios"]
    assert q["runtime"] == "local"
    assert q["steps_per_s_ratio"] == pytest.approx(plait["steps_per_s"] / per_rank["steps_per_s"])


def test_a_workload_with_plait_on_two_runtimes_has_a_ratio_per_runtime():
    from plait.cli.bench.e2e import ratios

    base = {"workload": "data-bound", "dp": 8, "seq_len": 8192}
    rows = [{**base, "strategy": "per-rank", "steps_per_s": 2.0, "tokens_per_s": 10.0},
            {**base, "strategy": "plait", "runtime": "ray", "steps_per_s": 1.0, "tokens_per_s": 5.0},
            {**base, "strategy": "plait", "runtime": "local", "steps_per_s": 3.0, "tokens_per_s": 15.0}]
    assert ratios(rows) == [{**base, "steps_per_s_ratio": 1.5, "runtime": "local", "tokens_per_s_ratio": 1.5},
                            {**base, "steps_per_s_ratio": 0.5, "runtime": "ray", "tokens_per_s_ratio": 0.5}]


def test_ratios_pair_strategies_per_workload_dp_and_seq_len():
    from plait.cli.bench.e2e import ratios

    rows = [{"workload": "gpu-bound", "dp": 8, "seq_len": 32768, "strategy": "per-rank", "steps_per_s": 2.0,
             "tokens_per_s": 10.0},
            {"workload": "gpu-bound", "dp": 8, "seq_len": 32768, "strategy": "plait", "steps_per_s": 3.0,
             "tokens_per_s": 15.0},
            {"workload": "node-images", "dp": 8, "seq_len": 4096, "strategy": "per-rank", "steps_per_s": 1.0,
             "images_per_s": 40.0, "tokens_per_s": None},
            {"workload": "node-images", "dp": 8, "seq_len": 4096, "strategy": "plait", "steps_per_s": 1.0,
             "images_per_s": 50.0, "tokens_per_s": None}]
    assert ratios(rows) == [
        {"workload": "gpu-bound", "dp": 8, "seq_len": 32768, "steps_per_s_ratio": 1.5, "tokens_per_s_ratio": 1.5},
        {"workload": "node-images", "dp": 8, "seq_len": 4096, "steps_per_s_ratio": 1.25}]


def test_balance_loss_is_one_minus_mean_over_max_averaged_over_steps():
    computes = np.array([[1.0, 1.0, 1.0, 1.0],   # balanced: 0
                         [2.0, 1.0, 1.0, 0.0]])  # mean 1, max 2: 0.5
    assert balance_loss(computes) == pytest.approx(0.25)
    assert balance_loss(np.zeros((3, 2))) == 0.0


def test_summary_rates_leave_warmup_out():
    waits = np.array([[5.0, 5.0], [0.0, 0.5], [0.0, 0.0]])
    computes = np.array([[1.0, 1.0], [1.0, 0.5], [2.0, 1.0]])
    tokens = np.full((3, 2), 100.0)
    trace = Trace(start=0.0, waits=waits, computes=computes, tokens=tokens, step_ends=np.array([6.0, 7.5, 9.5]))
    s = summarize(trace, warmup=1)
    assert s["measured_steps"] == 2 and s["seconds"] == pytest.approx(3.5)
    assert s["steps_per_s"] == pytest.approx(2 / 3.5)
    assert s["wait_fraction"] == pytest.approx(0.5 / (2 * 3.5))
    assert s["balance_loss"] == pytest.approx(((1 - 0.75) + (1 - 0.75)) / 2)
    assert s["compute_bound_steps_per_s"] == pytest.approx(2 / 3.0)  # max per step: 1 + 2
    assert s["tokens_per_s"] == pytest.approx(400 / 3.5)
    assert s["startup_s"] == pytest.approx(6.0)
    assert s["step_seconds"] == pytest.approx([1.5, 2.0])  # each measured step's wall time


def test_step_clock_runs_every_rank_for_every_step_and_charges_the_cost_model():
    llm = CostModel(linear=1.0, quadratic=0.0)
    clock = GpuClock(llm, EncoderCost(linear=10.0, quadratic=0.0), flops_per_s=1e6)  # 1 us per token
    # micro-batch = (doc lengths, image patches, tokens): rank 1 gets twice rank 0's tokens, and an image
    streams = [iter([(np.array([100]), np.zeros(0, np.int64), 100)] * 6),
               iter([(np.array([150, 50]), np.array([20]), 200)] * 6)]
    trace = run_synchronous(streams, steps=3, microbatches=2, clock=clock, shape=lambda mb: mb)
    assert trace.computes.shape == (3, 2)
    assert trace.computes[:, 0] == pytest.approx([200e-6] * 3)
    assert trace.computes[:, 1] == pytest.approx([2 * (200 + 200) * 1e-6] * 3)  # tokens + encoder (10 x 20)
    assert trace.tokens.sum(axis=0).tolist() == [600, 1200]
    assert (np.diff(trace.step_ends) >= 0).all() and trace.step_ends[0] >= trace.start
    assert balance_loss(trace.computes) == pytest.approx(1 - 500 / 800)


def test_step_clock_stops_every_rank_when_one_stream_fails():
    clock = GpuClock(CostModel(1.0, 0.0), EncoderCost(0.0, 0.0), flops_per_s=1e9)
    short = iter([(np.array([10]), np.zeros(0, np.int64), 10)])  # one micro-batch, then exhausted
    long = iter([(np.array([10]), np.zeros(0, np.int64), 10)] * 10)
    with pytest.raises(StopIteration):
        run_synchronous([short, long], steps=3, microbatches=2, clock=clock, shape=lambda mb: mb)


def _text(n: int, start: int = 0) -> Document:
    return Document(np.arange(start, start + n, dtype=np.int32), [], [])


def _image(n: int, patches: int) -> Document:
    return Document(np.full(n, 7, np.int32), [np.zeros((patches, 3), np.uint8)], [np.array([1, 1, patches])])


def test_greedy_packing_fills_micro_batches_cutting_text_but_never_images():
    docs = iter([_text(6), _text(7, 100), _image(5, 8), _text(3, 200), _image(2, 4)])
    mbs = list(pack_greedy(docs, seq_len=10, max_patches=None))
    # [6, first 4 of the 7] | [its last 3, the 5-token image, first 2 of the 3-token text] | (open, not
    # emitted when the stream ends: its last token and the 2-token image)
    assert [len(m["input_ids"]) for m in mbs] == [10, 10]
    assert mbs[0]["cu_seqlens"].tolist() == [0, 6, 10]
    assert mbs[1]["cu_seqlens"].tolist() == [0, 3, 8, 10]
    assert mbs[1]["input_ids"][:3].tolist() == [104, 105, 106]  # the cut document continues in order
    assert mbs[1]["image_grid"].tolist() == [[1, 1, 8]] and len(mbs[1]["pixel_values"]) == 8
    assert mbs[0]["labels"][5] == -100  # no label crosses a document boundary


def test_greedy_packing_closes_a_micro_batch_for_an_image_that_does_not_fit():
    docs = iter([_text(4), _image(8, 2), _text(10, 50)])
    mbs = list(pack_greedy(docs, seq_len=10, max_patches=None))
    assert mbs[0]["cu_seqlens"].tolist() == [0, 4]  # padded: the image document is never cut
    assert mbs[1]["cu_seqlens"].tolist() == [0, 8, 10]
    docs = iter([_image(2, 6), _image(2, 6), _text(20)])  # the patch capacity closes it too
    mbs = list(pack_greedy(docs, seq_len=10, max_patches=8))
    assert [m["image_grid"][:, 2].tolist() for m in mbs[:2]] == [[6], [6]]


def test_bad_options_are_named(capsys):
    from plait.cli import main

    for argv, word in ((["--dp", "two"], "--dp"), (["--warmup", "20"], "--warmup"),
                       (["--gpu-tflops", "0"], "--gpu-tflops"), (["--strategies", "mine"], "--strategies"),
                       (["--workloads", "mine"], "--workloads"), (["--long-seq", "x"], "--long-seq"),
                       (["--long-max-delay", "-1"], "--long-max-delay")):
        assert main(["bench", "e2e", *argv]) == 2
        assert word in capsys.readouterr().err
    with pytest.raises(PlaitError):
        from types import SimpleNamespace

        from plait.cli.bench.e2e import parse

        parse(SimpleNamespace(quick=False, dp="4", steps=5, warmup=1, cpus=0, seq_len=8, microbatches=1,
                              images=1, gpu_tflops=1.0, image_weight=0.5, strategies="plait", long_seq="8",
                              long_dp="2", long_steps=1, node_dp=2, node_workers=2, node_steps=2,
                              data_bound_tflops=1.0, workloads="gpu-bound"))


def test_missing_torch_is_named(monkeypatch):
    import sys

    from plait.cli.bench.e2e_per_rank import require_torch

    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(PlaitError, match="needs torch"):
        require_torch()


def test_simulated_rows_report_the_lower_bound_no_placement_can_beat():
    from plait.cli.bench.e2e_workloads import simulated_row, step_lower_bound

    clock = GpuClock(CostModel(linear=1.0, quadratic=1.0), EncoderCost(linear=0.0, quadratic=0.0), flops_per_s=1.0)
    # step 0: one document costs more than the mean rank (the bound is that document);
    # step 1: balanced work (the bound is the mean rank, and the placement meets it)
    steps = [[[np.array([10])], [np.array([2, 2])]], [[np.array([3])], [np.array([3])]]]
    assert step_lower_bound(steps[0], clock) == pytest.approx(110.0)  # 10 + 100 > (110 + 12) / 2
    assert step_lower_bound(steps[1], clock) == pytest.approx(12.0)
    row = simulated_row(iter(steps), clock)
    assert row["steps"] == 2 and row["steps_per_s"] == pytest.approx(2 / (110 + 12))
    assert row["bound_steps_per_s"] == pytest.approx(2 / (110 + 12))  # both steps at their bound
    assert row["max_over_lb"] == pytest.approx(1.0)
    assert row["lb_over_mean"] == pytest.approx((110 / 61 + 1.0) / 2)
    assert row["first_data_s"] >= 0 and row["data_s_per_step"] >= 0


def test_long_context_buffers_hold_a_step_so_one_process_building_every_rank_reads_each_block_once():
    from plait.cli.bench.e2e_workloads import step_buffer_mb

    assert step_buffer_mb(8, 32768, 2) == 16.0  # plait's default already holds it
    tokens_mib = 32 * 131072 * 2 * 4 / 2**20  # one 128k DP 32 step of int32 tokens
    assert step_buffer_mb(32, 131072, 2) >= 2 * tokens_mib


def test_long_context_max_delay_reaches_plaits_spec_only_when_asked(tmp_path):
    from plait.cli.bench.e2e_workloads import long_spec

    assert long_spec(tmp_path, 8, 4096, 2).balance.max_delay == 0  # plait's default
    assert long_spec(tmp_path, 8, 4096, 2, max_delay=4).balance.max_delay == 4


def test_a_workload_that_fails_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    from plait.cli import main
    from plait.cli.bench import e2e_workloads

    def broken(*a, **k):
        raise RuntimeError("The current node timed out during startup")

    monkeypatch.setattr(e2e_workloads, "run_cpu_pool", broken)
    out = tmp_path / "e2e.json"
    argv = ["bench", "e2e", "--workloads", "long-context,cpu-pool", "--long-seq", "2048", "--long-dp", "2",
            "--long-steps", "1", "--long-microbatches", "1", "--long-plan-ranks", "", "--cache", str(tmp_path / "data"),
            "--quiet", "--json", str(out)]
    assert main(argv) == 1
    result = json.loads(out.read_text())
    assert {r["workload"] for r in result["rows"]} == {"long-context"}  # every row that ran is there
    assert [f["workload"] for f in result["failures"]] == ["cpu-pool"] and "timed out" in result["failures"][0]["error"]


def test_a_workload_whose_plait_side_fails_keeps_the_rows_that_ran(tmp_path, monkeypatch):
    from plait.cli import main
    from plait.cli.bench import e2e_workloads

    def ray_did_not_start(args, spec, clock, autoscale, err):
        e = RuntimeError("The current node timed out during startup")
        e.rows = [{"workload": "cpu-pool", "dp": 2, "seq_len": 2048, "strategy": "per-rank", "steps_per_s": 1.0,
                   "tokens_per_s": 1.0, "wait_fraction": 0.0, "balance_loss": 0.0}]
        raise e

    monkeypatch.setattr(e2e_workloads, "run_cpu_pool", ray_did_not_start)
    out = tmp_path / "e2e.json"
    argv = ["bench", "e2e", "--workloads", "cpu-pool", "--dp", "2", "--cache", str(tmp_path / "data"), "--quiet",
            "--json", str(out)]
    assert main(argv) == 1
    result = json.loads(out.read_text())
    assert [(r["workload"], r["strategy"]) for r in result["rows"]] == [("cpu-pool", "per-rank")]
    assert [f["workload"] for f in result["failures"]] == ["cpu-pool"]


def test_cpu_pool_ray_nodes_get_more_object_store_than_ray_cluster_utils_150_mib(monkeypatch):
    """ray.cluster_utils gives each node 150 MiB: the cpu-pool Ray row's head spilled a step's image batches
    to disk and stalled (0.1 steps/s). Each node now gets 30% of the available memory over the cluster's
    3 nodes, 1-4 GiB (e2e_workloads.node_object_store)."""
    from plait.cli.bench import e2e_workloads
    from plait.cli.bench.e2e_workloads import MAX_NODE_STORE, MIN_NODE_STORE, node_object_store

    assert MIN_NODE_STORE <= node_object_store() <= MAX_NODE_STORE and MIN_NODE_STORE >= 1 << 30
    gib, page = 1 << 30, 4096
    for available, per_node in ((2 * gib, MIN_NODE_STORE), (20 * gib, 2 * gib), (100 * gib, MAX_NODE_STORE)):
        monkeypatch.setattr(e2e_workloads.os, "sysconf",
                            lambda name, a=available: a // page if name == "SC_AVPHYS_PAGES" else page)
        assert node_object_store() == pytest.approx(per_node, abs=1), available
