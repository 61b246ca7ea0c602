"""A step-boundary checkpoint of every runtime resumes under every allowed spec change (issue 22, item 4):
runtime (local in process, node-shared, thin Flight client) x change (weights, source added, source
removed) x layout (the same DP size, another one). The resumed stream is the local runtime's, bit for
bit, from the step after the checkpoint. Ray: tests/runtime/ray/test_resume_changes_ray.py."""

from __future__ import annotations

import pytest

pytest.importorskip("pyarrow.flight")

import plait  # noqa: E402
from plait.runtime.serve_local import LocalJobServer  # noqa: E402
from resume_matrix import (CHANGES, DPS, boundary_state, check_tail, local_tail, make_data, resume,  # noqa: E402
                           spec_after, spec_before)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("resume-changes"))


@pytest.fixture(scope="module")
def saved_local(data):
    with plait.Loader(spec_before(data), 0, read_ahead=0, share="process") as loader:
        return boundary_state(loader)


def node_env(monkeypatch, tmp_path, run: str) -> None:
    """One torchrun process on its node (LOCAL_WORLD_SIZE 1): it hosts the node's job and reads it over Flight."""
    for k, v in {"LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 1, "TORCHELASTIC_RUN_ID": run,
                 "PLAIT_NODE_DIR": tmp_path / "rdzv"}.items():
        monkeypatch.setenv(k, str(v))


def saved_and_resumed(runtime: str, spec_a, spec_b, monkeypatch, tmp_path) -> tuple[dict, list]:
    if runtime == "node":
        node_env(monkeypatch, tmp_path, "before")
        with plait.Loader(spec_a, 0, share="node") as loader:
            assert type(loader.runtime).__name__ == "NodeRuntime"
            state = boundary_state(loader)
        node_env(monkeypatch, tmp_path, "after")
        with plait.Loader(spec_b, 0, share="node") as loader:
            return state, resume(loader, state)
    with LocalJobServer(plait.load_spec(spec_a), "before") as server:
        with plait.Loader(spec_a, 0, runtime="flight", job_address=server.address, token=server.token,
                          job="before") as loader:
            state = boundary_state(loader)
    with LocalJobServer(plait.load_spec(spec_b), "after") as server:
        with plait.Loader(spec_b, 0, runtime="flight", job_address=server.address, token=server.token,
                          job="after") as loader:
            return state, resume(loader, state)


@pytest.mark.parametrize("dp", DPS)
@pytest.mark.parametrize("change", CHANGES)
def test_local_boundary_state_resumes_under_a_spec_change(data, saved_local, change, dp):
    spec_b = spec_after(data, change, dp)
    with plait.Loader(spec_b, 0, read_ahead=0, share="process") as loader:
        tail = resume(loader, saved_local)
    assert tail[0].step == 2 and tail[0].microbatch == 0
    if dp == 2:  # on the saving layout the resumed stream is the change applied to an unbroken run's state
        assert {s for mb in tail for s in mb.source_ids.tolist()} >= ({0, 2} if change == "added" else {0})


@pytest.mark.parametrize("dp", DPS)
@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("runtime", ["node", "flight"])
def test_every_runtimes_boundary_state_resumes_under_a_spec_change(data, saved_local, runtime, change, dp,
                                                                   monkeypatch, tmp_path):
    """The state of a node-shared or thin client is the local runtime's (with its `next`), and resumes
    on that runtime under the change exactly as the local runtime does."""
    spec_a, spec_b = spec_before(data), spec_after(data, change, dp)
    state, tail = saved_and_resumed(runtime, spec_a, spec_b, monkeypatch, tmp_path)
    assert state["data"] == saved_local["data"] and state["next"] == saved_local["next"]
    check_tail(tail, local_tail(spec_b, saved_local), change)


def test_an_old_boundary_state_without_next_says_why_it_cannot_change_spec_and_layout_at_once(data, saved_local):
    """A state written before every runtime wrote `next` (version 1, no checksum): the same-layout spec
    change is refused as before, and the layout-plus-spec change no longer asks for a flag already given."""
    old = {k: v for k, v in saved_local.items() if k not in ("next", "checksum")}
    old["version"] = 1
    with plait.Loader(spec_after(data, "weights", 1), 0, share="process") as loader:
        with pytest.raises(plait.PlaitError, match="holds no data state after its step .* at once"):
            loader.load_state_dict(old, allow_spec_change=True)
    with plait.Loader(spec_after(data, "weights", 2), 0, share="process") as loader:
        with pytest.raises(plait.PlaitError, match="in the middle of a step \\(or, written by an older plait"):
            loader.load_state_dict(old, allow_spec_change=True)
