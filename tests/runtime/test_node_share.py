"""The local runtime under torchrun with several processes on a node: LOCAL_RANK 0 hosts one data plane
for the node (plait.runtime.node_share) and every process reads its batches from it; the stream is the
local runtime's, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("pyarrow.flight")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers): this file also runs as a trainer script
from helpers import batch_digest, make_spec, token_parquet  # noqa: E402

import plait  # noqa: E402
from plait.errors import PlaitError  # noqa: E402
from plait.runtime.node_share import node_launch  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def spec_dict(tmp_path_factory):
    ds = token_parquet(tmp_path_factory.mktemp("node-share"), files=2, docs_per_file=40, row_group_size=5,
                       lo=4, hi=40)
    return make_spec([ds], seq_len=64, microbatches=2, dp=2, steps=6)


def launch_env(monkeypatch, tmp_path, local_rank: int, size: int, run: str) -> None:
    for k, v in {"LOCAL_RANK": local_rank, "LOCAL_WORLD_SIZE": size, "TORCHELASTIC_RUN_ID": run,
                 "PLAIT_NODE_DIR": tmp_path / "rdzv"}.items():
        monkeypatch.setenv(k, str(v))


def per_process_digests(spec) -> dict[int, str]:
    return {r: batch_digest(plait.Loader(spec, dp_rank=r, read_ahead=0, share="process")) for r in range(2)}


@pytest.mark.parametrize("host_closes,transport", [(True, "shm"), (False, "flight")])
@pytest.mark.subprocess
def test_two_processes_share_one_data_plane_with_the_local_stream(spec_dict, tmp_path, host_closes, transport):
    """Two trainer processes as torchrun starts them: rank 0 hosts, both read from it (shared memory by
    default, Flight when asked), both get the local runtime's batches; rank 0 ends first (closing its
    Loader, or exiting with it open) and still serves rank 1 to its last step. Over shared memory the host
    listens on no TCP port (its Flight server starts only when a rank asks for it)."""
    env = {**os.environ, "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": f"t-{os.getpid()}",
           "PLAIT_NODE_DIR": str(tmp_path / "rdzv"), "PLAIT_NODE_TRANSPORT": transport}
    env.pop("PLAIT_LOCAL_SHARE", None)  # a developer's setting must not turn sharing off here
    procs = [subprocess.Popen([sys.executable, __file__, json.dumps({"spec": spec_dict, "rank": r,
                                                                    "slow": 0.15 if r == 1 else 0,
                                                                    "close": host_closes or r == 1})],
                              env={**env, "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=Path(__file__).parents[1]) for r in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=150)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    expected = per_process_digests(plait.load_spec(spec_dict))
    for r, got in enumerate(outs):
        assert got["runtime"] == "NodeRuntime", got
        assert got["client"] == ("ShmNodeClient" if transport == "shm" else "NodeHostClient")
        assert got["hosts"] == (r == 0)
        assert got["digest"] == expected[r]
        assert got["batches"] == 12
    # the host opens a Flight port only for a rank that reads over Flight: none when every rank reads shm
    assert bool(outs[0]["listening"]) == (transport == "flight") and not outs[1]["listening"]
    assert outs[0]["ended"] < outs[1]["ended"]  # the host's loop ended first and it served on
    assert not list((tmp_path / "rdzv").glob("*.json"))  # the host removed its rendezvous file


def test_one_process_node_resumes_and_dedupes_run_time_calls(spec_dict, tmp_path, monkeypatch):
    """share="node" with LOCAL_WORLD_SIZE 1: host and client in one process. A checkpoint resumes bit for
    bit, and set_weights made by every rank (here twice) is recorded once."""
    launch_env(monkeypatch, tmp_path, 0, 1, "one")
    spec = plait.load_spec(spec_dict)
    local = list(plait.Loader(spec, dp_rank=0, read_ahead=0, share="process"))
    name = spec.sources[0].name
    with plait.Loader(spec, dp_rank=0, share="node") as loader:
        assert type(loader.runtime).__name__ == "NodeRuntime" and loader.runtime.loader is not None
        loader.set_weights({name: 1.0}, at_step=50)
        loader.set_weights({name: 1.0}, at_step=50)  # a second rank's identical call
        it = iter(loader)
        first = [next(it) for _ in range(5)]
        state = loader.state_dict()  # its step was planned after both calls
    assert [o["at_step"] for o in state["data"]["overrides"]] == [50]  # recorded once
    with plait.Loader(spec, dp_rank=0, share="node") as again:
        again.load_state_dict(state)
        rest = list(again)
    assert batch_digest(first + rest) == batch_digest(local)


def test_build_ahead_reaches_the_nodes_host_from_the_loader(spec_dict, tmp_path, monkeypatch):
    """plait.Loader(build_ahead=N) under torchrun: the node's host builds N steps ahead (one name for every
    runtime), and the stream is the same."""
    launch_env(monkeypatch, tmp_path, 0, 1, "ahead")
    spec = plait.load_spec(spec_dict)
    with plait.Loader(spec, dp_rank=0, share="node", build_ahead=0) as loader:
        assert loader.runtime.serving_stats()["build_ahead"] == 0
        got = list(loader)
    assert batch_digest(got) == batch_digest(plait.Loader(spec, dp_rank=0, read_ahead=0, share="process"))


def test_identical_set_weights_from_every_rank_is_recorded_once(spec_dict):
    """The node's Planner receives each rank's call: the same call again adds nothing to the data state."""
    from plait.runtime.local import LocalRuntime

    spec = plait.load_spec(spec_dict)
    rt = LocalRuntime(spec)
    for _ in range(2):
        rt.set_weights({spec.sources[0].name: 1.0}, at_step=50)
    assert [o["at_step"] for o in rt.state_dict()["overrides"]] == [50]


def test_share_choices_and_errors(spec_dict, tmp_path, monkeypatch):
    spec = plait.load_spec(spec_dict)
    for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "PLAIT_LOCAL_SHARE"):
        monkeypatch.delenv(k, raising=False)
    assert node_launch("auto") is None
    with pytest.raises(PlaitError, match="share='node' needs torchrun"):
        plait.Loader(spec, share="node")
    with pytest.raises(PlaitError, match="share='everywhere' is not one of"):
        plait.Loader(spec, share="everywhere")
    launch_env(monkeypatch, tmp_path, 1, 2, "nohost")
    assert node_launch("auto").local_world_size == 2
    assert node_launch("process") is None
    monkeypatch.setenv("PLAIT_LOCAL_SHARE", "process")
    assert node_launch("auto") is None
    monkeypatch.delenv("PLAIT_LOCAL_SHARE")
    t0 = time.monotonic()
    with pytest.raises(PlaitError, match="LOCAL_RANK 0 hosts it"):
        plait.Loader(spec, dp_rank=1, join_timeout=0.5)  # nobody hosts this node's job
    assert time.monotonic() - t0 < 30


def single_process_digests(spec) -> dict[int, str]:
    """Every rank's stream from one in-process Planner (each step planned once, every rank built)."""
    from plait.runtime.local import LocalRuntime

    rt = LocalRuntime(spec)
    out: dict[int, list] = {r: [] for r in range(spec.topology.dp)}
    while rt.planner.step < spec.steps:
        plan = rt.plan()
        for r in out:
            out[r].extend(rt.build(plan, r))
        rt.release()
    rt.close()
    return {r: batch_digest(b) for r, b in out.items()}


@pytest.mark.subprocess
@pytest.mark.slow
def test_ranks_far_apart_wait_for_each_other_instead_of_failing(tmp_path):
    """Four torchrun-style processes read one node's data plane at very different speeds: the last rank
    joins, pauses, then reads slowly, rank 0 (the host) as fast as it can, i.e. it would be 100 steps ahead.
    With a plan window of 8 steps the fast ranks wait (backpressure), nobody fails, every rank gets the
    single-process stream, the host never holds more than the window, and the lagging rank is logged.
    (Four ranks, not eight: each is a process importing plait, and the property needs one slow rank and
    ranks of different speeds, not a count.)"""
    ranks, steps = 4, 120
    last = ranks - 1
    ds = token_parquet(tmp_path / "data", files=2, docs_per_file=400, row_group_size=50, lo=4, hi=30)
    spec_dict = make_spec([ds], seq_len=32, microbatches=1, dp=ranks, steps=steps)
    window = 8
    env = {**os.environ, "LOCAL_WORLD_SIZE": str(ranks), "TORCHELASTIC_RUN_ID": f"far-{os.getpid()}",
           "PLAIT_NODE_DIR": str(tmp_path / "rdzv"), "PLAIT_PLAN_WINDOW": str(window), "PLAIT_LAG_REPORT_S": "0.5"}
    env.pop("PLAIT_LOCAL_SHARE", None)
    procs, mark = [], str(tmp_path / "rank0-is-reading")
    for r in range(ranks):
        cfg = {"spec": spec_dict, "rank": r, "slow": 0.02 if r == last else 0.002 * (r % 3), "close": True,
               "stats": r == 0}
        if r == 0:
            cfg["mark"] = mark  # written once it has its first batches
        if r == last:
            cfg["pause_after"] = mark  # then it waits 2 s more: rank 0 runs into the window's edge meanwhile
        procs.append(subprocess.Popen([sys.executable, __file__, json.dumps(cfg)], env={**env, "LOCAL_RANK": str(r)},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      cwd=Path(__file__).parents[1]))
    outs, errs = [], []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
        errs.append(err)
    expected = single_process_digests(plait.load_spec(spec_dict))
    assert [o["digest"] for o in outs] == [expected[r] for r in range(ranks)]
    assert all(o["batches"] == steps for o in outs)
    stats = outs[0]["stats"]
    assert stats["window_size"] == window and stats["longest"] <= window  # bounded host memory
    assert stats["waits"] > 0  # the fast ranks waited
    assert "step" in errs[0] and "waits for" in errs[0]  # the host logged whom it waited for
    assert f"pid {procs[last].pid}" in errs[0] or f"process {procs[last].pid}" in errs[0]  # the slow rank named


def _worker(cfg: dict) -> None:
    import hashlib  # noqa: F401

    from helpers import batch_digest as digest

    loader = plait.Loader(cfg["spec"], dp_rank=cfg["rank"])
    if cfg.get("pause_after"):  # joined, not reading yet (e.g. a trainer still loading its model)
        while not os.path.exists(cfg["pause_after"]):
            time.sleep(0.05)
        time.sleep(2.0)
    batches = []
    for mb in loader:
        batches.append(mb)
        if cfg.get("mark") and len(batches) == 2:
            Path(cfg["mark"]).touch()
        time.sleep(cfg["slow"])
    runtime = loader.runtime
    hosts = getattr(runtime, "loader", None) is not None
    stats = runtime.serving_stats() if cfg.get("stats") else None
    import psutil

    listening = [c.laddr.port for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    if cfg["close"]:
        loader.close()
    print(json.dumps({"runtime": type(runtime).__name__, "client": type(getattr(runtime, "client", None)).__name__,
                      "hosts": hosts, "digest": digest(batches),
                      "batches": len(batches), "ended": time.time(), "stats": stats, "listening": listening}),
          flush=True)


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))


def test_a_stopped_hosts_file_counts_only_while_that_host_lives(tmp_path):
    """A host whose trainer raised writes "stopped" for its node's ranks; the file a killed host left behind
    must not fail a relaunch's ranks at once: they wait for the new host (here: until their timeout)."""
    from plait.runtime.node_share import join_host

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = tmp_path / "rendezvous.json"
    spec = plait.load_spec(make_spec([token_parquet(tmp_path / "d")]))
    for pid, expected in ((os.getpid(), "its trainer raised"), (dead.pid, "did not answer within")):
        path.write_text(json.dumps({"address": "grpc://127.0.0.1:1", "token": "t", "pid": pid, "job": "j",
                                    "stopped": "its trainer raised RuntimeError"}))
        with pytest.raises(PlaitError, match=expected):
            join_host(spec, "j", path, timeout=0.5)
