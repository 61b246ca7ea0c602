"""examples/dynamic_cp_gpt.py under torchrun: 4 processes train on dynamic-CP batches, and `--check` finds the
loss and every gradient equal (float32, 1e-5) to one process running the same documents whole."""

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


def run_example(tmp_path, data: Path, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    assert torchrun, "torchrun not found"
    out = tmp_path / "result.json"
    cmd = [torchrun, "--nproc-per-node", "4", "--master-port", str(free_port()),
           "--log-dir", str(tmp_path / "torchrun-logs"),  # not a torchelastic_* dir left in /tmp
           str(ROOT / "examples" / "dynamic_cp_gpt.py"), "--steps", "2", "--check", "--data", str(data),
           "--json", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, out


@pytest.mark.timeout(180)
@pytest.mark.subprocess
@pytest.mark.slow
def test_dynamic_cp_example_matches_whole_documents(tmp_path, demo_spec_path):
    proc, out = run_example(tmp_path, demo_spec_path.parent)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["steps"] == 2 and result["max_rel_diff"] is not None and result["max_rel_diff"] <= 1e-5
    assert "max_rel_diff" in proc.stdout
    assert result["served_by"] == "NodeRuntime"  # the node's shared job served every rank its shards over Flight
    degrees = {int(k): v for k, v in result["degrees"].items()}
    assert degrees.get(2, 0) > 0 and degrees.get(4, 0) > 0  # groups of 2 and of 4 ran, not only whole documents
