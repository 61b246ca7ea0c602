"""The plan window of a shared stream (plait.job): a reader far ahead waits for the slowest live one
(backpressure) instead of the slow one failing; gone readers (left, dead process) stop holding it; the
window stays within its size."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

from helpers import batch_digest, make_spec, token_parquet

import plait
from plait.job.consumers import Ask, Consumers, RankProgress
from plait.job.service import JobService
from plait.runtime.local import LocalRoles


def small_spec(tmp_path, steps: int = 16):
    ds = token_parquet(tmp_path / "data", files=2, docs_per_file=60, row_group_size=10, lo=4, hi=30)
    return plait.load_spec(make_spec([ds], seq_len=32, microbatches=1, dp=2, steps=steps))


def test_fast_reader_waits_for_the_slow_one_and_goes_on_when_it_leaves(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PLAIT_LAG_REPORT_S", "0.2")
    spec = small_spec(tmp_path)
    expected = {r: batch_digest(plait.Loader(spec, dp_rank=r, read_ahead=0, share="process")) for r in range(2)}
    svc = JobService(LocalRoles(spec), build_ahead=1, window=4)
    got: dict[int, list] = {0: [], 1: []}
    try:
        got[1] += svc.get(0, 0, 1, limit=16, client="slow")[1]
        for s in range(4):  # within the window of the slow reader's step 0
            got[0] += svc.get(0, s, 0, limit=16, client="fast")[1]
        ahead = threading.Thread(target=lambda: got[0].extend(svc.get(0, 4, 0, limit=16, client="fast")[1]))
        with caplog.at_level(logging.WARNING, logger="plait.serving"):
            ahead.start()
            ahead.join(1.0)
            assert ahead.is_alive() and svc.window.waits == 1  # step 4 is 4 ahead of step 0: it waits
            assert "waits for DP rank 1" in caplog.text  # the lagging reader is named
        got[1] += svc.get(0, 1, 1, limit=16, client="slow")[1]  # the slow reader moves on: the fast one goes
        ahead.join(30)
        assert not ahead.is_alive()
        for s in range(2, 8):
            got[1] += svc.get(0, s, 1, limit=16, client="slow")[1]
        svc.leave("slow")  # gone: it holds nothing back any more
        for s in range(5, 16):
            got[0] += svc.get(0, s, 0, limit=16, client="fast")[1]
        assert svc.window.longest <= 4 and len(svc.window.steps) <= 4
        assert svc.window.waits == 1
    finally:
        svc.close()
    assert batch_digest(got[0]) == expected[0]  # the single-process stream, bit for bit
    assert batch_digest(got[1]) == batch_digest(list(plait.Loader(spec, dp_rank=1, read_ahead=0, share="process"))[:8])
    assert expected[1]


def test_a_reader_whose_process_died_holds_nothing_back():
    consumers = Consumers()
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    consumers.join("gone", proc.pid)
    consumers.asked(Ask("gone", 1, 0, 1), 0, 3)
    consumers.join("here", 1)  # pid 1 runs
    consumers.asked(Ask("here", 0, 0, 0), 0, 9)
    assert consumers.slowest(0, 0) == (9, "DP rank 0, pid 1")
    consumers.asked(Ask("here", 0, 0, 0, limit=16), 0, 15)  # its last step: done
    assert consumers.slowest(0, 0) == (None, "")


def test_missing_processes_of_a_node_hold_the_stream_at_its_start():
    consumers = Consumers(expected=2, grace_s=60)
    consumers.join("a", 1)
    consumers.asked(Ask("a", 0, 0, 0), 0, 30)
    low, who = consumers.slowest(0, 0)
    assert low == 0 and "not joined yet" in who


def test_rank_progress_is_the_ray_planners_view_of_the_slowest_rank():
    progress = RankProgress()
    assert progress.slowest(0) == (None, "")
    progress.built(0, 5, 0)
    progress.built(0, 2, 1)
    progress.built(0, 1, 1)  # an older step built late (a CP peer's rebuild): progress does not go back
    progress.built(1, 9, 2)  # another generation
    assert progress.slowest(0) == (2, "DP rank 1")
    assert RankProgress(silent_s=-1).slowest(0) == (None, "")  # silent ranks are taken for gone


def test_with_builds_as_who_is_slowest_a_rank_ahead_waits_until_the_slow_rank_builds(tmp_path):
    """The Ray Planner's rule, run in process: the plan stream with RankProgress, the Constructor's build
    half asking it through PlannerPlans (plait.runtime.ray.constructor_actor). No polling on the build side:
    one `admit` per step, answered when the slow rank's builds move the window."""
    from plait.job.plan_stream import PlanStream
    from plait.job.rank_builds import RankBuilds
    from plait.runtime.ray.constructor_actor import PlannerPlans

    class Route:  # the routing a build order brings: none in process
        version = 0

        def update(self, routing) -> None:
            pass

    class Orders:  # the Planner actor's build_order, over the plan stream
        def __init__(self, stream):
            self.stream = stream

        def __call__(self, method, *args):
            if method == "build_order":
                gen, step, rank, _, with_state = args
                plan = self.stream.plan(gen, step)
                return plan.for_rank(rank), plan.state_before if with_state else None, None
            return getattr(self.stream, {"mark_built": "built"}.get(method, method))(*args)

    spec = small_spec(tmp_path)
    roles = LocalRoles(spec)
    stream = PlanStream(roles, RankProgress(), size=4)
    call = Orders(stream)
    builds = RankBuilds(PlannerPlans(call, call, Route()), lambda plan, key: roles.constructor.build(plan),
                        builds=2, dynamic=False, ahead=0, threads=2)
    got: dict[int, list] = {0: [], 1: []}
    try:
        got[1] += builds.get(0, 0, 1)[1]
        for s in range(4):
            got[0] += builds.get(0, s, 0)[1]
        ahead = threading.Thread(target=lambda: got[0].extend(builds.get(0, 4, 0)[1]))
        ahead.start()
        ahead.join(1.0)
        assert ahead.is_alive() and stream.window.waits == 1  # step 4 is 4 ahead of rank 1's step 0
        got[1] += builds.get(0, 1, 1)[1]  # rank 1 builds step 1: the window moves, rank 0 goes on
        ahead.join(30)
        assert not ahead.is_alive()
    finally:
        builds.close()
        roles.close()
    want = {r: list(plait.Loader(spec, dp_rank=r, read_ahead=0, share="process")) for r in range(2)}
    assert batch_digest(got[0]) == batch_digest(want[0][:5]) and batch_digest(got[1]) == batch_digest(want[1][:2])
