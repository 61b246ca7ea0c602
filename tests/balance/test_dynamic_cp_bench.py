"""`plait bench e2e --workloads long-context`: the four strategies, the dynamic-CP figures in every row,
ratios naming strategy, mix, seq_len, DP and micro-batches, and the planning-time rows (a tiny run)."""

import json

import pytest

from plait.cli import main


@pytest.mark.slow  # ~30 s on the loaded 2-core machine: writes three length mixes and plans 8 rows
def test_long_context_rows_and_ratios(tmp_path):
    out = tmp_path / "e2e.json"
    argv = ["bench", "e2e", "--workloads", "long-context", "--long-seq", "8192", "--long-dp", "4", "--long-steps", "2",
            "--long-microbatches", "1", "--long-plan-ranks", "16", "--long-plan-steps", "2",
            "--cache", str(tmp_path / "data"), "--quiet", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    rows = [r for r in result["rows"] if r["workload"] == "long-context"]
    assert {(r["mix"], r["strategy"]) for r in rows} == {
        (m, s) for m in ("lognormal", "long-tail") for s in ("per-rank", "plait", "plait-fixed-cp", "plait-dcp")}
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
    assert len(ratios) == 6 and all({"strategy", "mix", "seq_len", "dp", "microbatches", "steps_per_s_ratio"} <= set(q)
                                    for q in ratios)
    assert all("over_plait" in q for q in ratios if q["strategy"] == "plait-dcp")
    planning = [r for r in result["rows"] if r["workload"] == "long-context-planning"]
    assert len(planning) == 1 and planning[0]["ranks"] == 16 and planning[0]["plan_ms_p95"] >= planning[0]["plan_ms_p50"] > 0 < planning[0]["plan_cpu_ms_p50"]
