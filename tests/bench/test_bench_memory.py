"""Memory at tiny sizes, run as users run it: `python -m benchmarks.memory --client node` (the per-rank
baseline's forked DataLoader workers against plait's node data plane) and `plait bench memory --spec` (the
node data plane alone, on a user's spec), every role by PSS and RSS."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.subprocess, pytest.mark.slow, pytest.mark.timeout(300)]
MIB = 2**20
ROOT = Path(__file__).resolve().parents[2]
TINY = ["--ranks", "2", "--steps", "2", "--block-mb", "0.25", "--files", "1"]


def test_node_bench_by_pss_against_forked_dataloader_workers(tmp_path):
    """The per-rank baseline is a torch DataLoader whose workers are forked (they run the trainer's own
    command line, a spawned worker would not), every role is reported by PSS and RSS, and forked workers'
    shared pages make the baseline's PSS well below its RSS."""
    out = tmp_path / "memory.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.memory", "--client", "node", "--sources", "2", *TINY,
                           "--json", str(out)], capture_output=True, text=True, timeout=280, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    per_rank, plait_ = result["per_rank"], result["plait"]
    assert result["per_rank_start"] == "fork" and per_rank["workers_forked"] is True
    assert per_rank["roles"]["worker"]["count"] == 2 and plait_["roles"]["rank"]["count"] == 1
    for role in (*per_rank["roles"].values(), *plait_["roles"].values()):
        assert {"count", "rss", "pss"} <= set(role)
    assert per_rank["total_pss"] == per_rank["roles"]["trainer"]["pss"] + per_rank["roles"]["worker"]["pss"]
    assert per_rank["total_pss"] < per_rank["total_rss"]  # a forked worker's pages shared with its trainer count once
    assert result["host_pss_mib"] * MIB == plait_["roles"]["host"]["pss"] > 0
    assert result["ratio_pss"] == per_rank["total_pss"] / plait_["total_pss"]
    assert result["ratio"] == per_rank["total_rss"] / plait_["total_rss"]
    assert per_rank["batches"] == plait_["batches"] == 2 * 2


def test_plait_bench_memory_on_a_users_spec(tmp_path):
    """`plait bench memory --spec`: the user's sources (relative paths resolved against the spec's folder),
    its topology set to --ranks trainers started as torchrun starts them; the host and the reading rank
    are measured, nothing per-rank."""
    from plait.cli.bench.memory import make_sources

    entries = make_sources(tmp_path / "data", 2, files=1, block_mb=0.25)
    for e in entries:
        e["path"] = str(Path(e["path"]).relative_to(tmp_path))
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps({"sources": entries, "packing": {"seq_len": 512}, "topology": {"dp": 1}}))
    out = tmp_path / "memory.json"
    plait = Path(sys.executable).parent / "plait"
    done = subprocess.run([str(plait), "bench", "memory", "--spec", str(spec), *TINY, "--json", str(out)],
                          capture_output=True, text=True, timeout=280, check=False, cwd=tmp_path.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["spec"] == str(spec) and result["sources"] == 2 and "per_rank" not in result
    roles = result["plait"]["roles"]
    assert roles["host"]["count"] == 1 and roles["rank"]["count"] == 1  # --ranks 2, not the spec's dp 1
    assert result["host_pss_mib"] * MIB == roles["host"]["pss"] > 0 and roles["rank"]["rss"] > 0
    assert result["plait"]["batches"] == 2 * 2
    assert set(result["host_pss_by_mapping_mib"]) == {"anonymous", "shm", "files"}
