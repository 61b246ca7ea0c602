"""`plait bench e2e` (plait alone, its rows against what the GPUs alone allow) and `python -m benchmarks.e2e`
(per-rank DataLoaders vs plait): short whole runs, and the pure parts: the synchronous step clock, balance
loss, the summary, the per-rank greedy packer, the ratios."""

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
from benchmarks.e2e_per_rank import Document, pack_greedy  # the benchmark's baseline under test
from plait.cost import CostModel, EncoderCost
from plait.errors import PlaitError


ROW_KEYS = {"workload", "dp", "seq_len", "strategy", "steps_per_s", "tokens_per_s", "wait_fraction", "balance_loss"}


@pytest.mark.ray
def test_short_run_feeds_both_strategies_the_same_steps_and_plait_balances_better(tmp_path):
    from benchmarks import e2e
    from benchmarks.common import main

    out = tmp_path / "e2e.json"
    # --gpu-tflops high: tiny simulated compute, so the run is short (rates are not asserted: benchmarks)
    argv = ["--quick", "--workloads", "gpu-bound", "--dp", "4", "--steps", "3", "--warmup", "1", "--seq-len", "4096",
            "--gpu-tflops", "4000", "--cpus", "2", "--images", "32", "--cache", str(tmp_path / "data"),
            "--quiet", "--json", str(out)]
    assert main(e2e, argv) == 0
    result = json.loads(out.read_text())
    assert len(result["load_average"]["before"]) == 3 and len(result["load_average"]["after"]) == 3
    assert all(ROW_KEYS <= set(r) for r in result["rows"])
    rows = {(r["workload"], r["strategy"], r["dp"], r["seq_len"]): r for r in result["rows"]}
    assert set(rows) == {("gpu-bound", s, 4, 4096) for s in ("per-rank", "plait")}
    per_rank, plait = rows["gpu-bound", "per-rank", 4, 4096], rows["gpu-bound", "plait", 4, 4096]
    assert per_rank["steps"] == plait["steps"] == 3 and per_rank["measured_steps"] == plait["measured_steps"] == 2
    # a budget of 2 CPUs: per-rank still has one worker process a rank (at least one), plait 2 loaders at most
    assert per_rank["processes"] == 4 and per_rank["workers_per_rank"] == 1 and plait["loaders_at_start"] <= 2
    assert plait["balance_loss"] <= per_rank["balance_loss"]
    capacity = 4 * 2 * 4096  # dp x micro-batches x seq_len
    for r in (per_rank, plait):
        assert 0.5 * capacity < r["tokens_per_step"] <= capacity
        assert 0.0 <= r["wait_fraction"] <= 1.0 and r["steps_per_s"] > 0
    ratios = {(q["workload"], q["dp"], q["seq_len"]): q for q in result["ratios"]}
    assert set(ratios) == {("gpu-bound", 4, 4096)}
    assert ratios["gpu-bound", 4, 4096]["steps_per_s_ratio"] == pytest.approx(plait["steps_per_s"] / per_rank["steps_per_s"])


@pytest.mark.subprocess
def test_data_bound_runs_plait_on_the_local_runtime_with_the_per_rank_budget(tmp_path):
    """data-bound without Ray: plait in this process (LocalRuntime all_ranks) decoding on --cpus threads,
    per-rank with --cpus worker processes; each image decoded once per delivery; the ratio names its runtime."""
    from benchmarks import e2e
    from benchmarks.common import main

    out = tmp_path / "e2e.json"
    argv = ["--workloads", "data-bound", "--data-bound-runtimes", "local", "--dp", "2", "--cpus", "2",
            "--steps", "3", "--warmup", "1", "--images", "64", "--seq-len", "4096", "--cache", str(tmp_path / "data"),
            "--quiet", "--json", str(out)]
    assert main(e2e, argv) == 0
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
    from benchmarks.e2e import ratios

    base = {"workload": "data-bound", "dp": 8, "seq_len": 8192}
    rows = [{**base, "strategy": "per-rank", "steps_per_s": 2.0, "tokens_per_s": 10.0},
            {**base, "strategy": "plait", "runtime": "ray", "steps_per_s": 1.0, "tokens_per_s": 5.0},
            {**base, "strategy": "plait", "runtime": "local", "steps_per_s": 3.0, "tokens_per_s": 15.0}]
    assert ratios(rows) == [{**base, "steps_per_s_ratio": 1.5, "runtime": "local", "tokens_per_s_ratio": 1.5},
                            {**base, "steps_per_s_ratio": 0.5, "runtime": "ray", "tokens_per_s_ratio": 0.5}]


def test_ratios_pair_strategies_per_workload_dp_and_seq_len():
    from benchmarks.e2e import ratios

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

    for argv, word in ((["--warmup", "20"], "--warmup"), (["--gpu-tflops", "0"], "--gpu-tflops"),
                       (["--workloads", "mine"], "--workloads"), (["--workloads", "long-context"], "--workloads")):
        assert main(["bench", "e2e", *argv]) == 2
        assert word in capsys.readouterr().err
    for argv in (["--cpus", "0"], ["--dp", "two"], ["--dp", "4,0"], ["--dp", ","]):  # argparse: sizes below 1
        with pytest.raises(SystemExit) as e:
            main(["bench", "e2e", *argv])
        assert e.value.code == 2 and argv[0] in capsys.readouterr().err


def test_missing_torch_is_named(monkeypatch):
    import sys

    from benchmarks.e2e_per_rank import require_torch

    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(PlaitError, match="needs torch"):
        require_torch()


def test_plait_bench_e2e_runs_the_job_on_the_local_runtime_against_what_the_gpus_allow(tmp_path):
    """The product command, no Ray: plait's rows only, each with the GPUs' own rate beside it."""
    from plait.cli import main

    out = tmp_path / "e2e.json"
    argv = ["bench", "e2e", "--dp", "2", "--cpus", "2", "--steps", "3", "--warmup", "1",
            "--images", "48", "--seq-len", "4096", "--cache", str(tmp_path / "data"), "--quiet", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    rows = {r["workload"]: r for r in result["rows"]}
    assert set(rows) == {"gpu-bound", "data-bound"} and result["failures"] == []
    for r in rows.values():
        assert ROW_KEYS <= set(r) and r["strategy"] == "plait" and r["runtime"] == "local" and r["steps"] == 3
        assert r["gpu_busy"] == pytest.approx(r["steps_per_s"] / r["compute_bound_steps_per_s"])
        assert 0 < r["gpu_busy"] <= 1 + 1e-9  # the job cannot outrun its GPUs
        assert r["images_decoded"] == r["images_delivered"] > 0
