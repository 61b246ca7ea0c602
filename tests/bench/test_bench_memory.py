"""`plait bench memory --client node` at tiny sizes: the per-rank baseline's forked DataLoader workers and
every role of plait, by PSS and RSS."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.subprocess, pytest.mark.slow, pytest.mark.timeout(300)]
MIB = 2**20


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
