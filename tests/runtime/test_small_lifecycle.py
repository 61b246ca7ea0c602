"""Smaller things a new user hit (issue 22, item 9): a source smaller than its share of a step is warned
about; a closed Loader is not iterated; tables are not cut at 80 columns when piped; skips through the
Python API are logged; a killed node host leaves no rendezvous file. (--save-state files in
Loader.load_state_dict: tests/state/test_state_checks.py; from_torchrun's dp: tests/client/test_trainer_integration.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import plait
from plait import cli
from plait.errors import PlaitError
from helpers import make_spec, token_parquet, write_jsonl

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return token_parquet(tmp_path_factory.mktemp("small"), files=1, docs_per_file=3, row_group_size=3, lo=8, hi=10,
                         name="tiny")


def warnings_of(caplog, logger: str, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and text in r.getMessage()]


def test_a_source_smaller_than_its_share_of_a_step_is_warned_about_once(small, caplog):
    """seq_len 512 from ~27 tokens of data: each step holds the source ~38 times over."""
    spec = make_spec([small], seq_len=512, microbatches=2)
    with caplog.at_level("WARNING", logger="plait.planner"), plait.Loader(spec, steps=3) as loader:
        assert len(list(loader)) == 6
    said = warnings_of(caplog, "plait.planner", "was read whole")
    assert len(said) == 1 and "'tiny'" in said[0] and "fewer tokens than its share of one step" in said[0]


def test_a_source_larger_than_a_step_is_not_warned_about(tmp_path, caplog):
    big = token_parquet(tmp_path / "big", files=2, docs_per_file=40, lo=4, hi=40)
    with caplog.at_level("WARNING", logger="plait.planner"), plait.Loader(make_spec([big]), steps=3) as loader:
        list(loader)
    assert not warnings_of(caplog, "plait.planner", "was read whole")


def test_a_closed_loader_refuses_to_iterate(small):
    loader = plait.Loader(make_spec([small]), steps=2)
    assert next(iter(loader)).step == 0
    loader.close()
    with pytest.raises(PlaitError, match="this Loader is closed"):
        next(iter(loader))
    with plait.Loader(make_spec([small]), steps=2) as loader:
        list(loader)
    with pytest.raises(PlaitError, match="this Loader is closed"):
        list(loader)


def test_inspect_and_jobs_tables_are_not_cut_when_piped(tmp_path, capsys):
    name = "a_source_with_a_rather_long_name_" + "x" * 60
    ds = token_parquet(tmp_path / "d", files=1, docs_per_file=5, name=name)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(make_spec([ds])))
    assert cli.main(["inspect", str(path)]) == 0
    assert name in capsys.readouterr().out  # stdout is captured: not a terminal

    from plait.cli.jobs import print_jobs

    job = "a-job-with-a-long-name-" + "y" * 40
    print_jobs([{"job": job, "state": "running", "started": time.time() - 5, "clients": 2, "idle_s": 1.0,
                 "idle_timeout": 600, "actors": 4, "actors_asked": 4, "rss": 2**30, "step": 12,
                 "metrics": "127.0.0.1:9100"}], "auto")
    out = capsys.readouterr().out
    assert job in out and "127.0.0.1:9100" in out and "1024 MiB" in out


def test_error_report_is_documented():
    doc = plait.Loader.error_report.__doc__ or ""
    assert "on_error: skip" in doc and '"skipped"' in doc


def test_skips_through_the_python_api_are_logged_once_per_source_and_epoch(tmp_path, caplog):
    """Two bad lines in a JSONL source under on_error: skip, read over several epochs: one warning with
    the count (a bad record counts once, so later epochs add no new skips and no new warning)."""
    records = [{"input_ids": list(range(1, 6 + i % 5))} for i in range(12)]
    records[3] = "{not json"
    records[8] = {"input_ids": "oops"}
    write_jsonl(tmp_path / "part-0.jsonl", records)
    spec = make_spec([{"name": "j", "path": str(tmp_path / "*.jsonl"), "tokens_field": "input_ids",
                       "on_error": "skip"}], seq_len=32)
    with caplog.at_level("WARNING", logger="plait.data"), plait.Loader(spec, steps=12) as loader:
        list(loader)
        assert loader.error_report()["j"]["bad_records"] == 2  # "skipped" counts them in every epoch
    said = warnings_of(caplog, "plait.data", "bad record(s) skipped")
    assert len(said) == 1 and said[0].startswith("source 'j': 2 bad record(s) skipped so far")


def node_env(tmp_path, run: str) -> dict:
    return {**os.environ, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": run,
            "PLAIT_NODE_DIR": str(tmp_path / "rdzv")}


def test_a_dead_hosts_rendezvous_file_is_removed_at_the_next_start(small, tmp_path, monkeypatch):
    folder = tmp_path / "rdzv"
    folder.mkdir(mode=0o700)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = folder / "node-0123456789abcdef01234567.json"
    stale.write_text(json.dumps({"address": "127.0.0.1:1", "token": "t", "pid": dead.pid, "job": "old"}))
    half = folder / f"node-0123456789abcdef01234567.{dead.pid}.tmp"
    half.write_text("{")
    for k, v in node_env(tmp_path, "next").items():
        monkeypatch.setenv(k, v)
    with plait.Loader(make_spec([small]), share="node", steps=1) as loader:
        assert type(loader.runtime).__name__ == "NodeRuntime"
        assert not stale.exists() and not half.exists()


HOST = """
import sys, time, plait
with plait.Loader(sys.argv[1], share="node") as loader:
    next(iter(loader))
    print("ready", flush=True)
    time.sleep(60)
"""


@pytest.mark.subprocess
def test_a_host_ended_by_sigterm_removes_its_rendezvous_file(small, tmp_path):
    """torchrun ends its workers with SIGTERM: the host's file goes with it (SIGKILL: the next start)."""
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(make_spec([small])))
    env = {**node_env(tmp_path, "term"), "PYTHONFAULTHANDLER": "1"}  # SIGABRT prints every thread's stack
    proc = subprocess.Popen([sys.executable, "-c", HOST, str(spec_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-2000:]
        assert list((tmp_path / "rdzv").glob("node-*.json"))
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # seen once in a serial run of the suite: say where it hung
            proc.send_signal(signal.SIGABRT)
            pytest.fail(f"the host outlived SIGTERM by 30 s; its threads:\n{proc.communicate(timeout=30)[1][-6000:]}")
        assert proc.returncode == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not list((tmp_path / "rdzv").glob("node-*"))
