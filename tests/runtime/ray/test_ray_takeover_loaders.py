"""A Planner takeover leaves no loader of the job running that the new Planner does not use, and the job's
recoveries reach the trainer's own log.

The sequence once seen leaving two loaders alive and busy after the job's `plait jobs` row said 4/4: a loader
dies, a Constructor has the Planner replace it (`replace_loader`), and the Planner dies before its standby
heard of the replacement (it heard at the next planning call, which waited for that very build): the
successor started the dead loader's name again and the replacement ran on beside it, detached, unknown.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import plait  # noqa: E402
from helpers import make_spec, token_parquet  # noqa: E402
from plait.runtime.local import LocalRuntime  # noqa: E402
from plait.runtime.ray.common import NAMESPACE  # noqa: E402
from plait.runtime.ray.standby_planner import standby_stats  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


def loader_actors(job: str) -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and a["name"].startswith(f"{job}/loader-")}


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    a = token_parquet(tmp_path_factory.mktemp("a"), name="a", files=4, docs_per_file=40, row_group_size=5, lo=4, hi=40)
    b = token_parquet(tmp_path_factory.mktemp("b"), name="b", files=4, docs_per_file=40, row_group_size=5, lo=4, hi=40,
                      seed=1)
    return plait.load_spec(make_spec([a, b], seq_len=64, microbatches=2, dp=1))


def test_a_takeover_after_a_loader_replacement_leaves_no_stray_loader(ray_session, spec, caplog):
    from plait.runtime.ray import RayRuntime

    caplog.set_level(logging.WARNING, logger="plait.recovery")
    job = "takeover-strays"
    rt = RayRuntime(spec, job=job, loaders=2, address=ray_session, heartbeat_interval=3.0)
    plans = []
    try:
        for _ in range(3):
            plans.append(rt.plan())
            rt.build(plans[-1], 0)
        wait_for(lambda: (standby_stats(job) or {}).get("steps_followed", 0) >= 2, 60, "the standby to follow")
        # Loader 0 dies; a Constructor's gather finds it and has the Planner replace it (a fresh loader: no
        # shadows in this spec), then the Planner dies before anything is planned again.
        dead = ray.get_actor(f"{job}/loader-0", namespace=NAMESPACE)
        ray.kill(dead, no_restart=True)
        ray.get(rt.planner.replace_loader.remote(0, dead, 0))
        assert f"{job}/loader-0~1" in loader_actors(job)
        wait_for(lambda: any("loader-0 died" in r.getMessage() for r in caplog.records), 30,
                 "the trainer's log to tell of the replaced loader")  # with its next heartbeat
        # A loader the standby never heard of at all (a dying Planner's last replacement, a retiring layout's).
        @ray.remote(num_cpus=0)
        class Idle:
            def ping(self) -> int:
                return 1

        stray = Idle.options(name=f"{job}/loader-1~7", namespace=NAMESPACE,
                                                     lifetime="detached").remote()
        ray.get(stray.ping.remote())
        ray.kill(rt.planner, no_restart=True)
        for _ in range(4):  # the driver notices, the standby's successor continues the stream
            plans.append(rt.plan())
            rt.build(plans[-1], 0)
        names = loader_actors(job)
        wait_for(lambda: any("ended 1 loader actor" in r.getMessage() for r in caplog.records), 30,
                 "the trainer's log to tell of the stray loader")
        messages = [r.getMessage() for r in caplog.records if r.name == "plait.recovery"]
    finally:
        rt.close()
    # The successor took over the replacement (the standby knew its name) and ended the one it never heard of
    assert names == {f"{job}/loader-0~1", f"{job}/loader-1"}, names
    # The trainer's log tells each recovery, once: the loader replaced, the takeover, the stray ended
    assert sum("SourceLoader takeover-strays/loader-0 died" in m for m in messages) == 1, messages
    assert sum("standby's successor took over" in m for m in messages) == 1, messages
    assert sum(f"{job}/loader-1~7" in m for m in messages) == 1, messages
    local = LocalRuntime(spec)
    try:
        for p in plans:  # and the stream is a run's without failures
            assert np.array_equal(p.items.sample_ids(), local.plan().items.sample_ids())
    finally:
        local.close()
    wait_for(lambda: not loader_actors(job), 30, "the job's loaders to end with it")
