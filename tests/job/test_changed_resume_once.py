"""A resume under a changed spec on a shared stream (issue 39, item 13): every rank of the job loads the same
checkpoint with allow_spec_change=True, and the change is applied once (PlanWindow.change_once, which the
job service of `plait serve` and node hosts and the Ray Planner share): the second rank's identical request
joins the generation the first started instead of resetting the stream under it. The torchrun test of
the node-shared data plane is tests/runtime/test_torchrun_node_host.py."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("pyarrow.flight")

import plait  # noqa: E402
from plait.job.consumers import Consumers  # noqa: E402
from plait.job.window import PlanWindow  # noqa: E402
from plait.runtime.serve_local import LocalJobServer  # noqa: E402
from plait.state.spec_change import SpecChangeWarning  # noqa: E402
from resume_matrix import changed_weights_case, resume, sample_ids  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_identical_changed_seeks_join_one_generation_and_another_state_starts_a_new_one():
    lock = threading.RLock()
    window = PlanWindow(lambda: None, lambda: 0, Consumers(), lock)
    applied = []

    def apply():
        applied.append(1)
        return window.reset(), [f"change {len(applied)}"]

    state = {"step": 2, "carry": [(0, 1)]}
    lock.acquire()  # the caller's lock, held around the window (reset notifies waiting ranks)
    first = window.change_once(state, apply)
    assert window.change_once({"step": 2, "carry": [[0, 1]]}, apply) == first  # the same state, as JSON sent it
    assert len(applied) == 1
    assert window.change_once({"step": 3}, apply) == (2, ["change 2"])  # another state: a new generation
    window.reset()  # a plain seek moved the stream on: the same request again applies again
    assert window.change_once({"step": 3}, apply) == (4, ["change 3"])


def test_a_successors_window_keeps_the_change_of_the_generation_it_adopts():
    """A successor Planner adopts the dead one's generation with its change_once record (the standby keeps
    it): the same change asked again joins that generation. A record of an older generation is dropped."""
    lock = threading.RLock()
    dead = PlanWindow(lambda: None, lambda: 0, Consumers(), lock)
    lock.acquire()
    state = {"step": 2, "carry": [[0, 1]]}
    first = dead.change_once(state, lambda: (dead.reset(), ["weights"]))
    successor = PlanWindow(lambda: None, lambda: 0, Consumers(), lock)
    successor.adopt(first[0], dead.changed_by)

    def must_not_apply():
        raise AssertionError("the change was applied again")

    assert successor.change_once(state, must_not_apply) == first
    later = PlanWindow(lambda: None, lambda: 0, Consumers(), lock)
    later.adopt(first[0] + 1, dead.changed_by)  # the dead Planner's stream had moved on since the change
    assert later.changed_by is None
    assert later.change_once(state, lambda: (later.reset(), ["weights"])) == (first[0] + 2, ["weights"])


def test_every_thin_client_resuming_under_a_changed_spec_reads_the_single_process_stream(tmp_path):
    """Two thin clients of one `plait serve --runtime local` job (the server runs the changed spec) load the
    checkpoint with allow_spec_change=True, rank 0 reading its first micro-batch before rank 1 has loaded:
    each gets its rank of the single-process stream (before the fix rank 0's next step failed with 'the
    plan stream was reset (generation 2, asked 1)')."""
    spec, saved, reference = changed_weights_case(tmp_path, resume)
    with LocalJobServer(plait.load_spec(spec), "changed") as server:
        loaders = [plait.Loader(spec, r, runtime="flight", job_address=server.address, token=server.token,
                                read_ahead=0) for r in range(2)]
        try:
            streams = []
            with pytest.warns(SpecChangeWarning):
                for loader in loaders:  # rank 0 reads before rank 1 has loaded, as ranks of a job do
                    loader.load_state_dict(saved, allow_spec_change=True)
                    streams.append(iter(loader))
                    streams[-1] = (next(streams[-1]), streams[-1])
            assert loaders[0].resume_report == loaders[1].resume_report != []
            for r, (first, stream) in enumerate(streams):
                got = [first] + [next(stream) for _ in range(3)]
                assert got[0].step == 2 and sample_ids(got) == reference[r]
        finally:
            for loader in loaders:
                loader.close()
