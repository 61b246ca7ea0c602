"""`plait bench balance --lengths FILE` on a user's lengths, and `python -m benchmarks.balance`'s sweep over
the synthetic distributions (four strategies and the plot): they run and write what they promise."""

from __future__ import annotations

import json

from plait.cli import main

KEYS = {"dist", "dp", "seq_len", "strategy", "max_over_mean", "max_over_lb", "max_over_capacity_lb", "plan_ms",
        "speedup_vs_naive", "fill", "docs_per_rank"}


def lengths_file(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(str(x) for x in [50, 700, 3000, 120, 9000, 40, 20000] * 50))
    return path


def check_rows(rows, strategies):
    assert rows and all(KEYS <= set(r) for r in rows)
    assert {r["strategy"] for r in rows} == strategies
    for r in rows:
        assert r["max_over_lb"] >= 1 - 1e-9 and r["max_over_mean"] >= 1 - 1e-9
        # the capacity-aware bound is at least the plain one, and still a bound: 1 <= max/capLB <= max/LB
        assert 1 - 1e-9 <= r["max_over_capacity_lb"] <= r["max_over_lb"] + 1e-9
    by = {(r["dist"], r["dp"], r["seq_len"], r["strategy"]): r for r in rows}
    for (dist, dp, seq_len, strategy), r in by.items():
        assert r["speedup_vs_naive"] == (1.0 if strategy == "naive" else
                                         by[(dist, dp, seq_len, "naive")]["time_per_work"] / r["time_per_work"])


def test_bench_balance_on_user_lengths(tmp_path, capsys):
    out = tmp_path / "balance.json"
    args = ["bench", "balance", "--lengths", str(lengths_file(tmp_path)), "--dp", "8,16", "--seq-len", "8192",
            "--pp", "2", "--repeats", "1", "--json", str(out)]
    assert main(args) == 0
    rows = json.loads(out.read_text())
    check_rows(rows, {"naive", "plait"})
    assert {r["dist"] for r in rows} == {"file:lengths.txt"} and {r["dp"] for r in rows} == {8, 16}
    assert "speedup" in capsys.readouterr().out


def test_bench_balance_needs_lengths_and_names_a_bad_file(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit):  # argparse: --lengths is required
        main(["bench", "balance"])
    bad = tmp_path / "bad.txt"
    bad.write_text("0\n-3\n")
    assert main(["bench", "balance", "--lengths", str(bad)]) == 2
    assert "bad.txt: no positive document lengths" in capsys.readouterr().err.replace("\n", "")


def test_benchmarks_balance_quick_sweep_and_plot(tmp_path, capsys):
    from benchmarks import balance  # the benchmark under test
    from benchmarks.common import main as bench_main

    out, png = tmp_path / "balance.json", tmp_path / "balance.png"
    args = ["--quick", "--dp", "8", "--seq-len", "8192", "--json", str(out), "--plot", str(png),
            "--lengths", str(lengths_file(tmp_path)), "--pp", "2", "--repeats", "1"]
    assert bench_main(balance, args) == 0
    rows = json.loads(out.read_text())
    check_rows(rows, {"naive", "sorted", "plait", "plait-var"})
    assert {r["dist"] for r in rows} == {"web", "mix", "file:lengths.txt"}
    assert png.exists()
    assert "speedup" in capsys.readouterr().out
