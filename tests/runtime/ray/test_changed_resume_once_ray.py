"""The Ray-attached layout's changed-spec resume (issue 39, item 13): both ranks of one Ray job load the same
step-boundary checkpoint with allow_spec_change=True, rank 0 reading before rank 1 has loaded. The job's
Planner actor applies the change once (job.window.PlanWindow.change_once: the second rank joins the first
one's generation), and each rank reads the single-process stream."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")

import plait  # noqa: E402
from plait.state.spec_change import SpecChangeWarning  # noqa: E402
from resume_matrix import changed_weights_case, sample_ids  # noqa: E402

TAIL = 12  # micro-batches read after the resume: 6 steps, past what a rank asks for ahead (prefetch)


def read(loader, state, stream=None) -> list:
    if stream is None:
        loader.load_state_dict(state, allow_spec_change=True)
        stream = iter(loader)
    return [next(stream) for _ in range(TAIL)]

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]


def warned_read(loader, state) -> list:
    with pytest.warns(SpecChangeWarning):
        return read(loader, state)


def take_over(loader) -> None:
    """Kill the job's Planner once its standby follows the current generation; its successor takes over."""
    from plait.runtime.ray.standby_planner import standby_stats, successor

    job, gen = loader.runtime.job, loader.runtime.ask_planner("base")[0]
    deadline = time.monotonic() + 60
    while (standby_stats(job) or {}).get("gen") != gen:
        assert time.monotonic() < deadline, "the standby did not follow the change"
        time.sleep(0.2)
    dead = loader.runtime.planner
    ray.kill(dead, no_restart=True)
    assert ray.get(ray.remote(num_cpus=0)(successor).remote(job, dead)) is not None


@pytest.mark.parametrize("takeover", [False, True], ids=["same-planner", "after-a-takeover"])
def test_every_ray_rank_resuming_under_a_changed_spec_reads_the_single_process_stream(ray_session, tmp_path,
                                                                                      takeover):
    """after-a-takeover: rank 1 loads the checkpoint after the Planner died and the standby's successor
    took over. The successor has the change's record from the standby, so rank 1 joins rank 0's
    generation. Before, the successor applied the change again: a new generation, and rank 0's next read
    failed with "the plan stream was reset (generation 2, asked 1)"."""
    spec, saved, reference = changed_weights_case(tmp_path, warned_read)
    job = f"changed-once-{takeover}"
    # the standby Planner only where it is the subject (one process fewer)
    first = plait.Loader(spec, 0, read_ahead=0, runtime="ray", job=job, loaders=1, planner_standby=takeover)
    try:
        with pytest.warns(SpecChangeWarning):
            first.load_state_dict(saved, allow_spec_change=True)
        stream0 = iter(first)
        head0 = next(stream0)  # rank 0 reads before rank 1 loads
        gen = first.runtime.ask_planner("base")[0]
        if takeover:
            take_over(first)
        second = plait.Loader(spec, 1, read_ahead=0, runtime="ray", job=job, attach=True)
        try:
            with pytest.warns(SpecChangeWarning):
                second.load_state_dict(saved, allow_spec_change=True)
            assert first.runtime.ask_planner("base")[0] == gen  # joined: no generation of its own
            got0 = [head0] + read(first, saved, stream0)[:TAIL - 1]
            got1 = read(second, saved, iter(second))
            assert first.resume_report == second.resume_report != []
            assert sample_ids(got0) == reference[0] and sample_ids(got1) == reference[1]
        finally:
            second.close()
    finally:
        first.close()
