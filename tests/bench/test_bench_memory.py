"""`plait bench memory --realistic --quick`: torch trainers on the local runtime read Parquet whose row
groups are larger than a source's buffer; every micro-batch arrives and no rank's decoded buffer grows
past the sources' budgets (it would hold whole row groups if they were not read in row ranges). Started
as torchrun starts them, the trainers share one data plane (one SourceLoader for the node); with
share="process" each holds its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.subprocess, pytest.mark.slow, pytest.mark.timeout(300)]
MIB = 2**20


def test_realistic_quick_bench_on_the_local_runtime(tmp_path):
    out = tmp_path / "memory.json"
    plait = Path(sys.executable).parent / "plait"
    done = subprocess.run([str(plait), "bench", "memory", "--realistic", "--quick", "--runtimes", "local,local-process",
                           "--buffer-mb", "4", "--json", str(out)], capture_output=True, text=True, timeout=280,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    smallest_row_group = result["row_group_mb"][0] * MIB
    for key, run in result["runs"].items():
        sources = int(key.split("/")[1])
        assert run["batches"] == result["trainers"] * result["microbatches"]
        assert run["ray_imported"] is False
        holders = 1 if key.startswith("local/") else result["trainers"]  # torchrun-style: one data plane
        assert run["over_budget"] == [0] * holders, key
        assert 0 < run["peak_buffer_per_rank"] <= sources * 4 * MIB, key  # within every source's buffer_mb
        assert run["peak_buffer_per_rank"] < sources * smallest_row_group, key  # no whole row group held
        assert run["trainer_added_per_rank"] > run["peak_buffer_per_rank"]  # RSS measured, buffers inside it
    assert result["disk_bytes"] < 3 * 2**30


def test_node_bench_by_pss_against_forked_dataloader_workers(tmp_path):
    """`plait bench memory --client node` (tiny sizes): the per-rank baseline is a torch DataLoader whose
    workers are forked (they run the trainer's own command line, a spawned worker would not), every role
    is reported by PSS and RSS, and forked workers' shared pages make the baseline's PSS well below its RSS."""
    out = tmp_path / "memory.json"
    plait = Path(sys.executable).parent / "plait"
    done = subprocess.run([str(plait), "bench", "memory", "--client", "node", "--sources", "2", "--ranks", "2",
                           "--steps", "2", "--block-mb", "0.25", "--files", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=280, check=False)
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
