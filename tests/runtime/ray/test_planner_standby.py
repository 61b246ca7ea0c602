"""The Planner is not a single point of failure: in a job of four trainer processes (real processes that
attach to one job by name, as under torchrun), the Planner actor is killed mid-run; the job's standby
makes exactly one successor, which continues the same stream. Every rank receives exactly the micro-batches
of a run without failures (sample ids, each exactly once; the stream digest), and the job still ends
when its last trainer closes.

One local Ray instance for the module; the trainer processes join it by address.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import plait  # noqa: E402
from fixtures import compare_streams, mixed_spec as make_spec  # noqa: E402
from plait.metrics import batch_digest_update, combined_digest  # noqa: E402
from plait.runtime.local import LocalRuntime  # noqa: E402
from plait.runtime.ray.common import NAMESPACE, planner_name  # noqa: E402
from plait.runtime.ray.standby_planner import standby_name, standby_stats  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
RANKS = 4
STEPS = 12
PAUSE_AT = 8  # micro-batches each trainer takes before the Planner is killed (of STEPS * 2)

TRAINER = """
import hashlib, json, os, sys, time
import plait
from plait.metrics import batch_digest_update
spec, address, job, rank, steps, pause_at, folder = json.loads(sys.argv[1])
loader = plait.Loader(spec, dp_rank=rank, runtime="ray", address=address, job=job, attach=rank > 0, loaders=2,
                      steps=steps, constructors="replica")
digest, ids = hashlib.sha256(), []
for i, mb in enumerate(loader):
    ids.append(mb.sample_ids.tolist())
    batch_digest_update(digest, mb)
    if i + 1 == pause_at:  # every trainer is mid-run here: the test kills the Planner, then lets them go on
        open(os.path.join(folder, f"paused-{rank}"), "w").close()
        while not os.path.exists(os.path.join(folder, "go")):
            time.sleep(0.02)
events = list(loader.runtime.recovery_log)
loader.close()
with open(os.path.join(folder, f"rank-{rank}.json"), "w") as f:
    json.dump({"ids": ids, "digest": digest.hexdigest(), "events": events}, f)
"""


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return make_spec(tmp_path_factory.mktemp("standby"), dp=RANKS)


def no_failure_run(spec) -> tuple[dict[int, list], str]:
    """Each rank's sample ids and the combined stream digest, from the local runtime (the ray runtime's
    stream is the local one's, bit for bit)."""
    ids, digests = {}, {}
    for rank in range(RANKS):
        digest = hashlib.sha256()
        ids[rank] = []
        for mb in plait.Loader(spec, dp_rank=rank, steps=STEPS):
            ids[rank].append(mb.sample_ids)
            batch_digest_update(digest, mb)
        digests[str(rank)] = digest.hexdigest()
    return ids, combined_digest(digests)


def job_actors(job: str) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and a["name"].startswith(f"{job}/")]


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.subprocess
@pytest.mark.slow
def test_four_trainers_continue_the_same_stream_when_the_planner_dies(ray_session, spec, tmp_path):
    job = "standby-chaos"
    config = [spec.model_dump(mode="json"), ray_session, job, 0, STEPS, PAUSE_AT, str(tmp_path)]
    procs = []
    for rank in range(RANKS):  # rank 0 creates the job; the others attach to it by name
        config[3] = rank
        procs.append(subprocess.Popen([sys.executable, "-c", TRAINER, json.dumps(config)], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
        if rank == 0:
            wait_for(lambda: planner_name(job) in job_actors(job), 60, "the job's Planner")
    try:
        wait_for(lambda: all((tmp_path / f"paused-{r}").exists() or procs[r].poll() is not None
                             for r in range(RANKS)), 120, "every trainer mid-run")
        assert all(p.poll() is None for p in procs), [p.communicate()[0][-3000:] for p in procs if p.poll()]
        first = ray.get_actor(planner_name(job), namespace=NAMESPACE)
        followed = standby_stats(job)
        assert followed["steps_followed"] >= 1 and followed["takeovers"] == []
        ray.kill(first, no_restart=True)
        (tmp_path / "go").touch()  # four trainers and their Constructors find the dead Planner at once
        wait_for(lambda: standby_stats(job)["takeovers"], 60, "a takeover")
        outputs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [0] * RANKS, "\n".join(o[-3000:] for o in outputs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

    results = {r: json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(RANKS)}
    expected, expected_digest = no_failure_run(spec)
    for r in range(RANKS):  # each rank: the very micro-batches of a run without failure, in order
        got = [np.array(ids, dtype=np.int64).reshape(-1, 5) for ids in results[r]["ids"]]
        assert compare_streams(expected[r], got)["same_order"], f"rank {r}"
    union = [np.array(ids, dtype=np.int64).reshape(-1, 5) for r in range(RANKS) for ids in results[r]["ids"]]
    reference = [ids for r in range(RANKS) for ids in expected[r]]
    assert compare_streams(reference, union) == {"delivered": sum(map(len, reference)), "lost": 0,
                                                 "duplicated": 0, "same_order": True}
    assert combined_digest({str(r): results[r]["digest"] for r in range(RANKS)}) == expected_digest
    # The trainers' processes never restarted the stream: whoever noticed got the standby's successor.
    assert all(e.get("how") == "standby" for r in range(RANKS) for e in results[r]["events"])

    # The job ended when its last trainer closed (the successor knew the four attached trainers), the
    # standby with it.
    wait_for(lambda: not job_actors(job), 30, "the job's actors to end")


def test_exactly_one_successor_however_many_notice(ray_session, spec):
    """A dead standby is replaced by its Planner; then many callers report the same dead Planner at
    once: one takeover, one new Planner for all; the standby then follows the successor (the job has a
    standby again), whose stream is unchanged, run-time weights set before the death included."""
    from plait.runtime.ray import RayRuntime
    from plait.runtime.ray.standby_planner import successor

    job = "standby-many"
    rt = RayRuntime(spec, job=job, loaders=1, address=ray_session)  # one loader: the layout is not the subject
    try:
        plans = [rt.plan() for _ in range(2)]
        # The standby is a process of its own: it follows once started (before, a trainer recreates the
        # Planner itself).
        wait_for(lambda: (standby_stats(job) or {}).get("steps_followed", 0) >= 2, 60, "the standby to follow")
        first_standby = ray.get_actor(standby_name(job), namespace=NAMESPACE)
        ray.kill(first_standby, no_restart=True)
        plans += [rt.plan() for _ in range(2)]  # the Planner notices from its follow calls, starts another

        def new_standby_follows() -> bool:
            try:
                standby = ray.get_actor(standby_name(job), namespace=NAMESPACE)
            except ValueError:
                return False
            return standby != first_standby and ray.get(standby.standby_stats.remote())["logged_steps"] > 0

        wait_for(new_standby_follows, 60, "a new standby")
        # A change planning cannot reproduce, for a step not planned yet: the successor must know it.
        at = ray.get(rt.planner.stats.remote())["step"] + 1
        rt.set_weights({"long": 0.7}, at)
        dead = rt.planner
        ray.kill(dead, no_restart=True)
        # Six callers at once: threads of this process and a task in another (each Ray process costs ~1 s of
        # CPU to start; the standby, a one-threaded actor, sees six queued take_over calls either way).
        other_process = ray.remote(num_cpus=0)(successor).remote(job, dead)
        with ThreadPoolExecutor(5) as pool:
            answers = list(pool.map(lambda _: successor(job, dead), range(5))) + [ray.get(other_process)]
        assert all(a is not None for a in answers)
        new = {a[0] for a in answers}
        assert len(new) == 1 and dead not in new
        assert ray.get_actor(planner_name(job), namespace=NAMESPACE) in new  # found by the job's name
        stats = standby_stats(job)
        assert len(stats["takeovers"]) == 1 and stats["takeovers"][0]["step"] > plans[-1].step  # knew it all
        assert len([n for n in job_actors(job) if n in (planner_name(job), standby_name(job))]) == 2
        more = [rt.plan() for _ in range(at + 2 - len(plans))]  # the driver's requests reach the successor
        wait_for(lambda: standby_stats(job)["steps_followed"] > stats["steps_followed"], 30,
                 "the standby to follow the successor")
    finally:
        rt.close()
    assert [p.step for p in plans + more] == list(range(at + 2))
    local = LocalRuntime(spec)
    local.set_weights({"long": 0.7}, at)
    try:
        for p in plans + more:  # the successor's plans are the ones a run without failure makes
            q = local.plan()
            assert np.array_equal(p.items.sample_ids(), q.items.sample_ids())
            assert np.array_equal(p.rank, q.rank) and np.array_equal(p.micro, q.micro)
            assert np.array_equal(p.weights, q.weights)
        assert q.weights[2] == pytest.approx(0.7)  # the weights changed within the run
    finally:
        local.close()


def test_bench_recovery_planner_measures_a_takeover(ray_session, spec):
    """`python -m benchmarks.recovery --planner`: one takeover, nothing lost or repeated, and the standby receives
    state diffs of well under a few kilobytes per step (never plans)."""
    from benchmarks import planner_takeover  # the benchmark under test

    result = planner_takeover.measure(spec, steps=10, kill_at=5)
    reference, observed = result.pop("streams")
    assert compare_streams(reference, observed) == {"delivered": sum(map(len, reference)), "lost": 0,
                                                    "duplicated": 0, "same_order": True}
    assert result["takeovers"] == 1 and result["takeover_s"] > 0 and result["kill_to_serving_s"] > 0
    assert 0 < result["standby_bytes_per_step"] < 4096


def test_a_successor_plans_each_logged_step_from_the_state_it_was_planned_from(spec):
    """The successor's replay (no Ray): started from an older logged step, it plans the very same steps,
    including those after a run-time change its start state did not have yet; it rewinds to a logged step
    asked again."""
    import threading
    from types import SimpleNamespace

    from plait.job.consumers import Consumers
    from plait.job.window import PlanWindow
    from plait.runtime.ray.standby_planner import Replay

    dead, successor = LocalRuntime(spec), LocalRuntime(spec)
    try:
        states, planned = {}, []
        for _ in range(3):
            planned.append(dead.planner.plan_step())
            states[planned[-1].step] = planned[-1].state_before
        dead.set_weights({"long": 0.7}, 3)  # after step 2 was planned: step 1's state does not know it
        states[3] = dead.planner.state_dict()
        planned += [dead.planner.plan_step() for _ in range(2)]
        replay = Replay({"gen": 0, "states": states, "low": 1, "meta": {}, "window": 64, "at": 0.0})
        assert replay.start == 1
        successor.planner.load_state_dict(states[replay.start])
        # the Ray Planner's window (job.window), filled here by hand: the test plans step by step itself
        window = PlanWindow(successor.planner.plan_step, lambda: successor.planner.step, Consumers(),
                            threading.RLock())
        for want in planned[1:]:
            replay.align(successor.planner)
            got = successor.planner.plan_step()
            window.steps[got.step] = got
            assert np.array_equal(got.items.sample_ids(), want.items.sample_ids())
            assert np.array_equal(got.weights, want.weights)
        assert planned[-1].weights[2] == pytest.approx(0.7)
        actor = SimpleNamespace(planner=successor.planner, window=window)
        assert replay.rewind(actor, 2, states[2]) and successor.planner.step == 2 and list(window.steps) == [1]
        assert not replay.rewind(actor, 1, states[2])  # another state than the logged one: a new stream
        assert not replay.rewind(actor, 7, None)  # never logged
        replay.align(successor.planner)
        assert np.array_equal(successor.planner.plan_step().items.sample_ids(), planned[2].items.sample_ids())
    finally:
        dead.close()
        successor.close()


def test_the_planner_can_build_in_its_own_process(ray_session, spec):
    """The default on a one-node cluster (constructors="auto" -> "planner"): no Constructor actor, the
    Planner's process builds every rank's micro-batches, the stream is unchanged, a trainer that attaches
    is served by it too, and its successor (after a death) builds as well."""
    from plait.runtime.ray import RayRuntime

    job, steps = "planner-builds", 6
    rt = RayRuntime(spec, job=job, loaders=1, address=ray_session)
    assert rt.constructors_mode == "planner" and list(rt.builders()) == ["planner"]
    try:
        ids = []
        for step in range(steps):
            plan = rt.plan()
            for r in range(plan.ranks):
                ids.extend(mb.sample_ids for mb in rt.build(plan, r))
            if step == 2:
                assert not [n for n in job_actors(job) if "/constructor" in n]  # one process fewer
                builds = ray.get(rt.planner.stats.remote())  # the Planner's figures and its Constructor's
                assert builds["requests"] >= 3 * RANKS and builds["planned"] >= 3
                wait_for(lambda: (standby_stats(job) or {}).get("steps_followed", 0) >= 3, 60, "the standby")
                ray.kill(rt.planner, no_restart=True)
        attached = plait.Loader(spec, dp_rank=1, runtime="ray", job=job, attach=True, steps=steps)
        rank1 = [mb.sample_ids for mb in attached]
        attached.close()
        assert len(standby_stats(job)["takeovers"]) == 1
        assert ray.get(rt.planner.stats.remote())["requests"] > 0  # the successor builds too
    finally:
        rt.close()
    expected = {r: [mb.sample_ids for mb in plait.Loader(spec, dp_rank=r, steps=steps)] for r in range(RANKS)}
    in_build_order = [mb for s in range(steps) for r in range(RANKS) for mb in expected[r][2 * s:2 * s + 2]]
    assert compare_streams(in_build_order, ids)["same_order"]
    assert compare_streams(expected[1], rank1)["same_order"]


def test_a_successor_keeps_the_layout_the_job_was_rescaled_to(ray_session, spec):
    """Re-partitioned mid-run (issue 12), then the Planner dies: its successor takes the layout in use (its
    version, the loaders of that version found by name), not the one the job started with, and the stream
    stays the one a run without failure or rescale makes."""
    from plait.runtime.placement import LoaderLayout
    from plait.runtime.ray import RayRuntime
    from plait.runtime.ray.standby_planner import successor

    job = "standby-rescaled"
    rt = RayRuntime(spec, job=job, loaders=1, address=ray_session)
    batches = []
    try:
        def run_step():
            plan = rt.plan()
            batches.append([mb for r in range(plan.ranks) for mb in rt.build(plan, r)])

        for _ in range(2):
            run_step()
        new_layout = LoaderLayout({0: 2, 1: 1, 2: 1}, [[(0, 0), (1, 0)], [(0, 1), (2, 0)]])
        assert rt.rescale(new_layout, "test: split") == 1
        v1_loaders = set(map(str, ray.get(rt.planner.get_loaders.remote())))
        run_step()
        wait_for(lambda: (standby_stats(job) or {}).get("steps_followed", 0) >= 3, 60, "the standby to follow")
        dead = rt.planner
        ray.kill(dead, no_restart=True)
        assert ray.get(ray.remote(num_cpus=0)(successor).remote(job, dead)) is not None
        for _ in range(3):
            run_step()
        stats = rt.stats()
        after = set(map(str, ray.get(rt.planner.get_loaders.remote())))
    finally:
        rt.close()
    assert stats["routing_version"] == 1 and len(after) == 2
    assert after == v1_loaders  # the same loader actors of layout v1 (found by name), no fresh v0 ones
    local = LocalRuntime(spec)
    try:
        for step in batches:
            plan = local.plan()
            want = [mb for r in range(plan.ranks) for mb in local.build(plan, r)]
            assert [mb.sample_ids.tolist() for mb in step] == [mb.sample_ids.tolist() for mb in want]
    finally:
        local.close()
