"""The node's ranks read their micro-batches from shared memory (plait.runtime.node_shm*): the same stream
as over Flight, no pyarrow in a thin rank, and no segment left in /dev/shm by a killed rank or host."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers): this file also runs as a trainer script
if __name__ != "__main__":  # a trainer run from here must not import pyarrow before it has read (helpers does)
    from helpers import batch_digest, make_spec, token_parquet

import plait  # noqa: E402
from plait.batch import MicroBatch  # noqa: E402
from plait.errors import PlaitError  # noqa: E402
from plait.runtime.node_shm import map_segment, remove_leftovers, shm_dir, write_segment  # noqa: E402

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(shm_dir() is None or not sys.platform.startswith("linux"), reason="no /dev/shm")]
SHM = shm_dir() or Path("/dev/shm")


@pytest.fixture(scope="module")
def spec_dict(tmp_path_factory):
    ds = token_parquet(tmp_path_factory.mktemp("node-shm"), files=2, docs_per_file=40, row_group_size=5, lo=4, hi=40)
    return make_spec([ds], seq_len=64, microbatches=2, dp=2, steps=6)


def segments_of(pid: int) -> list[str]:
    return sorted(p.name for p in SHM.glob(f"plait-{pid}-*") if p.suffix != ".lock")  # a live host's lock stays


def segment_files(folder) -> list:
    return [p for p in folder.iterdir() if p.suffix != ".lock"]


def wait_for(condition, timeout: float = 60.0) -> bool:
    """Polls until `condition()` (a bound for a hang, not a timing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_a_segment_round_trips_every_field_as_read_only_views(tmp_path):
    mb = MicroBatch(step=3, microbatch=1, num_microbatches=2, dp_rank=1, input_ids=np.arange(5, dtype=np.int32),
                    labels=np.arange(5, dtype=np.int32), position_ids=np.zeros(5, np.int32),
                    cu_seqlens=np.array([0, 5], np.int32), sample_ids=np.arange(10, dtype=np.int64).reshape(2, 5),
                    source_ids=np.zeros(0, np.int32), stats={"cp": {"cu": np.array([1, 2])}},
                    pixel_values=np.full((3, 7), 9, np.uint8))
    size, layouts = write_segment(tmp_path / "seg", [mb])
    assert size % 64 == 0 and (tmp_path / "seg").stat().st_mode & 0o777 == 0o600
    got = map_segment(tmp_path / "seg", size, layouts)[0]
    (tmp_path / "seg").unlink()  # the mapping outlives the name
    assert batch_digest([got]) == batch_digest([mb])
    assert got.sample_ids.shape == (2, 5) and got.image_grid is None and got.source_ids.shape == (0,)
    assert not got.input_ids.flags.writeable and not got.input_ids.flags.owndata


def test_leftovers_of_a_dead_host_are_removed_and_a_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name in (f"plait-{dead.pid}-job-0", f"plait-{os.getpid()}-job-0", "other-1"):
        (tmp_path / name).touch()
    assert remove_leftovers(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-1", f"plait-{os.getpid()}-job-0"]


def test_a_host_that_holds_its_lock_is_live_whatever_its_pid_says(tmp_path):
    """Containers sharing /dev/shm number their processes apart: a pid that names no process here may be a
    live host in another PID namespace. Its lock decides: held, its segments stay; free, they go (lock too)."""
    from plait.runtime.node_shm import hold_host_lock, release_host_lock

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    elsewhere, dead = f"plait-{gone.pid}-other-", f"plait-{gone.pid}-mine-"
    fd = hold_host_lock(tmp_path, elsewhere)  # a live host (this process holds its lock) under a pid not its own
    os.close(hold_host_lock(tmp_path, dead))  # a host that died: its lock file is left, and free
    for prefix in (elsewhere, dead):
        (tmp_path / f"{prefix}0").touch()
    assert remove_leftovers(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{elsewhere}0", f"plait-{gone.pid}-other.lock"]
    release_host_lock(tmp_path, elsewhere, fd)
    assert remove_leftovers(tmp_path) == 1 and not list(tmp_path.iterdir())


def test_the_ranks_of_one_replica_map_one_segment_that_goes_when_all_have(tmp_path):
    """Two TP ranks (connections 1, 2) of DP rank 0 read step 5: one write; its name stays until both mapped
    it. A reader that dies before mapping (its connection closes) does not keep it either."""
    from plait.runtime.node_shm_host import Segments

    segments = Segments(tmp_path, "plait-1-t-")
    mb = MicroBatch(step=5, microbatch=0, num_microbatches=1, dp_rank=0, input_ids=np.arange(4, dtype=np.int32),
                    labels=np.arange(4, dtype=np.int32), position_ids=np.arange(4, dtype=np.int32),
                    cu_seqlens=np.array([0, 4], np.int32), sample_ids=np.zeros((1, 5), np.int64),
                    source_ids=np.zeros(1, np.int32))
    key = (0, 5, 0, 1, 0)
    first = segments.get(1, key, [mb])
    assert segments.get(2, key, [mb]) == first and len(segment_files(tmp_path)) == 1  # written once
    segments.mapped(1, first[0])
    assert (tmp_path / first[0]).exists()  # rank 2 has not mapped it yet
    segments.mapped(2, first[0])
    assert not segment_files(tmp_path)
    again = segments.get(1, (0, 6, 0, 1, 0), [mb])
    segments.mapped(1, again[0])
    assert (tmp_path / again[0]).exists()  # connection 2 reads DP rank 0 too
    segments.forget(2)  # its trainer died
    assert not segment_files(tmp_path) and len(segments) == 0
    full = Segments(tmp_path / "missing", "plait-1-t-")  # as a full /dev/shm refuses a write
    with pytest.raises(PlaitError, match="cannot write step 5 of DP rank 0 into .*PLAIT_NODE_TRANSPORT=flight"):
        full.get(1, key, [mb])


def test_a_client_without_the_jobs_token_is_refused(tmp_path):
    """The socket's name is in the abstract namespace, readable by anyone on the machine: the job's token
    (HMAC challenge of multiprocessing.connection) is what keeps other users out."""
    from types import SimpleNamespace

    from plait.runtime.node_shm_client import ShmChannel
    from plait.runtime.node_shm_host import NodeShmServer

    server = NodeShmServer(SimpleNamespace(service=None, token="the-jobs-token"), tmp_path, "tok")
    try:
        with pytest.raises(PlaitError, match="refused the token"):
            ShmChannel(server.address, "another-token")
        with pytest.raises(PlaitError, match="unknown request 'nonsense'"):
            ShmChannel(server.address, "the-jobs-token").call("nonsense", None)
    finally:
        server.close()
    with pytest.raises(PlaitError, match="LOCAL_RANK 0"):
        ShmChannel(server.address, "the-jobs-token")  # nobody listens any more


def test_the_host_serves_its_connections_from_one_thread_and_a_waiting_request_holds_up_no_other(tmp_path):
    """Two connections per rank used to mean two threads each (and a glibc malloc arena each: the host's RSS
    rose above Flight's); now one thread serves them all and only a request that waits takes a thread."""
    import threading
    from types import SimpleNamespace

    from plait.runtime.node_shm_client import ShmChannel
    from plait.runtime.node_shm_host import NodeShmServer

    release = threading.Event()

    def get(gen, step, dp_rank, *rest):
        assert release.wait(60)  # a step beyond the window: waits for a slower rank
        return {"step": step}, []

    host = SimpleNamespace(service=SimpleNamespace(get=get), token="tok",
                           answerers=(SimpleNamespace(state_at=lambda gen, step: (gen, step)),))
    server = NodeShmServer(host, tmp_path, "thr")
    try:
        waiting = ShmChannel(server.address, "tok")
        got = []
        reader = threading.Thread(target=lambda: got.append(waiting.call("get", (0, 3, 0, None, (1, 0), True, None))))
        reader.start()
        channels = [ShmChannel(server.address, "tok") for _ in range(16)]
        assert [c.call("action", ("state_at", {"gen": i, "step": 0})) for i, c in enumerate(channels)] == \
            [(i, 0) for i in range(16)]  # answered while the get waits
        shm_threads = [t.name for t in threading.enumerate() if t.name.startswith("plait-shm")]
        assert len(shm_threads) <= 4, shm_threads  # accept, serve, the waiting get's, one reused for actions
        release.set()
        reader.join(30)
        assert got == [({"step": 3}, (None, 0, []))]
    finally:
        release.set()
        server.close()
    assert not [t for t in threading.enumerate() if t.name == "plait-shm-serve"]


def launch_env(monkeypatch, tmp_path, run: str) -> None:
    for k, v in {"LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 1, "TORCHELASTIC_RUN_ID": run,
                 "PLAIT_NODE_DIR": tmp_path / "rdzv"}.items():
        monkeypatch.setenv(k, str(v))
    monkeypatch.delenv("PLAIT_NODE_TRANSPORT", raising=False)


def test_a_ranks_stream_over_shared_memory_equals_its_stream_over_flight(spec_dict, tmp_path, monkeypatch):
    """One node, one process (host and reader): the shm stream, resumed from a checkpoint in the middle,
    equals the Flight stream and the local runtime's; no segment is left once the Loader closed."""
    pytest.importorskip("pyarrow.flight")
    spec = plait.load_spec(spec_dict)
    local = list(plait.Loader(spec, dp_rank=1, read_ahead=0, share="process"))
    streams = {}
    for transport in ("shm", "flight"):
        launch_env(monkeypatch, tmp_path, f"cmp-{transport}")
        with plait.Loader(spec, dp_rank=1, share="node", transport=transport) as loader:
            client = type(loader.runtime.client).__name__
            assert client == ("ShmNodeClient" if transport == "shm" else "NodeHostClient")
            it = iter(loader)
            first = [next(it) for _ in range(5)]
            state = loader.state_dict()
        with plait.Loader(spec, dp_rank=1, share="node", transport=transport) as again:
            again.load_state_dict(state)
            streams[transport] = first + list(again)
    assert batch_digest(streams["shm"]) == batch_digest(streams["flight"]) == batch_digest(local)
    assert not streams["shm"][0].input_ids.flags.writeable  # views of the mapping, as Flight's are of its buffers
    assert wait_for(lambda: not segments_of(os.getpid()))
    with pytest.raises(PlaitError, match="transport='carrier-pigeon' is not one of shm, flight"):
        plait.Loader(spec, dp_rank=1, share="node", transport="carrier-pigeon")


def start(cfg: dict, rank: int, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, json.dumps({**cfg, "rank": rank})],
                            env={**env, "LOCAL_RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=Path(__file__).parents[1])


def node_env(tmp_path: Path, run: str) -> dict:
    env = {**os.environ, "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": f"{run}-{os.getpid()}",
           "PLAIT_NODE_DIR": str(tmp_path / "rdzv")}
    for k in ("PLAIT_LOCAL_SHARE", "PLAIT_NODE_TRANSPORT"):
        env.pop(k, None)
    return env


def result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=150)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def reference(spec_dict, rank: int, steps: int | None = None) -> list:
    return list(plait.Loader(plait.load_spec(spec_dict), dp_rank=rank, read_ahead=0, share="process", steps=steps))


@pytest.mark.subprocess
def test_a_killed_rank_leaves_no_segment_and_the_others_read_on(spec_dict, tmp_path):
    """Rank 1 asks for a step and is SIGKILLed before it maps the segment the host wrote for it: the host
    unlinks it, forgets the dead rank (its window does not wait for it) and serves rank 0 its whole
    stream, every sample once; nothing of the job is left in /dev/shm."""
    env = node_env(tmp_path, "kill-rank")
    host = start({"spec": spec_dict, "slow": 0.0, "wait_for": str(tmp_path / "victim-gone")}, 0, env)
    asked = tmp_path / "victim-asked"
    victim = start({"spec": spec_dict, "victim": True, "mark": str(asked)}, 1, env)
    try:
        assert wait_for(lambda: asked.exists() and segments_of(host.pid), timeout=120), \
            victim.stderr.read()[-3000:] if victim.poll() is not None else "no segment written"
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        assert wait_for(lambda: not segments_of(host.pid))  # unlinked by the host when the rank's socket closed
        (tmp_path / "victim-gone").touch()
        got = result(host)
    finally:
        for p in (host, victim):
            if p.poll() is None:
                p.kill()
    assert got["digest"] == batch_digest(reference(spec_dict, 0)) and got["batches"] == 12
    assert not segments_of(host.pid) and not segments_of(victim.pid)


@pytest.mark.subprocess
def test_a_killed_host_leaves_no_segment_and_its_ranks_stop_cleanly(spec_dict, tmp_path):
    """The host (LOCAL_RANK 0) is SIGKILLed while rank 1 reads: rank 1's next batch fails naming the host,
    what it read is the start of its stream (none lost before, none repeated), and the segments the host
    had written and nobody mapped (here one planted under its pid) are removed by the rank that saw it die."""
    env = node_env(tmp_path, "kill-host")
    marks = [tmp_path / "host-reading", tmp_path / "rank-reading"]
    host = start({"spec": spec_dict, "slow": 0.0, "mark": str(marks[0]), "hang": True, "steps": 40}, 0, env)
    rank = start({"spec": spec_dict, "slow": 0.1, "mark": str(marks[1]), "expect_error": True, "steps": 40}, 1, env)
    try:
        assert wait_for(lambda: all(m.exists() for m in marks), timeout=120)
        (SHM / f"plait-{host.pid}-planted-0").write_bytes(b"x" * 64)  # as if written and never mapped
        host.send_signal(signal.SIGKILL)
        host.wait()
        got = result(rank)
    finally:
        for p in (host, rank):
            if p.poll() is None:
                p.kill()
    assert "data host" in got["error"] and "LOCAL_RANK 0" in got["error"], got["error"]
    expected = reference(spec_dict, 1, steps=40)
    assert 0 < got["batches"] < len(expected)
    assert got["digest"] == batch_digest(expected[:got["batches"]])
    assert not segments_of(host.pid)
    assert got["thin"], got  # a rank that reads from shared memory loaded neither pyarrow nor plait's sources


def _victim(cfg: dict) -> None:
    """A rank that asks the host for its first step and never reads the answer (then it is killed)."""
    from plait.runtime.node_share import NodeRuntime

    runtime = NodeRuntime(plait.load_spec(cfg["spec"]), share="node")
    client = runtime.client
    client.control.action("join", {"id": client.client_id, "pid": os.getpid()})
    gen, _ = client.control.action("base")
    client.data.tell("get", (gen, 0, 1, None, (1, 0), False, client.client_id))
    Path(cfg["mark"]).touch()
    time.sleep(600)


def _worker(cfg: dict) -> None:
    if cfg.get("victim"):
        _victim(cfg)
    loader = plait.Loader(cfg["spec"], dp_rank=cfg["rank"], steps=cfg.get("steps"))
    batches, error = [], None
    try:
        for mb in loader:
            batches.append(mb)
            if cfg.get("mark") and len(batches) == 2:
                Path(cfg["mark"]).touch()
                if cfg.get("hang"):
                    time.sleep(600)  # killed here
            if cfg.get("wait_for") and len(batches) == 1:
                while not os.path.exists(cfg["wait_for"]):
                    time.sleep(0.05)
            time.sleep(cfg["slow"])
    except PlaitError as e:
        if not cfg.get("expect_error"):
            raise
        error = str(e)
    loader.close()
    thin = not any(m in sys.modules for m in ("pyarrow", "plait.sources", "plait.runtime.flight"))
    from helpers import batch_digest

    print(json.dumps({"digest": batch_digest(batches), "batches": len(batches), "error": error, "thin": thin}),
          flush=True)


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
