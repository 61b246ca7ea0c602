"""`plait run --resume` and `Loader.load_state_dict` read a saved state with one function
(plait.client.resume_start), so they refuse the same states (issue 39, item 15). A trainer's state at a
step's end carries the data state after that step (`next`); `plait run` used to resume from it without
ever checking the data state itself, and accepted a state naming file 99, document 1e6, a carried chunk
of source 9 or no cursor for a source, each of which the Loader refuses."""

from __future__ import annotations

import copy
import json
import re

import pytest

import plait
from helpers import make_spec, token_parquet
from plait import cli
from plait.state.schema import after_consumed_step, seal

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume-checks")
    a, b = (token_parquet(root / n, name=n, files=2, docs_per_file=40, lo=4, hi=40, seed=i) for i, n in enumerate("ab"))
    spec = make_spec([a, b], seq_len=64, microbatches=2, dp=1)
    path = root / "spec.json"
    path.write_text(json.dumps(spec))
    with plait.Loader(spec, 0, read_ahead=0, share="process") as loader:
        it = iter(loader)
        for _ in range(4):  # two whole steps: the state names step 1, consumed, and carries `next`
            next(it)
        state = json.loads(json.dumps(loader.state_dict()))
    assert state["next"] is not None and state["next_microbatch"] == 2
    return spec, path, state


def edited(state: dict, edit) -> dict:
    """`state` with its data state edited, sealed again (a checksum detects accidents, not edits)."""
    out = copy.deepcopy(state)
    edit(out["data"])
    out.pop("checksum")
    return seal(out)


EDITS = {
    "file 99": (lambda d: d["sources"]["a"]["cursor"].__setitem__(1, 99), "cursor of source 'a' .*outside"),
    "document 1e6": (lambda d: d["sources"]["a"]["cursor"].__setitem__(3, 10**6), "points at document 1000000"),
    "carried chunk of source 9": (lambda d: d["carry"].__setitem__(0, [9, *d["carry"][0][1:]]), "names source 9"),
    "missing source": (lambda d: d["sources"].pop("b"), "no cursor for source"),
}


@pytest.mark.parametrize("what", list(EDITS))
def test_plait_run_resume_refuses_what_the_loader_refuses(setup, tmp_path, what, capsys):
    spec, spec_path, state = setup
    edit, message = EDITS[what]
    bad = edited(state, edit)
    if what == "carried chunk of source 9":
        assert state["data"]["carry"], "the saved state carries no chunk to edit"
    with plait.Loader(spec, 0, share="process") as loader:
        with pytest.raises(plait.PlaitError, match=message):
            loader.load_state_dict(bad)
    path = tmp_path / "state.json"
    path.write_text(json.dumps(bad))
    capsys.readouterr()
    assert cli.main(["run", str(spec_path), "--steps", "2", "--quiet", "--resume", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and re.search(message, err), err


def test_plait_run_resumes_the_unedited_state_where_the_loader_does(setup, tmp_path):
    """The same state, unedited: `plait run --resume` starts at the step after the consumed one, as the
    Loader does (both re-plan the consumed step from the state's data, metadata only)."""
    spec, spec_path, state = setup
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    out = tmp_path / "after.json"
    assert cli.main(["run", str(spec_path), "--steps", "1", "--quiet", "--resume", str(path),
                     "--save-state", str(out)]) == 0
    with plait.Loader(spec, 0, read_ahead=0, share="process") as loader:
        loader.load_state_dict(state)
        it = iter(loader)
        assert next(it).step == 2
        next(it)
        after = after_consumed_step(json.loads(json.dumps(loader.state_dict())), True)
    assert json.loads(out.read_text())["data"] == after["data"]
