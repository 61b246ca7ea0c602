"""`plait plan`: it runs, reports, and writes what it promises."""

from __future__ import annotations

import json

import yaml
from helpers import make_spec, token_parquet

from plait.cli import main


def spec_file(tmp_path, **extra) -> str:
    short = token_parquet(tmp_path / "short", name="short", files=2, docs_per_file=60, lo=1, hi=40)
    long = token_parquet(tmp_path / "long", name="long", files=2, docs_per_file=10, lo=100, hi=300, seed=1)
    spec = make_spec([short, long], seq_len=128, microbatches=2, dp=4, **extra)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_plan_command(tmp_path, capsys):
    out = tmp_path / "plan.json"
    png = tmp_path / "plan.png"
    assert main(["plan", spec_file(tmp_path), "--steps", "4", "--json", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "slowest ranks" in text and "max/LB" in text
    data = json.loads(out.read_text())
    assert [r["step"] for r in data["steps"]] == [0, 1, 2, 3]
    for r in data["steps"]:
        assert 0 < r["efficiency"] <= 1 and r["max_over_lb"] >= 1 - 1e-9
    slow = data["slowest"]
    assert slow and slow[0]["cost"] == max(data["rank_cost"])
    doc = slow[0]["documents"][0]
    assert doc["source"] in ("short", "long") and doc["shard"].endswith(".parquet") and doc["length"] > 0
    assert png.exists() and png.stat().st_size > 0


def test_plan_command_variable_mode_and_step(tmp_path, capsys):
    path = spec_file(tmp_path, balance={"mode": "variable"})
    assert main(["plan", path, "--steps", "2", "--step", "1", "--dp", "2", "--top", "1"]) == 0
    assert "step 1" in capsys.readouterr().out
    assert main(["plan", path, "--steps", "2", "--step", "5"]) == 2


def test_plan_offers_variable_mode_when_tokens_bind(tmp_path, capsys):
    # Full-length long chunks plus short documents at 100% of the token budget: ranks differ by whole
    # chunks, equal mode cannot balance, and `plait plan` shows what variable mode does with the same step.
    short = token_parquet(tmp_path / "short", name="short", files=2, docs_per_file=400, lo=4, hi=24)
    long = token_parquet(tmp_path / "long", name="long", files=2, docs_per_file=40, lo=200, hi=256, seed=1)
    spec = make_spec([short, long], seq_len=256, microbatches=4, dp=8, cost={"linear": 1.0, "quadratic": 0.02})
    spec["sources"][0]["weight"], spec["sources"][1]["weight"] = 0.7, 0.3
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--steps", "6", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    worst = max(r["max_over_lb"] for r in data["steps"])
    assert worst > 1.01
    # Tokens bind here: the capacity-aware bound is higher than max(sum/R, max), so the certificate
    # against it is tighter on some step, and never above the plain one.
    for r in data["steps"]:
        assert 1 - 1e-9 <= r["max_over_capacity_lb"] <= r["max_over_lb"] + 1e-9
    assert min(r["max_over_capacity_lb"] - r["max_over_lb"] for r in data["steps"]) < -1e-3
    alt = data["variable_mode"]
    assert alt is not None and alt["max_over_lb"] < 1.01 < worst and alt["placed"] == 1.0
    assert "balance mode `variable`: max/LB" in capsys.readouterr().out
