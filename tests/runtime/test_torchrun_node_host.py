"""The node-shared data plane under real torchrun (`python -m torch.distributed.run --nproc-per-node 2`,
gloo, an all-reduce per micro-batch: tests/runtime/torchrun_trainer.py), as a user runs it:

  * every rank resumes a checkpoint with `allow_spec_change=True` (issue 39, item 13): the change is applied
    once for the node's shared stream, and each rank's stream is the single-process reference's;
  * the host's trainer raises (issue 39, items 12 and 17): the job ends promptly, not after gloo's
    30-minute timeout, and the other rank's log names the host and its trainer's exception."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("pyarrow.flight")
pytest.importorskip("torch")

import plait  # noqa: E402
from helpers import free_port  # noqa: E402
from resume_matrix import boundary_state, make_data, resume, sample_ids, spec_after, spec_before  # noqa: E402

TRAINER = Path(__file__).with_name("torchrun_trainer.py")
pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(240)]


def torchrun(tmp_path: Path, cfg: dict, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    """Two processes on this node under torchrun; each rank's stdout and stderr go to files under
    tmp_path/logs (`--redirects 3`). Returns the launch's result and how long it ran."""
    env = {**os.environ, "PLAIT_NODE_DIR": str(tmp_path / "rdzv"), "OMP_NUM_THREADS": "1"}
    env.pop("PLAIT_LOCAL_SHARE", None)  # a developer's setting must not turn sharing off here
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "--log-dir", str(tmp_path / "logs"), "--redirects", "3", str(TRAINER),
           json.dumps({**cfg, "out": str(tmp_path)})]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    return proc, time.monotonic() - t0


def rank_log(tmp_path: Path, rank: int, stream: str = "stderr") -> str:
    return "".join(p.read_text() for p in sorted((tmp_path / "logs").rglob(f"{rank}/{stream}.log")))


@pytest.mark.slow
def test_every_rank_resuming_under_a_changed_spec_reads_the_single_process_stream(tmp_path):
    """Both ranks load the same step-boundary checkpoint with a changed weight and allow_spec_change=True
    (as the docs say): the first request starts the changed stream, the second joins it, and each rank
    reads what a single-process Loader reads (on main before the fix, rank 0 failed with 'the plan stream
    was reset (generation 2, asked 1)')."""
    data = make_data(tmp_path / "data")
    with plait.Loader(spec_before(data), 0, read_ahead=0, share="process") as loader:
        saved = boundary_state(loader)
    (tmp_path / "state.json").write_text(json.dumps(saved))
    spec = spec_after(data, "weights", 2)
    reference = {}
    for r in range(2):
        with plait.Loader(spec, r, read_ahead=0, share="process") as loader:
            reference[r] = sample_ids(resume(loader, saved))
    proc, _ = torchrun(tmp_path, {"spec": spec, "resume": str(tmp_path / "state.json"), "take": 4}, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:] + rank_log(tmp_path, 0)[-3000:] + rank_log(tmp_path, 1)[-3000:]
    for r in range(2):
        got = json.loads((tmp_path / f"rank-{r}.json").read_text())
        assert got["served_by"] == "NodeRuntime"
        assert any("mixture changed" in c for c in got["changes"]), got["changes"]
        assert got["batches"][0][:2] == [2, 0]  # the step after the checkpoint
        assert [b[2] for b in got["batches"]] == reference[r]


@pytest.mark.slow
def test_the_hosts_trainer_raising_ends_the_job_and_names_the_host(tmp_path):
    """Rank 0 (LOCAL_RANK 0, the node's data host) raises at micro-batch 10 while rank 1 waits for it in
    the all-reduce. The host stops serving instead of serving on at exit, so torchrun ends the job
    (before the fix it ran until gloo's 30-minute timeout); rank 1's log names the host and why it stopped.
    The 90 s bound detects a hang, it measures nothing (here the job ends 2-4 s after the raise; the launch
    itself takes 20-40 s on a busy 2-core machine)."""
    ds = make_data(tmp_path / "data")
    spec = spec_before(ds)  # no `steps`: the stream never ends by itself
    proc, took = torchrun(tmp_path, {"spec": spec, "raise_rank": 0, "raise_at": 10}, timeout=200)
    assert proc.returncode != 0
    assert took < 90, f"the job took {took:.0f} s to end after its host's trainer raised"
    host, other = rank_log(tmp_path, 0), rank_log(tmp_path, 1)
    assert "RuntimeError: the model diverged at micro-batch 10" in host  # the trainer's own traceback
    assert "data host" in other and "LOCAL_RANK 0" in other, other[-3000:]
    assert "stopped because its trainer raised RuntimeError: the model diverged at micro-batch 10" in other
    assert not list((tmp_path / "rdzv").glob("*.json"))  # the host removed its rendezvous file
