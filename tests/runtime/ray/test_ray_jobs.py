"""A job's lifecycle on Ray: a live job's name is not reused silently (attach=True joins it); `plait jobs`
lists it and `plait jobs stop` ends it; a job nobody touches for its idle timeout ends by itself; a
trainer process that exits without close() releases its job at exit; a torchrun job leaves no actor.

The session's Ray head (`ray start --head` like a cluster's, its own temp dir, so other processes'
`ray.init()` never find it; tests/conftest.py `ray_head`, shared with test_flight), used by this process
and by the trainer processes it starts.
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

import plait  # noqa: E402
from plait.cli import main  # noqa: E402
from plait.runtime.ray.jobs import find_planner, list_jobs  # noqa: E402
from helpers import free_port, make_spec, token_parquet  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.subprocess, pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent


# Most jobs here run without the Planner's standby (planner_standby=False: one actor process fewer, ~1 s of
# CPU each, CI time). The jobs that `plait jobs stop`, a trainer's death (and its restart under the job's name)
# and a garbage-collected Loader end keep it, so those ends are seen to end it too (every end of a job ends its
# standby first: plait.runtime.ray.planner_jobs), and nothing of the job comes back after; a job's last close
# ends it in test_planner_standby.


def job_actors(job: str) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "plait" and a["name"].startswith(f"{job}/")]


def wait_gone(job: str, timeout: float) -> float:
    """Seconds until no named actor of `job` is left (fails after `timeout`)."""
    t0 = time.monotonic()
    while job_actors(job):
        assert time.monotonic() - t0 < timeout, f"actors of {job} still alive: {job_actors(job)}"
        time.sleep(0.1)
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def head(ray_head):
    """The session's `ray start --head` cluster (tests/conftest.py), joined by this process for the module."""
    assert not ray.is_initialized(), "this module needs no Ray running in the process"
    ray.init(address=ray_head["address"], namespace="plait", log_to_driver=False, configure_logging=False)
    try:
        yield ray_head
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    ds = token_parquet(tmp_path_factory.mktemp("jobs"), files=2, docs_per_file=40, row_group_size=5, lo=4, hi=40)
    return plait.load_spec(make_spec([ds], seq_len=64, microbatches=2, dp=1))


@pytest.mark.parametrize("options, error", [({"attach": True}, "pass job=NAME too"),
                                            ({"job": "x", "job_idle_timeout": 0}, "job_idle_timeout must be"),
                                            ({"job": "x", "job_idle_timeout": "10"}, "job_idle_timeout must be")])
def test_lifecycle_options_are_checked_before_anything_starts(options, error):
    from plait.runtime.ray import RayOptions

    with pytest.raises(plait.PlaitError, match=error):
        RayOptions(**options)
    assert RayOptions(job="x", attach=True, job_idle_timeout=None).job_idle_timeout is None


def test_a_live_job_name_needs_attach_and_plait_jobs_lists_and_stops_it(head, spec, capsys, monkeypatch):
    first = plait.Loader(spec, runtime="ray", job="jobs-a", loaders=1, steps=50, heartbeat_interval=1.0)
    try:
        it = iter(first)
        next(it)
        with pytest.raises(plait.PlaitError, match=r"a job named 'jobs-a' is running \(1 trainer attached, "
                                                   r"started [\d.]+ \w+ ago\); pass attach=True to join it"):
            plait.Loader(spec, runtime="ray", job="jobs-a", loaders=1)
        with pytest.raises(plait.PlaitError, match="no job named 'jobs-x' is running"):
            find_planner("jobs-x", wait=0.5)  # what attach=True does (it waits 30 s) for a job nobody starts
        second = plait.Loader(spec, runtime="ray", job="jobs-a", attach=True)  # joins, nothing new
        assert next(iter(second)).sample_ids.tolist() == next(iter(plait.Loader(spec))).sample_ids.tolist()

        [row] = [r for r in list_jobs() if r["job"] == "jobs-a"]
        assert row["state"] == "running" and row["clients"] == 2 and row["idle_timeout"] == 600
        assert row["actors"] == row["actors_asked"] >= 3  # Planner, loader, Constructor answered
        assert row["rss"] > 100 * 2**20  # a few Python processes with plait imported
        monkeypatch.setenv("COLUMNS", "200")
        assert main(["jobs"]) == 0
        listed = capsys.readouterr().out
        assert "jobs-a" in listed and "MiB" in listed

        assert main(["jobs", "stop", "jobs-a"]) == 0
        assert "stopped job jobs-a" in capsys.readouterr().out
        assert job_actors("jobs-a") == []  # stop waits until every named actor is gone
        assert main(["jobs", "stop", "jobs-a"]) == 2  # no such job: one-line error
        assert "no job named 'jobs-a' is running" in capsys.readouterr().err
        second.close()  # closing after the job ended is harmless
    finally:
        first.close()
    assert job_actors("jobs-a") == []


def test_idle_timeout_ends_a_job_nobody_uses(head, spec):
    loader = plait.Loader(spec, runtime="ray", job="jobs-idle", loaders=1, steps=50, job_idle_timeout=1.5,
                          planner_standby=False)
    try:
        it = iter(loader)
        next(it)
        time.sleep(2.2)  # idle past the timeout, but the trainer's heartbeat says it is alive
        assert job_actors("jobs-idle"), "a job whose trainer is alive must not end"
        next(it)
        loader.runtime.heartbeat.stop()  # as if the trainer process had been killed
        took = wait_gone("jobs-idle", timeout=30)
        assert took > 1.0  # not before the timeout (1.5 s after the last call)
    finally:
        loader.close()  # the job is gone: harmless
    assert job_actors("jobs-idle") == []


EXITS_WITHOUT_CLOSE = """
import json, sys
import plait
spec, address = json.loads(sys.argv[1]), sys.argv[2]
loader = plait.Loader(spec, runtime="ray", job="jobs-exit", address=address, loaders=1, steps=50,
                      planner_standby=False)
print(len(next(iter(loader)).sample_ids), flush=True)
"""  # ...and exits, without close(): the atexit hook closes the runtime, the last client ends the job


def test_a_trainer_that_exits_without_close_releases_its_job(head, spec):
    proc = subprocess.run([sys.executable, "-c", EXITS_WITHOUT_CLOSE, json.dumps(spec.model_dump(mode="json")),
                           head["address"]], capture_output=True, text=True, timeout=120, env=head["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    wait_gone("jobs-exit", timeout=20)  # gone at exit, not after the 600 s idle timeout (slack: a loaded 2-core CI)


@pytest.mark.timeout(200)
def test_torchrun_job_on_ray_leaves_no_actor(head, tmp_path, demo_spec_path):
    """examples/gpt_torchrun.py, 2 processes on the ray runtime: rank 0 creates the job, rank 1 joins
    it (attach=True); when torchrun returns, no actor of the job is left on the cluster."""
    pytest.importorskip("torch")
    torchrun = shutil.which("torchrun", path=str(BIN)) or shutil.which("torchrun")
    assert torchrun, "torchrun not found"
    job = "jobs-torchrun"
    cmd = [torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()),
           "--log-dir", str(tmp_path / "torchrun-logs"),  # not a torchelastic_* dir left in /tmp
           str(ROOT / "examples" / "gpt_torchrun.py"), "--runtime", "ray", "--steps", "5", "--job", job,
           "--address", head["address"], "--data", str(demo_spec_path.parent), "--json", str(tmp_path / "out.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path, env=head["env"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert len(json.loads((tmp_path / "out.json").read_text())["losses"]) == 5
    wait_gone(job, timeout=20)


def test_plait_mix_changes_a_running_jobs_weights(head, spec, capsys):
    loader = plait.Loader(spec, runtime="ray", job="jobs-mix", loaders=1, steps=60, planner_standby=False)
    try:
        next(iter(loader))
        name = spec.sources[0].name
        assert main(["mix", "jobs-mix", "--set", f"{name}=1.0", "--at-step", "40", "--address", head["address"]]) == 0
        assert "from step 40" in capsys.readouterr().out
        assert main(["mix", "jobs-mix", "--show", "--address", head["address"]]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown and shown[-1]["at_step"] == 40 and shown[-1]["weights"] == {name: 1.0}
        assert main(["mix", "jobs-mix", "--set", f"{name}=1.0", "--at-step", "0", "--address", head["address"]]) == 2
        assert "planned" in capsys.readouterr().err  # a step already planned is refused
        assert main(["mix", "jobs-mix", "--set", "oops"]) == 2
    finally:
        loader.close()


DROPS_ITS_LOADER = """
import gc, json, sys, time
import ray
import plait
spec, address = json.loads(sys.argv[1]), sys.argv[2]

def main():  # the Loader lives in a function that returns; nobody calls close()
    loader = plait.Loader(spec, runtime="ray", job="jobs-gc", address=address, loaders=1, steps=50)
    print(len(next(iter(loader)).sample_ids), flush=True)

main()
gc.collect()
deadline = time.monotonic() + 20
while time.monotonic() < deadline and any(a["name"].startswith("jobs-gc/")
                                          for a in ray.util.list_named_actors(all_namespaces=True)):
    time.sleep(0.1)
print("left" if time.monotonic() < deadline else "still there", flush=True)
"""  # ...the garbage-collected Loader's finalizer left the job (it was its last trainer) while the process lives


@pytest.mark.subprocess
def test_a_loader_garbage_collected_in_a_returning_function_leaves_its_job(head, spec):
    proc = subprocess.run([sys.executable, "-c", DROPS_ITS_LOADER, json.dumps(spec.model_dump(mode="json")),
                           head["address"]], capture_output=True, text=True, timeout=180, env=head["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "left", proc.stdout + proc.stderr[-3000:]
    time.sleep(10)  # and 10 s after the process ended, nothing of the job is left
    assert job_actors("jobs-gc") == []


KILLED = """
import json, sys, time
import plait
spec, address, job, beat, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5]
loader = plait.Loader(spec, runtime="ray", job=job, address=address, loaders=1, steps=50, heartbeat_interval=beat)
it = iter(loader)
for _ in range(3):
    next(it)
with open(out, "w") as f:
    json.dump(loader.state_dict(), f)
print("ready", flush=True)
time.sleep(600)  # killed here (SIGKILL: no exit hook, no close)
"""


def start_and_kill(head, spec, tmp_path, job: str, beat: float) -> dict:
    """A trainer process of job `job` reads 3 batches, saves its state, and is SIGKILLed; its saved state."""
    out = tmp_path / f"{job}.json"
    proc = subprocess.Popen([sys.executable, "-c", KILLED, json.dumps(spec.model_dump(mode="json")), head["address"],
                             job, str(beat), str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=head["env"])
    try:
        line = proc.stdout.readline()
        assert line.strip() == "ready", line + proc.stderr.read()[-3000:]
    finally:
        proc.kill()
        proc.wait(timeout=30)
    return json.loads(out.read_text())


@pytest.mark.subprocess
def test_a_killed_trainers_job_ends_within_two_heartbeat_intervals(head, spec, tmp_path):
    beat = 2.0
    start_and_kill(head, spec, tmp_path, "jobs-killed", beat)
    assert job_actors("jobs-killed"), "the job outlives its trainer for a moment"
    took = wait_gone("jobs-killed", timeout=2 * beat + 6)  # +6: the job's actors end; a loaded 2-core CI
    # not the 600 s job_idle_timeout: the heartbeat stopped, the Planner took the trainer for gone
    assert took > 0


@pytest.mark.subprocess
def test_a_restart_under_the_same_name_resumes_from_its_state(head, spec, tmp_path):
    """A crashed trainer's job still holds its name; the restarted trainer (same name, no attach) waits for
    it to end and starts it again from the saved state: the stream continues where the state says."""
    state = start_and_kill(head, spec, tmp_path, "jobs-restart", 1.0)
    assert job_actors("jobs-restart")  # the old job, not yet ended
    restarted = plait.Loader(spec, runtime="ray", job="jobs-restart", loaders=1, steps=50, heartbeat_interval=1.0)
    try:
        restarted.load_state_dict(state)
        got = [mb.sample_ids.tolist() for mb in itertools.islice(restarted, 3)]
        # The old job's loaders were gone before the new Planner started its own: it adopted none of them
        # by name, so none died under it and was replaced (such a replacement once outlived its job).
        replaced = restarted.runtime.ask_planner("recovery_events")
    finally:
        restarted.close()
    reference = plait.Loader(spec, steps=50)
    reference.load_state_dict(state)
    assert got == [mb.sample_ids.tolist() for mb in itertools.islice(reference, 3)]
    assert replaced == []
    wait_gone("jobs-restart", timeout=20)


def test_a_new_job_waits_for_an_ended_job_of_its_name_to_lose_its_last_actors(head):
    """Actors of a job whose Planner is gone (killed asynchronously after its name was freed) hold a new
    job of that name back until they end, so its Planner does not adopt a dying one by name; one that never
    ends is named in the error, with the command that ends it."""
    from plait.errors import PlaitError
    from plait.runtime.ray.jobs import wait_for_leftovers

    @ray.remote(num_cpus=0)
    class Leftover:
        def ping(self) -> int:
            return 1

    actor = Leftover.options(name="jobs-left/loader-0", namespace="plait").remote()
    ray.get(actor.ping.remote())
    with pytest.raises(PlaitError, match=r"jobs-left/loader-0\).*plait jobs stop jobs-left"):
        wait_for_leftovers("jobs-left", timeout=0.5)
    ender = threading.Timer(1.0, ray.kill, args=(actor,))
    ender.start()
    t0 = time.monotonic()
    wait_for_leftovers("jobs-left", timeout=60)
    assert time.monotonic() - t0 >= 0.9 and not job_actors("jobs-left")
    ender.join()


RANK = """
import json, os, sys, time
import plait
spec, address = json.loads(sys.argv[1]), sys.argv[2] or None
loader = plait.Loader.from_torchrun(spec, runtime="ray", address=address, loaders=1, steps=20, planner_standby=False)
batches = [mb.sample_ids.tolist() for mb in loader]
deadline = time.monotonic() + 120
others = lambda: loader.runtime.ask_planner("stats")["clients"] - 1  # noqa: E731
while os.environ["RANK"] == "0" and others() and time.monotonic() < deadline:
    time.sleep(0.2)  # a barrier: rank 0's Ray instance (without address) must outlive the other ranks' reads
print(json.dumps({"job": loader.runtime.job, "batches": batches}), flush=True)
"""  # no job=, no attach=: rank 0 creates the job, the others attach; exits without close()


@pytest.mark.subprocess
def test_from_torchrun_on_ray_creates_the_job_on_rank_0_and_attaches_the_others(head, spec):
    """With address= of a cluster. Without it, rank 0 starts a local Ray instance and the other ranks find it
    (and the job): test_ray_cluster_launch's relaunch runs that path, after a crash."""
    world = 2
    address = head["address"]
    two = plait.load_spec(spec.model_dump(mode="json") | {"topology": {"dp": world}})
    env = {**head["env"], "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "TORCHELASTIC_RUN_ID": f"jobs-tr{len(address)}", "TORCHELASTIC_RESTART_COUNT": "0"}
    procs = []
    for rank in reversed(range(world)):  # rank 1 first: it waits for rank 0's job to appear
        procs.append(subprocess.Popen([sys.executable, "-c", RANK, json.dumps(two.model_dump(mode="json")),
                                       address], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
        time.sleep(1.0)
    outs = {}
    for rank, proc in zip(reversed(range(world)), procs):
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        outs[rank] = json.loads(out.strip().splitlines()[-1])
    job = f"torchrun-jobs-tr{len(address)}"
    assert {o["job"] for o in outs.values()} == {job}  # one job for both ranks
    for rank in range(world):
        expected = [mb.sample_ids.tolist() for mb in plait.Loader(two, rank, steps=20)]
        assert outs[rank]["batches"] == expected
    wait_gone(job, timeout=20)
