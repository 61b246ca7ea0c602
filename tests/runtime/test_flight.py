"""The thin trainer client (runtime="flight"): batches over Arrow Flight from a job `plait serve` runs.

The session's Ray head (`ray start --head`, its own temp dir, token auth on with the session's token:
tests/conftest.py `ray_head`, shared with test_ray_jobs), one `plait serve` process on it; the trainer processes are plain subprocesses that never
import Ray. This process never joins Ray.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray")
flight = pytest.importorskip("pyarrow.flight")

import plait  # noqa: E402
from plait.batch import MicroBatch  # noqa: E402
from plait.metrics import batch_digest_update, combined_digest  # noqa: E402
from plait.runtime import RankStream, make_driver, runtime_class  # noqa: E402
from plait.runtime.flight import Channel, decode_batch, dumps, step_schema  # noqa: E402
from plait.runtime.ray.flight_server import ConstructorFlight  # noqa: E402
from helpers import free_port, make_spec, stop_ray_head, token_parquet  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.subprocess, pytest.mark.slow, pytest.mark.timeout(300)]
BIN = Path(sys.executable).parent
JOB = "flight-test"

# A trainer process: one thin Loader per rank in turn; digests, zero-copy flags, a resume, what it imported.
TRAINER = r"""
import hashlib, json, sys
import plait
from plait.metrics import batch_digest_update

spec = plait.load_spec(sys.argv[1])
out = {"digests": {}, "read_only_views": True}
for r in range(spec.topology.dp):
    h = hashlib.sha256()
    with plait.Loader(spec, dp_rank=r, runtime="flight", job="flight-test") as loader:
        for mb in loader:
            batch_digest_update(h, mb)
            out["read_only_views"] &= not (mb.input_ids.flags.owndata or mb.input_ids.flags.writeable)
    out["digests"][str(r)] = h.hexdigest()
for stop in (3, 4):  # mid-step (micro-batch 1 of step 1 next) and at a step boundary
    with plait.Loader(spec, dp_rank=1, runtime="flight") as first:
        it = iter(first)
        head = [next(it).sample_ids.tolist() for _ in range(stop)]
        state = json.loads(json.dumps(first.state_dict()))
    with plait.Loader(spec, dp_rank=1, runtime="flight") as second:
        second.load_state_dict(state)
        out[f"resumed_{stop}"] = head + [mb.sample_ids.tolist() for mb in second]
out["ray_imported"] = "ray" in sys.modules
out["compute_imported"] = "pyarrow.compute" in sys.modules  # ~10 MiB a thin trainer does not need
print(json.dumps(out))
"""


def stop(proc: subprocess.Popen, timeout: float = 30) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    ds = token_parquet(tmp_path_factory.mktemp("flight"), files=2, docs_per_file=40, row_group_size=5, lo=4, hi=40)
    return plait.load_spec(make_spec([ds], seq_len=64, microbatches=2, dp=2, steps=5))


@pytest.fixture(scope="module")
def served(spec, tmp_path_factory, ray_head):
    """`plait serve SPEC --job flight-test` on the session's Ray head (tests/conftest.py); yields {address,
    token, spec_path, ...}."""
    tmp = tmp_path_factory.mktemp("serve")
    spec_path = tmp / "spec.yaml"
    spec_path.write_text(json.dumps(spec.model_dump(mode="json")))
    env = ray_head["env"]
    server = None
    try:
        server = subprocess.Popen([str(BIN / "plait"), "serve", str(spec_path), "--job", JOB, "--ray-address",
                                   ray_head["address"], "--loaders", "1", "--token-file", str(tmp / "token")],
                                  env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        printed = {}
        while "PLAIT_TOKEN" not in printed:
            line = server.stdout.readline()
            assert line, f"plait serve ended: {server.stderr.read()[-3000:]}"
            key, _, value = line.strip().partition("=")
            printed[key] = value
        assert (tmp / "token").read_text().strip() == printed["PLAIT_TOKEN"]
        assert oct((tmp / "token").stat().st_mode & 0o777) == "0o600"
        yield {"address": printed["PLAIT_ADDRESS"], "token": printed["PLAIT_TOKEN"], "spec_path": spec_path,
               "ray_address": ray_head["address"], "env": env, "head_pid": ray_head["pid"]}
        assert stop(server) == 0, server.stderr.read()[-3000:]  # Ctrl-C ends the job cleanly
    finally:
        if server is not None:
            stop(server)


def actor_processes(served, actor: str) -> list:
    """The module's job's processes of one actor class: descendants of its `ray start --head` (the raylet's
    workers), never another cluster's on the same machine (tests run in two workers side by side)."""
    import psutil

    found = []
    for p in psutil.Process(served["head_pid"]).children(recursive=True):
        try:
            if f"ray::{actor}" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            continue
    return found


def local_streams(spec) -> dict[int, list[MicroBatch]]:
    return {r: list(plait.Loader(spec, dp_rank=r, read_ahead=0)) for r in range(spec.topology.dp)}


def test_flight_runtime_keeps_the_runtime_contract():
    cls = runtime_class("flight")
    for method in [n for n, v in vars(RankStream).items() if callable(v) and not n.startswith("_")]:
        want = list(inspect.signature(getattr(RankStream, method)).parameters)
        have = list(inspect.signature(getattr(cls, method)).parameters)
        assert have[: len(want)] == want or "args" in have[-1:], f"flight.{method}{have} != contract {want}"


def test_a_trainers_node_is_found_by_name_or_by_its_connections_address(monkeypatch):
    from plait.errors import PlaitError
    from plait.runtime.flight_serving import peer_host
    from plait.runtime.ray import serving

    nodes = [{"NodeID": "aaa", "NodeName": "head", "NodeManagerAddress": "10.0.0.1", "Alive": True},
             {"NodeID": "bbb", "NodeName": "gpu-7", "NodeManagerAddress": "10.0.0.7", "Alive": True},
             {"NodeID": "ccc", "NodeName": "gone", "NodeManagerAddress": "10.0.0.9", "Alive": False}]
    monkeypatch.setattr(serving, "ray_module", lambda: type("FakeRay", (), {"nodes": staticmethod(lambda: nodes)}))
    find = serving.trainer_node
    assert find(None, peer_host("ipv4:10.0.0.7:51234"), "aaa") == "bbb"
    assert find(None, peer_host("ipv6:[::ffff:10.0.0.7]:51234"), "aaa") == "bbb"  # dual-stack socket
    assert find(None, peer_host("ipv4:127.0.0.1:5"), "aaa") == "aaa"  # on the serving node
    assert find(None, "10.0.0.9", "aaa") == "aaa" and find(None, "192.168.1.5", "aaa") == "aaa"  # dead / outside
    assert find(None, peer_host("unix:/tmp/sock"), "aaa") == "aaa"
    assert find("gpu-7", None, "aaa") == find("bbb", None, "aaa") == find("10.0.0.7", "10.0.0.1", "aaa") == "bbb"
    with pytest.raises(PlaitError, match="PLAIT_NODE='gone' names no live node.*gpu-7"):
        find("gone", None, "aaa")


def test_received_arrays_are_views_of_the_arrow_buffers():
    """A step travels as one-row record batches; the client's numpy arrays point into what Flight
    received (no copy after the wire); stats (with arrays) come back as they left."""
    mb = MicroBatch(step=3, microbatch=0, num_microbatches=1, dp_rank=0, input_ids=np.arange(100, dtype=np.int32),
                    labels=np.arange(100, dtype=np.int32), position_ids=np.arange(100, dtype=np.int32),
                    cu_seqlens=np.array([0, 40, 100], np.int32), sample_ids=np.arange(10).reshape(2, 5),
                    source_ids=np.array([0, 1], np.int32), stats={"cp": {"cu_seqlens": np.array([0, 7])}, "f": 0.5})
    server = ConstructorFlight(lambda *a: ({"step": 3}, [mb]), "127.0.0.1", "secret")
    try:
        channel = Channel(server.location, "secret", 10)
        reader = channel.client.do_get(flight.Ticket(dumps({"gen": 0, "step": 3, "dp_rank": 0, "cp": [1, 0]})),
                                       options=channel.options)
        assert json.loads(reader.schema.metadata[b"plait.state"]) == {"step": 3}
        assert reader.schema == step_schema({"step": 3}, [mb])
        chunk = reader.read_chunk()
        got = decode_batch(chunk.data, chunk.app_metadata)
        for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "sample_ids", "source_ids"):
            assert np.array_equal(getattr(got, name), getattr(mb, name)), name
            col = chunk.data.column(name).flatten()
            buf = (col.flatten() if name == "sample_ids" else col).buffers()[1]
            ptr = getattr(got, name).__array_interface__["data"][0]
            assert buf.address <= ptr < buf.address + buf.size, f"{name} was copied"
        assert got.sample_ids.shape == (2, 5) and got.input_ids.dtype == np.int32
        assert got.stats["f"] == 0.5 and got.stats["cp"]["cu_seqlens"].tolist() == [0, 7]
        channel.close()
    finally:
        server.shutdown()


def test_thin_client_delivers_the_local_stream_and_never_imports_ray(served, spec):
    env = {**os.environ, "PLAIT_ADDRESS": served["address"], "PLAIT_TOKEN": served["token"]}
    out = subprocess.run([sys.executable, "-c", TRAINER, str(served["spec_path"])], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ray_imported"] is False and got["compute_imported"] is False
    assert got["read_only_views"] is True

    local = local_streams(spec)
    digests = {}
    for r, batches in local.items():
        h = hashlib.sha256()
        for mb in batches:
            batch_digest_update(h, mb)
        digests[str(r)] = h.hexdigest()
    assert combined_digest(got["digests"]) == combined_digest(digests)
    # A thin client's state_dict resumes exactly, mid-step and at a step boundary.
    expected = [mb.sample_ids.tolist() for mb in local[1]]
    assert got["resumed_3"] == expected and got["resumed_4"] == expected


def test_a_wrong_token_or_address_is_refused_in_one_sentence(served, spec, monkeypatch):
    monkeypatch.delenv("PLAIT_TOKEN", raising=False)
    monkeypatch.delenv("PLAIT_TOKEN_FILE", raising=False)
    with pytest.raises(plait.PlaitError, match=r"refused this client's token \(PLAIT_TOKEN must be"):
        plait.Loader(spec, runtime="flight", job_address=served["address"], token="not-the-token")
    with pytest.raises(plait.PlaitError, match="needs the job's token"):
        plait.Loader(spec, runtime="flight", job_address=served["address"])
    with pytest.raises(plait.PlaitError, match="runs a different spec"):
        plait.Loader(spec.with_overrides(seed=7), runtime="flight", job_address=served["address"], token=served["token"])
    with pytest.raises(plait.PlaitError, match="is 'flight-test', not 'other'"):
        plait.Loader(spec, runtime="flight", job_address=served["address"], token=served["token"], job="other")
    with pytest.raises(plait.PlaitError, match="no plait job answers at"):
        plait.Loader(spec, runtime="flight", job_address=f"127.0.0.1:{free_port()}", token="x", call_timeout=5)
    with plait.Loader(spec, runtime="flight", job_address=served["address"], token=served["token"]) as loader:
        assert loader.error_report() == {"tok": {"skipped": 0, "bad_records": 0, "messages": []}}  # forwarded to the Planner
        assert not hasattr(loader.runtime, "plan")  # a stream, not a driver (plait.runtime.JobDriver)
        with pytest.raises(plait.PlaitError, match="drives no job"):
            make_driver(spec, "flight")


def test_a_thin_client_survives_its_constructors_death(served, spec):
    """The Constructor process serving a thin client is killed mid-stream: the client asks the rendezvous
    again (`reconnect`), which starts a new Constructor; the step is rebuilt from the Planner's window, and
    the rank's stream is the local runtime's, no sample lost or repeated (sample ids). Runs last: the job
    goes on with the new Constructor."""
    import psutil

    expected = [mb.sample_ids.tolist() for mb in local_streams(spec)[0]]
    got = []
    with plait.Loader(spec, dp_rank=0, runtime="flight", job_address=served["address"], token=served["token"],
                      read_ahead=0) as loader:
        it = iter(loader)
        got += [next(it).sample_ids.tolist() for _ in range(4)]  # steps 0 and 1
        victims = actor_processes(served, "ConstructorActor")
        assert victims, "no Constructor process found"
        for p in victims:
            p.kill()
        psutil.wait_procs(victims, timeout=30)
        got += [mb.sample_ids.tolist() for mb in it]
        assert loader.runtime.reconnects >= 1
    assert got == expected
    flat = [tuple(row) for mb in got for row in mb]
    assert len(flat) == len(set(flat))  # each sample (document chunk) once


def test_a_thin_client_survives_the_planners_death(served, spec):
    """The job's Planner is killed while a thin client reads: the standby's successor takes over (the
    Constructors and the rendezvous follow it); the stream and a checkpoint taken after it are exact."""
    import psutil

    expected = [mb.sample_ids.tolist() for mb in local_streams(spec)[1]]
    with plait.Loader(spec, dp_rank=1, runtime="flight", job_address=served["address"], token=served["token"],
                      read_ahead=0) as loader:
        it = iter(loader)
        got = [next(it).sample_ids.tolist() for _ in range(2)]  # step 0
        victims = actor_processes(served, "PlannerActor")
        assert len(victims) == 1
        victims[0].kill()
        psutil.wait_procs(victims, timeout=30)
        got += [next(it).sample_ids.tolist() for _ in range(3)]  # into step 2, planned by the successor
        state = json.loads(json.dumps(loader.state_dict()))  # asked of the successor, through the rendezvous
    with plait.Loader(spec, dp_rank=1, runtime="flight", job_address=served["address"], token=served["token"]) as again:
        again.load_state_dict(state)
        got += [mb.sample_ids.tolist() for mb in again]
    assert got == expected


# A thin trainer on its own node: one rank's digest and the rank's endpoint.
NODE_TRAINER = r"""
import hashlib, json, sys
import plait
from plait.metrics import batch_digest_update

spec = plait.load_spec(sys.argv[1])
h = hashlib.sha256()
with plait.Loader(spec, dp_rank=1, runtime="flight", read_ahead=0) as loader:
    for mb in loader:
        batch_digest_update(h, mb)
    print(json.dumps({"digest": h.hexdigest(), "endpoint": loader.runtime.info["endpoints"]["1"]}), flush=True)
    sys.stdin.readline()  # stay connected while the test looks at the Constructor's process
"""


def test_a_thin_trainer_is_served_by_a_constructor_on_its_own_node(served, spec):
    """A second Ray node joins; a trainer there (PLAIT_NODE names it) is served by a Constructor started
    on that node (a descendant of that node's raylet), with the same stream; a PLAIT_NODE naming no node
    is refused in one sentence. Runs last: the node leaves at the end."""
    import psutil

    node = subprocess.Popen([str(BIN / "ray"), "start", "--address", served["ray_address"], "--block", "--num-cpus", "1",
                             "--node-name", "plait-node-b", "--disable-usage-stats"], env=served["env"],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    trainer = None
    try:
        env = {**os.environ, "PLAIT_ADDRESS": served["address"], "PLAIT_TOKEN": served["token"], "PLAIT_NODE": "nope"}
        bad = subprocess.run([sys.executable, "-c", NODE_TRAINER, str(served["spec_path"])], env=env, input="",
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode != 0 and "PLAIT_NODE='nope' names no live node" in bad.stderr
        deadline = time.monotonic() + 60
        while True:  # the node is up once the job's Ray cluster lists it (the error message names the nodes)
            probe = subprocess.run([sys.executable, "-c", NODE_TRAINER, str(served["spec_path"])], env=env, input="",
                                   capture_output=True, text=True, timeout=120)
            if "plait-node-b" in probe.stderr or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert "plait-node-b" in probe.stderr, probe.stderr[-2000:]
        trainer = subprocess.Popen([sys.executable, "-c", NODE_TRAINER, str(served["spec_path"])],
                                   env={**env, "PLAIT_NODE": "plait-node-b"}, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = trainer.stdout.readline()
        assert line, trainer.stderr.read()[-3000:]
        got = json.loads(line)
        h = hashlib.sha256()
        for mb in local_streams(spec)[1]:
            batch_digest_update(h, mb)
        assert got["digest"] == h.hexdigest()
        port = int(got["endpoint"].rsplit(":", 1)[1])
        # one process may listen on the port more than once (IPv4 and IPv6 sockets): count processes, not sockets
        (server,) = {c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.pid
                     and c.status == psutil.CONN_LISTEN}
        assert node.pid in [p.pid for p in psutil.Process(server).parents()], "not a process of node b"
        assert "ConstructorActor" in " ".join(psutil.Process(server).cmdline())
    finally:
        if trainer is not None:
            trainer.communicate(input="\n", timeout=60)
        stop_ray_head(node)
