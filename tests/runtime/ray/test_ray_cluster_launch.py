"""Trainers on Ray as a cluster runs them, token authentication on: joining a `ray start --head` cluster by
RAY_ADDRESS, address="auto" or an explicit address (no start-only option reaches the join); a torchrun-style
launch (rank 0 creates the job, rank 1 attaches) whose ranks are killed and relaunched at once under the
same job name, on rank 0's own local instance (a stale rendezvous file, a second process that must use the
instance's token auth) and on a cluster (the crashed launch's job still ending).

The trainers run in subprocesses with their own environment (this process never joins these instances):
RAY_AUTH_TOKEN holds the token (no ~/.ray/auth_token is written), RAY_TMPDIR and TMPDIR a temp dir of the
module (no other Ray instance on the machine is found, no rendezvous file is shared with other tests).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

import plait  # noqa: E402
from helpers import make_spec, token_parquet  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.subprocess, pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def sandbox():
    """A temp dir (short: Ray's socket paths live there) and the environment of every process of the module:
    token auth by Ray's default (RAY_AUTH_MODE unset: on for a local instance, as users run it), the
    session's token in RAY_AUTH_TOKEN (the session's cluster takes it too), Ray's and plait's temp files
    in the temp dir."""
    temp = tempfile.mkdtemp(prefix="plait-rl-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
    env.update(RAY_TMPDIR=temp, TMPDIR=temp, OMP_NUM_THREADS="1")  # RAY_AUTH_TOKEN: the session's (conftest)
    yield {"temp": temp, "env": env}
    shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def head(sandbox, ray_head):
    """The session's `ray start --head` cluster (tests/conftest.py: token authentication, loopback, no
    dashboard, no log monitor), joined by this module's processes with the module's environment."""
    return {"address": ray_head["address"], "env": {**sandbox["env"], "RAY_AUTH_MODE": "token"}}


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    ds = token_parquet(tmp_path_factory.mktemp("launch"), files=2, docs_per_file=40, row_group_size=5, lo=4, hi=40)
    return plait.load_spec(make_spec([ds], seq_len=64, microbatches=2, dp=1))


def ids(spec, steps: int, rank: int = 0, state: dict | None = None) -> list:
    reference = plait.Loader(spec, rank, steps=steps)
    if state is not None:
        reference.load_state_dict(state)
    return [mb.sample_ids.tolist() for mb in reference]


JOINS = """
import json, os, sys
import ray
import plait
spec, address = json.loads(sys.argv[1]), sys.argv[2]
out = {}
for how, options in [("RAY_ADDRESS", {}), ("auto", {"address": "auto"}), ("explicit address", {"address": address})]:
    if how == "explicit address":
        os.environ.pop("RAY_ADDRESS")
    # the Planner builds (constructors="planner"): the join is the subject, not the Constructor (a process fewer)
    with plait.Loader(spec, runtime="ray", loaders=1, steps=3, constructors="planner", **options) as loader:
        batches = [mb.sample_ids.tolist() for mb in loader]
        out[how] = {"batches": batches, "joined": ray.get_runtime_context().gcs_address}
    ray.shutdown()  # a cluster plait joined is left joined by close(): the next way joins anew
print(json.dumps(out), flush=True)
"""


def test_a_trainer_joins_a_ray_start_cluster_by_ray_address_auto_or_address(head, spec):
    """A trainer process with RAY_ADDRESS set (as `ray start`, `ray job submit` and clusters set it) joins
    that cluster without start-only options (`_system_config` made Ray refuse the join), with the
    cluster's token, and reads the local runtime's stream; so do address="auto" and an explicit address."""
    env = {**head["env"], "RAY_ADDRESS": head["address"]}
    proc = subprocess.run([sys.executable, "-c", JOINS, json.dumps(spec.model_dump(mode="json")), head["address"]],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(out) == ["RAY_ADDRESS", "auto", "explicit address"]
    for how, got in out.items():
        # the cluster (Ray names its loopback head by the machine's address), not a local instance of its own
        assert got["joined"].rsplit(":", 1)[1] == head["address"].rsplit(":", 1)[1], how
        assert got["batches"] == ids(spec, 3), how


RANK = """
import json, os, sys, time
import plait
spec, out = json.loads(sys.argv[1]), sys.argv[2]
loader = plait.Loader.from_torchrun(spec, runtime="ray", loaders=1, steps=40, heartbeat_interval=6.0,
                                    planner_standby=os.environ["STANDBY"] == "1")
it = iter(loader)
batches = [next(it).sample_ids.tolist() for _ in range(4)]
if out:
    with open(out, "w") as f:
        json.dump({"job": loader.runtime.job, "batches": batches}, f)
    time.sleep(600)  # killed here (SIGKILL: no close, no exit hook), as a crashed launch
batches += [mb.sample_ids.tolist() for mb in it]
deadline = time.monotonic() + 120
others = lambda: loader.runtime.ask_planner("stats")["clients"] - 1  # noqa: E731
while os.environ["RANK"] == "0" and others() and time.monotonic() < deadline:
    time.sleep(0.2)  # rank 0's Ray instance (without address) must outlive the other rank's reads
print(json.dumps({"job": loader.runtime.job, "batches": batches}), flush=True)
"""


def launch(spec, env: dict, run_id: str, out_dir: Path | None) -> list[subprocess.Popen]:
    """Two ranks as torchrun starts them (RANK, WORLD_SIZE, its run id: one job name); rank 1 first (it
    waits for rank 0's job). With `out_dir`: each rank writes its first batches there and then hangs."""
    world = 2
    two = json.dumps(spec.model_dump(mode="json") | {"topology": {"dp": world}})
    env = {**env, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400",
           "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0"}
    procs = []
    for rank in (1, 0):
        out = str(out_dir / f"rank{rank}.json") if out_dir else ""
        procs.append(subprocess.Popen([sys.executable, "-c", RANK, two, out], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True,
                                      env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
    return procs


# Ray gives a node 30 s to register (not configurable): on an overloaded machine a local instance's start
# fails so. Such a launch, and only such, is started again.
RAY_NODE_TIMEOUT = "The current node timed out during startup"


def launch_and_crash(spec, env: dict, run_id: str, out_dir: Path, tries: int = 3) -> None:
    """Launch, wait until every rank has read its first batches, then SIGKILL each one's process group."""
    for attempt in range(tries):
        for r in (0, 1):
            (out_dir / f"rank{r}.json").unlink(missing_ok=True)
        procs = launch(spec, env, run_id, out_dir)
        deadline = time.monotonic() + 240
        while not all((out_dir / f"rank{r}.json").exists() for r in (0, 1)):
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                said = "\n".join(err[-2500:] for err in kill(procs))
                if RAY_NODE_TIMEOUT in said and attempt + 1 < tries:
                    break
                pytest.fail(f"the first launch failed: {said}", pytrace=False)
            time.sleep(0.2)
        else:
            kill(procs)
            return


def relaunch(spec, env: dict, run_id: str, tries: int = 3) -> dict[int, dict]:
    """Launch to the end; each rank's output."""
    for attempt in range(tries):
        procs = launch(spec, env, run_id, None)
        try:
            said = {rank: proc.communicate(timeout=300) for rank, proc in zip((1, 0), procs)}
        finally:
            kill(procs)
        failed = "\n".join(f"rank {rank}: {said[rank][1][-2500:]}" for rank, proc in zip((1, 0), procs)
                            if proc.returncode != 0)
        if not failed:
            return {rank: json.loads(said[rank][0].strip().splitlines()[-1]) for rank in (0, 1)}
        if RAY_NODE_TIMEOUT not in failed or attempt + 1 == tries:
            pytest.fail(f"the relaunch failed: {failed}", pytrace=False)


def kill(procs: list[subprocess.Popen]) -> list[str]:
    """SIGKILL each rank's process group (its Ray instance's processes too: started in its group); what
    each said on stderr."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return [p.communicate(timeout=30)[1] for p in procs]


@pytest.mark.parametrize("on", ["rank 0's local instance", "cluster"])
def test_a_killed_ray_launch_relaunched_at_once_under_its_name_runs(request, sandbox, spec, tmp_path, on):
    """Token auth on. On rank 0's own instance: rank 1 uses that instance's auth mode (Ray reads it once,
    at import: it failed with "authentication failed"), and the rendezvous file the killed rank 0 left
    (its instance gone with it) is ignored (it sent rank 1 to a dead address). On a cluster: the killed
    launch's job is still alive for two heartbeat intervals; the relaunch's rank 1 does not join it (and
    keep it alive: its rank 0 was refused "a job named ... is running") but waits for its own."""
    # On rank 0's instance the job's standby Planner dies with it (a process fewer per launch, not the subject);
    # on a cluster the crashed launch's job, standby included, must end by itself.
    env = {**sandbox["env"], "STANDBY": "0"}
    run_id = f"crash-{len(on)}"
    if on == "cluster":
        head = request.getfixturevalue("head")
        env = {**head["env"], "RAY_ADDRESS": head["address"], "STANDBY": "1"}
    first = tmp_path / "first"
    first.mkdir()
    launch_and_crash(spec, env, run_id, first)
    if on != "cluster":
        leftover = Path(sandbox["temp"]) / f"plait-ray-torchrun-{run_id}.json"
        assert leftover.exists(), "the killed rank 0 leaves its rendezvous file"
    outs = relaunch(spec, env, run_id)  # at once, under the same name
    assert {o["job"] for o in outs.values()} == {f"torchrun-{run_id}"}
    two = plait.load_spec(spec.model_dump(mode="json") | {"topology": {"dp": 2}})
    for rank in (0, 1):
        assert outs[rank]["batches"] == ids(two, 40, rank)
