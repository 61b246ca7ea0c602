"""`python -m benchmarks.memory_realistic --quick`: torch trainers on the local runtime read Parquet whose row
groups are larger than a source's buffer; every micro-batch arrives and no rank's decoded buffer grows
past the sources' budgets (it would hold whole row groups if they were not read in row ranges). Started
as torchrun starts them, the trainers share one data plane (one SourceLoader for the node); with
share="process" each holds its own. Served by one `plait serve --runtime local` process, no Ray anywhere."""

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


def test_realistic_quick_bench_on_the_local_runtime(tmp_path):
    out = tmp_path / "memory.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.memory_realistic", "--quick", "--runtimes",
                           "local,local-process", "--buffer-mb", "4", "--json", str(out)], capture_output=True,
                          text=True, timeout=280, check=False, cwd=ROOT)
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


@pytest.mark.lab  # the same measurement as above through `plait serve --runtime local`: ~30 s more
def test_realistic_quick_bench_on_the_one_process_server(tmp_path):
    """`--runtimes flight-local`: the serve process is measured as plait's
    one process, no Ray anywhere (no daemons), every trainer got its micro-batches."""
    out = tmp_path / "memory.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.memory_realistic", "--quick", "--runtimes", "flight-local",
                           "--buffer-mb", "4", "--max-buffer-mb", "16", "--json", str(out)], capture_output=True,
                          text=True, timeout=110, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    for key, run in result["runs"].items():
        assert run["batches"] == result["trainers"] * result["microbatches"], key
        assert run["ray_imported"] is False and run["ray_daemons"] == 0, key
        assert list(run["roles"]) == ["serve"] and run["roles"]["serve"]["count"] == 1, key
        assert run["total"] == run["trainer_added"] + run["roles"]["serve"]["rss"], key
