"""The torchrun example trains (loss goes down) on plait's packed, padding-free batches."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import free_port

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
@pytest.mark.subprocess
@pytest.mark.slow
def test_torchrun_gpt_example_learns(tmp_path, demo_spec_path):  # the session's demo corpus, written once
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    assert torchrun, "torchrun not found"
    out = tmp_path / "losses.json"
    cmd = [torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()),
           "--log-dir", str(tmp_path / "torchrun-logs"),  # not a torchelastic_* dir left in /tmp
           str(ROOT / "examples" / "gpt_torchrun.py"), "--runtime", "local", "--steps", "15",
           "--data", str(demo_spec_path.parent), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["served_by"] == "NodeRuntime"  # 2 processes on this node: LOCAL_RANK 0 hosted the data plane
    losses = result["losses"]
    assert len(losses) == 15  # the mean of the last 5 is ~2.1 below the first 5 (7.88 -> 5.81)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, (first, last)


@pytest.mark.timeout(120)
@pytest.mark.subprocess
@pytest.mark.slow
def test_torchrun_vlm_example_learns(tmp_path, demo_spec_path):
    """examples/vlm_torchrun.py: a tiny ViT + GPT on the demo's image-text source, 2 ranks, local runtime."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    assert torchrun, "torchrun not found"
    out = tmp_path / "losses.json"
    cmd = [torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()),
           "--log-dir", str(tmp_path / "torchrun-logs"),  # not a torchelastic_* dir left in /tmp
           str(ROOT / "examples" / "vlm_torchrun.py"), "--runtime", "local", "--steps", "10",
           "--data", str(demo_spec_path.parent), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["served_by"] == "NodeRuntime"  # image batches (pixels, grids) over the node's Flight server
    losses = result["losses"]
    assert len(losses) == 10  # the mean of the last 3 is ~1.8 below the first 3 (8.14 -> 6.37)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 1.0, (first, last)


@pytest.mark.timeout(90)
@pytest.mark.subprocess
@pytest.mark.slow
def test_calibrate_vlm_quick(tmp_path, demo_spec_path):
    """examples/calibrate_vlm.py --quick: rows in `plait fit-cost`'s format that the CLI fits, a held-out
    error, and naive vs plait placements of the same step's documents, each simulated rank timed."""
    out, rows_csv = tmp_path / "calib.json", tmp_path / "rows.csv"
    cmd = [sys.executable, str(ROOT / "examples" / "calibrate_vlm.py"), "--quick", "--device", "cpu",
           "--data", str(demo_spec_path.parent), "--csv", str(rows_csv), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=80, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    from plait.cli.fit_cost import read_rows

    cols = read_rows(str(rows_csv))  # the CLI's reader accepts the file, with the encoder columns
    assert {"sum_P", "sum_P2"} <= set(cols) and len(cols["time"]) == result["calibration"]["rows"] >= 8
    assert (cols["time"] > 0).all() and (cols["sum_P"] > 0).any() and (cols["sum_P"] == 0).any()
    calib = result["calibration"]
    assert calib["train_rows"] + calib["test_rows"] == calib["rows"] and calib["held_out_rel_err_rms"] >= 0
    by_strategy = {s["strategy"]: s for s in result["steps"]}
    naive, plait_step = by_strategy["naive"], by_strategy["plait"]
    dp = result["args"]["dp"]
    for s in (naive, plait_step):
        assert len(s["rank_seconds"]) == len(s["fitted_rank_seconds"]) == dp
        assert min(s["rank_seconds"]) > 0 and s["measured_max_over_mean"] >= 1.0
    assert plait_step["waiting"] == 0  # the Planner placed every document of its step
    assert naive["documents"] + naive["waiting"] == plait_step["documents"]  # the same documents, placed otherwise
