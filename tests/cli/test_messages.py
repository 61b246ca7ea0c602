"""Errors a user hits are one sentence in the user's own context (issue 22, items 6 and 8): a metrics port
in use; a node's data host that died or refuses a token (a torchrun trainer, not `plait serve`); a job
name already running, said to a Loader (attach=True) or to `plait serve` (no such option)."""

from __future__ import annotations

import pickle
import socket

import pytest
import yaml

import plait
from plait import cli
from plait.errors import PlaitError
from helpers import make_spec, token_parquet

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    ds = token_parquet(tmp_path_factory.mktemp("messages"), files=1, docs_per_file=20, row_group_size=5, lo=4, hi=40)
    return make_spec([ds], seq_len=64, microbatches=2, dp=1)


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_metrics_port_in_use_is_a_plait_error(spec, busy_port):
    with pytest.raises(PlaitError, match=f"cannot serve metrics on 127.0.0.1:{busy_port} .*choose another port"):
        plait.Loader({**spec, "metrics": {"port": busy_port}})


def test_cli_metrics_port_in_use_is_one_sentence_and_exit_2(spec, busy_port, tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert cli.main(["run", str(path), "--steps", "1", "--quiet", "--metrics-port", str(busy_port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot serve metrics on 127.0.0.1:{busy_port}" in err
    assert "Traceback" not in err and "OSError" not in err


def test_a_node_hosts_failures_are_said_in_torchrun_terms(spec):
    pytest.importorskip("pyarrow.flight")
    from plait.runtime.flight import FlightRuntime
    from plait.runtime.node_share import node_client_class
    from plait.runtime.serve_local import LocalJobServer

    node_client = node_client_class()
    loaded = plait.load_spec(spec)
    with LocalJobServer(loaded, "node-job") as server:
        with pytest.raises(PlaitError) as refused:
            node_client(loaded, job_address=server.address, token="not-the-token", job="node-job")
        with pytest.raises(PlaitError, match="the token `plait serve` printed"):
            FlightRuntime(loaded, job_address=server.address, token="not-the-token", job="node-job")
        client = node_client(loaded, job_address=server.address, token=server.token, job="node-job")
    assert "rendezvous file" in str(refused.value) and "plait serve" not in str(refused.value)
    try:
        with pytest.raises(PlaitError) as gone:
            client.control.action("base")
    finally:
        client.close()
    message = str(gone.value)
    assert "data host, the trainer process with LOCAL_RANK 0, has ended or died" in message
    assert "plait serve" not in message


def test_plait_serve_is_not_told_to_pass_attach(spec, monkeypatch):
    pytest.importorskip("ray")
    from plait.runtime.ray import serving
    from plait.runtime.ray.planner_actor import JobNameTaken

    taken = "a job named 'busy' is running (1 trainer attached, started 3 s ago)"
    assert pickle.loads(pickle.dumps(JobNameTaken(taken))).plain == taken  # as Ray hands it back from the actor

    def running(*args, **kwargs):
        raise JobNameTaken(f"{taken}; pass attach=True to join it, or `plait jobs stop busy`", plain=taken)

    monkeypatch.setattr(serving, "RayRuntime", running)
    with pytest.raises(PlaitError) as refused:
        serving.JobServer(spec, "busy")
    message = str(refused.value)
    assert message.startswith(taken) and "choose another --job name" in message and "`plait jobs stop busy`" in message
    assert "attach=" not in message
