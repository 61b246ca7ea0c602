"""The ray runtime's row of the resume matrix (tests/state/test_resume_changes.py): its step-boundary state
carries the state after the step (`next`) and resumes under every allowed spec change, on the same DP
size or another, as the local runtime does. One small local Ray instance for the module."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

import plait  # noqa: E402
from resume_matrix import (CHANGES, DPS, boundary_state, check_tail, local_tail, make_data, resume,  # noqa: E402
                           spec_after, spec_before)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ray_instance(ray_session):
    """The session's Ray instance (tests/conftest.py)."""
    yield ray_session


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("resume-changes-ray"))


@pytest.fixture(scope="module")
def saved(data, ray_instance):
    with plait.Loader(spec_before(data), 0, read_ahead=0, runtime="ray", job="resume-before", loaders=1,
                      planner_standby=False) as loader:  # no standby Planner: not the subject, a process fewer
        return boundary_state(loader)


# Each change once, each layout at least once: a ray job takes ~30 s to start on a loaded 2-core machine
# (the whole matrix runs on the other runtimes in tests/state/test_resume_changes.py).
@pytest.mark.parametrize("change, dp", [(CHANGES[0], DPS[1]), (CHANGES[1], DPS[0]), (CHANGES[2], DPS[1])])
def test_ray_boundary_state_resumes_under_a_spec_change(data, saved, change, dp):
    with plait.Loader(spec_before(data), 0, read_ahead=0, share="process") as loader:
        local = boundary_state(loader)
    assert saved["data"] == local["data"] and saved["next"] == local["next"]
    spec_b = spec_after(data, change, dp)
    with plait.Loader(spec_b, 0, read_ahead=0, runtime="ray", job=f"resume-{change}-{dp}", loaders=1,
                      planner_standby=False) as loader:
        tail = resume(loader, saved)
    check_tail(tail, local_tail(spec_b, saved), change)
