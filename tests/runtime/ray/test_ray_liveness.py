"""The Planner's roster of live trainers (plait.runtime.ray.liveness), without Ray: a trainer whose heartbeat
stopped for two intervals is gone, a job whose trainers are all gone is abandoned once, a creator of a live
job's name is told how long to wait, a later torchrun restart does not join the previous run's job."""

from __future__ import annotations

import pickle
import time

import pytest

from plait.runtime.ray.liveness import JobNameTaken, TrainerRoster


def test_a_trainer_whose_heartbeat_stopped_is_gone_after_two_intervals_and_the_job_is_abandoned_once():
    roster = TrainerRoster(0.05)
    assert not roster.abandoned()  # a new job has had no trainer yet: nothing to end
    roster.add("a")
    roster.add("b")
    time.sleep(0.07)
    roster.touch("a")  # a beats, b has stopped (killed)
    time.sleep(0.05)
    roster.touch("a")
    assert not roster.abandoned() and roster.tokens() == ["a"]  # b is gone, a lives
    time.sleep(0.12)  # a stops too
    assert roster.abandoned()
    assert not roster.abandoned()  # once
    with pytest.raises(JobNameTaken, match="ending"):
        roster.add("c")  # an ending job takes nobody


def test_a_job_whose_trainers_all_detached_is_abandoned():
    roster = TrainerRoster(10.0)
    roster.add("a")
    assert roster.remove("a") == 0
    assert roster.abandoned()


def test_a_recreated_planners_unnamed_attach_becomes_the_trainer_that_beats():
    roster = TrainerRoster(10.0)
    roster.add(None)  # plait.runtime.ray.recovery attaches without a token
    roster.touch("a")
    assert roster.count == 1
    assert roster.remove("a") == 0


def test_a_creator_of_a_live_jobs_name_is_told_how_long_to_wait_and_the_error_crosses_processes():
    roster = TrainerRoster(1.0)
    roster.add("a")
    with pytest.raises(JobNameTaken, match=r"a job named 'x' is running \(1 trainer attached") as caught:
        roster.refuse_creator("x", "3 s")
    assert 2.0 < caught.value.wait_s <= 3.0  # two intervals to be gone, one more to end
    copy = pickle.loads(pickle.dumps(caught.value))
    assert isinstance(copy, JobNameTaken) and copy.wait_s == caught.value.wait_s


def test_a_later_torchrun_restart_does_not_join_the_previous_runs_job():
    roster = TrainerRoster(1.0, run=0)
    roster.check_run("x", 0)
    with pytest.raises(JobNameTaken, match="earlier run"):
        roster.check_run("x", 1)
