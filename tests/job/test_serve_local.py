"""The one-process job server (`plait serve --runtime local`, plait.runtime.serve_local): thin clients
(runtime="flight") get the local runtime's stream from one process that runs no Ray at all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

flight = pytest.importorskip("pyarrow.flight")

from helpers import free_port, make_spec, token_parquet  # noqa: E402

import plait  # noqa: E402
from plait.runtime.serve_local import LocalJobServer  # noqa: E402

pytestmark = pytest.mark.timeout(120)
JOB = "serve-local-test"


# The same helpers as tests/runtime/test_flight.py's, here so that this Ray-free test runs where Ray is not installed.
def stop(proc: subprocess.Popen, timeout: float = 30) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None


def local_streams(spec) -> dict:
    return {r: list(plait.Loader(spec, dp_rank=r, read_ahead=0)) for r in range(spec.topology.dp)}


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    ds = token_parquet(tmp_path_factory.mktemp("serve-local"), files=2, docs_per_file=40, row_group_size=5,
                       lo=4, hi=40)
    return plait.load_spec(make_spec([ds], seq_len=64, microbatches=2, dp=2, steps=5))


def ids(batches) -> list:
    return [mb.sample_ids.tolist() for mb in batches]


def thin(spec, server, dp_rank=0, **kw):
    return plait.Loader(spec, dp_rank=dp_rank, runtime="flight", job_address=server.address, token=server.token,
                        job=JOB, **kw)


def test_thin_clients_get_every_ranks_local_stream_from_one_process(spec):
    """Both ranks consumed side by side (one shared plan stream: neither rank's start resets the other's),
    the same micro-batches as the local runtime, bit for bit."""
    local = local_streams(spec)
    with LocalJobServer(spec, JOB) as server:
        a, b = thin(spec, server, 0), thin(spec, server, 1)
        got = {0: [], 1: []}
        for mb0, mb1 in zip(a, b):
            got[0].append(mb0)
            got[1].append(mb1)
        a.close()
        b.close()
        assert server.service.gen == 0  # the second rank's seek found the stream already there
        assert server.service.roles.planner.step == 5  # each step planned once, for both ranks
    for r in (0, 1):
        assert ids(got[r]) == ids(local[r]) and len(got[r]) == 10
        for x, y in zip(got[r], local[r]):
            assert (x.input_ids == y.input_ids).all() and (x.labels == y.labels).all()
            assert (x.position_ids == y.position_ids).all() and (x.cu_seqlens == y.cu_seqlens).all()


def test_context_parallel_shards_are_cut_by_the_server(spec):
    cp_spec = spec.with_overrides(topology={"dp": 2, "cp": 2})
    whole = local_streams(spec)
    with LocalJobServer(cp_spec, JOB) as server:
        for r in (0, 1):
            for c in (0, 1):
                want = list(plait.Loader(cp_spec, dp_rank=r, cp_rank=c, read_ahead=0))
                with thin(cp_spec, server, r, cp_rank=c) as loader:
                    got = list(loader)
                assert [mb.input_ids.tolist() for mb in got] == [mb.input_ids.tolist() for mb in want], (r, c)
                assert len(got[0].input_ids) < len(whole[r][0].input_ids)  # the shard travelled, not the batch


def test_a_thin_clients_state_resumes_exactly(spec):
    expected = ids(local_streams(spec)[1])
    with LocalJobServer(spec, JOB) as server:
        for stop_at in (3, 4):  # mid-step and at a step boundary
            with thin(spec, server, 1) as first:
                it = iter(first)
                head = [next(it).sample_ids.tolist() for _ in range(stop_at)]
                state = json.loads(json.dumps(first.state_dict()))
            with thin(spec, server, 1) as second:
                second.load_state_dict(state)
                assert head + ids(second) == expected, stop_at


def test_steps_carry_no_data_state_a_checkpoint_fetches_it(spec, monkeypatch):
    """A thin client's step streams hold tokens, not the state of every source (StateRef); state_dict()
    fetches the state of the step in progress once, and it equals the local runtime's at that point."""
    from plait.runtime.flight import STATE_KEY, Channel, location_of

    local = plait.Loader(spec, dp_rank=0, read_ahead=0)
    local_it = iter(local)
    for _ in range(3):
        next(local_it)
    with LocalJobServer(spec, JOB) as server:
        asked = []
        real = server.service.state_at
        monkeypatch.setattr(server.service, "state_at", lambda gen, step: asked.append(step) or real(gen, step))
        with thin(spec, server, 0) as loader:
            it = iter(loader)
            for _ in range(3):
                next(it)
            assert asked == []  # three micro-batches (two steps) delivered, no state sent or asked for
            state = loader.state_dict()
            assert asked == [1]  # the step in progress, once
            assert json.loads(json.dumps(state)) == json.loads(json.dumps(local.state_dict()))
        channel = Channel(location_of(server.address), server.token, 30)
        ticket = {"gen": server.service.gen, "step": 0, "dp_rank": 1, "limit": 5, "cp": [1, 0]}
        with_state, _ = channel.step(ticket)  # a ticket without "state" (protocol 1's) still gets it
        without, batches = channel.step({**ticket, "state": False})
        channel.close()
        assert with_state == json.loads(json.dumps(server.service.state_at(server.service.gen, 0)))
        assert without is None and len(batches) == 2 and STATE_KEY == b"plait.state"


def test_a_wrong_token_is_refused_and_actions_answer(spec, monkeypatch):
    monkeypatch.delenv("PLAIT_TOKEN", raising=False)
    monkeypatch.delenv("PLAIT_TOKEN_FILE", raising=False)
    with LocalJobServer(spec, JOB) as server:
        with pytest.raises(plait.PlaitError, match=r"refused this client's token \(PLAIT_TOKEN must be"):
            plait.Loader(spec, runtime="flight", job_address=server.address, token="not-the-token")
        with pytest.raises(plait.PlaitError, match="runs a different spec"):
            thin(spec.with_overrides(seed=7), server)
        with pytest.raises(plait.PlaitError, match=f"is '{JOB}', not 'other'"):
            plait.Loader(spec, runtime="flight", job_address=server.address, token=server.token, job="other")
        with thin(spec, server) as loader:
            assert loader.error_report() == {"tok": {"skipped": 0, "bad_records": 0, "messages": []}}
            loader.set_weights({"tok": 1.0}, at_step=4)
            assert server.service.roles.state_dict()["overrides"]  # applied by the server's one Planner
            with pytest.raises(plait.PlaitError, match="dp_rank 9 is not one of this job's 2 DP ranks"):
                loader.runtime.control.action("attach", {"dp_rank": 9})


SERVER_IMPORTS = "import sys, plait.runtime.serve_local; print(json.dumps(sorted(m for m in ('ray', 'torch') if m in sys.modules)))"


@pytest.mark.subprocess
def test_plait_serve_runtime_local_serves_without_ray(spec, tmp_path):
    out = subprocess.run([sys.executable, "-c", "import json; " + SERVER_IMPORTS], capture_output=True, text=True,
                         timeout=60)
    assert json.loads(out.stdout) == [], out.stderr[-2000:]
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec.model_dump(mode="json")))
    plait_bin = Path(sys.executable).parent / "plait"
    server = subprocess.Popen([str(plait_bin), "serve", str(spec_path), "--job", JOB, "--runtime", "local",
                               "--listen", f"127.0.0.1:{free_port()}"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        printed = {}
        while "PLAIT_TOKEN" not in printed:
            line = server.stdout.readline()
            assert line, f"plait serve ended: {server.stderr.read()[-3000:]}"
            key, _, value = line.strip().partition("=")
            printed[key] = value
        with plait.Loader(spec, dp_rank=0, runtime="flight", job_address=printed["PLAIT_ADDRESS"],
                          token=printed["PLAIT_TOKEN"]) as loader:
            assert ids(loader) == ids(local_streams(spec)[0])
        assert stop(server) == 0, server.stderr.read()[-3000:]  # Ctrl-C ends the job cleanly
    finally:
        stop(server)


def test_one_server_shell_answers_only_what_its_answerers_offer():
    """JobFlight, the one plait Flight server: an action none of its answerers offers is refused in one
    sentence, a server without `get` streams nothing, a wrong token is refused; `hello` of the first
    answerer that has it answers."""
    from plait.runtime.flight import Channel
    from plait.runtime.flight_serving import JobFlight, grpc_location

    class Front:
        def hello(self) -> dict:
            return {"job": "shell"}

    server = JobFlight(grpc_location("127.0.0.1", 0), "secret", (Front(),))
    try:
        channel = Channel(grpc_location("127.0.0.1", server.port), "secret", 10)
        assert channel.action("hello") == {"job": "shell"}
        with pytest.raises(plait.PlaitError, match="unknown action 'seek'"):
            channel.action("seek", {"state": {}})
        with pytest.raises(plait.PlaitError, match="streams no steps"):
            channel.step({"gen": 0, "step": 0, "dp_rank": 0, "cp": [1, 0]})
        assert [a.type for a in channel.client.list_actions(options=channel.options)] == ["hello"]
        channel.close()
        wrong = Channel(grpc_location("127.0.0.1", server.port), "not-it", 10)
        with pytest.raises(plait.PlaitError, match="refused this client's token"):
            wrong.action("hello")
        wrong.close()
    finally:
        server.shutdown()
