"""Hand-edited states are refused, never hang and never silently change the data (issue 22, item 5): a
Loader state carries a checksum of its content (verified on load) and every data state's deficits are
range-checked; a JSON round trip (tuples become lists) keeps a state valid. Also: `plait run
--save-state` files are Loader states (item 9)."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

import plait
from plait import cli
from plait.errors import PlaitError
from plait.state.schema import canonical_checksum, seal
from helpers import make_spec, token_parquet

pytestmark = pytest.mark.timeout(30)  # an edited deficit once hung the Planner: none of these may


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    root = tmp_path_factory.mktemp("state-checks")
    a = token_parquet(root / "a", files=2, docs_per_file=30, row_group_size=6, lo=4, hi=40, name="a")
    b = token_parquet(root / "b", files=2, docs_per_file=30, row_group_size=6, lo=4, hi=40, seed=1, name="b")
    return make_spec([a, b], seq_len=64, microbatches=2, dp=2)


@pytest.fixture(scope="module")
def saved(spec) -> dict:
    """Rank 0's state after three whole steps (a step boundary), as a file holds it."""
    with plait.Loader(spec, 0, steps=10, read_ahead=0) as loader:
        it = iter(loader)
        for _ in range(6):
            next(it)
        it.close()
        return json.loads(json.dumps(loader.state_dict()))


def refused(spec, state, match: str) -> None:
    with plait.Loader(spec, 0, steps=10) as loader, pytest.raises(PlaitError, match=match):
        loader.load_state_dict(state)


def set_deficit(state, value):
    state["data"]["sources"]["a"]["deficit"] = value


CHECKSUM = "checksum does not match its content: the state was edited or corrupted"
EDITS = {  # edit -> the sentence that refuses it (a range check naming the field comes before the checksum)
    "deficit 1e8": (lambda s: set_deficit(s, 1e8), r"sources\.a\.deficit is 1e\+08"),
    "deficit 1e6": (lambda s: set_deficit(s, 1e6), r"sources\.a\.deficit is 1e\+06"),
    "step moved": (lambda s: s["data"].__setitem__("step", s["data"]["step"] + 1), "does not follow data.step"),
    "step and next moved": (lambda s: (s["data"].__setitem__("step", 5), s["next"].__setitem__("step", 6)), CHECKSUM),
    "cursor moved back": (lambda s: s["data"]["sources"]["b"]["cursor"].__setitem__(3, 0), CHECKSUM),
    "tokens_seen changed": (lambda s: s.__setitem__("tokens_seen", s["tokens_seen"] + 1), CHECKSUM),
    "tokens_seen -1": (lambda s: s.__setitem__("tokens_seen", -1), "tokens_seen: Input should be greater than or"),
}


@pytest.mark.parametrize("edit", EDITS)
def test_an_edited_state_is_refused(spec, saved, edit):
    state = copy.deepcopy(saved)
    mutate, message = EDITS[edit]
    before = json.dumps(state)
    mutate(state)
    assert json.dumps(state) != before
    refused(spec, state, message)


@pytest.mark.parametrize("value", [1e8, 1e6, -1e6])
def test_a_deficit_out_of_range_is_refused_by_name_even_with_a_valid_checksum(spec, saved, value):
    state = copy.deepcopy(saved)
    set_deficit(state, value)
    refused(spec, seal(state), r"sources\.a\.deficit is .* outside the range a Planner leaves it")


def test_a_moved_step_is_refused_when_it_no_longer_meets_its_next_state(spec, saved):
    state = copy.deepcopy(saved)
    state["data"]["step"] += 1
    refused(spec, seal(state), "next.step 3 does not follow data.step 3")


def test_a_state_without_its_checksum_is_refused_and_a_version_1_state_is_range_checked(spec, saved):
    state = {k: v for k, v in copy.deepcopy(saved).items() if k != "checksum"}
    refused(spec, state, "has no checksum")
    old = {**state, "version": 1}  # written before checksums: accepted, its ranges still checked
    with plait.Loader(spec, 0, steps=10) as loader:
        loader.load_state_dict(old)
    set_deficit(old, 1e8)
    refused(spec, old, r"sources\.a\.deficit")


def test_legitimate_transformations_keep_a_state_valid(spec, saved):
    """A JSON round trip, tuples instead of lists, another key order: the same content, the same checksum."""
    state = copy.deepcopy(saved)
    state["data"]["sources"]["a"]["cursor"] = tuple(state["data"]["sources"]["a"]["cursor"])
    state["data"]["carry"] = [tuple(r) for r in state["data"]["carry"]]
    state = dict(reversed(list(state.items())))
    assert canonical_checksum(state) == saved["checksum"]
    with plait.Loader(spec, 0, steps=10) as loader:
        loader.load_state_dict(state)
        assert next(iter(loader)).step == 3


def write_spec(tmp_path, spec) -> str:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


@pytest.mark.parametrize("sealed", [True, False])
def test_cli_resume_refuses_a_huge_deficit_in_one_sentence(spec, saved, tmp_path, capsys, sealed):
    """`plait run --resume` with a hand-edited deficit: exit 2 and a sentence (it used to spin at 100% CPU),
    from a Loader state (resealed) or a bare data state (no checksum: the range check alone)."""
    state = copy.deepcopy(saved)
    set_deficit(state, 1e8)
    path = tmp_path / "state.json"
    path.write_text(json.dumps(seal(state) if sealed else state["data"]))
    assert cli.main(["run", write_spec(tmp_path, spec), "--steps", "2", "--quiet", "--resume", str(path)]) == 2
    err = capsys.readouterr().err
    assert "sources.a.deficit is 1e+08" in err and "Traceback" not in err


def test_save_state_files_load_into_a_loader_and_resume_the_cli(spec, tmp_path):
    """`plait run --save-state` writes a Loader state: Loader.load_state_dict and --resume both take it,
    and continue where a Loader run of the same steps continues."""
    spec_path = write_spec(tmp_path, spec)
    path = tmp_path / "saved.json"
    assert cli.main(["run", spec_path, "--steps", "3", "--quiet", "--save-state", str(path)]) == 0
    state = json.loads(path.read_text())
    assert state["checksum"] and state["next_microbatch"] == 0 and state["data"]["step"] == 3
    with plait.Loader(spec, 0, steps=5) as loader:
        loader.load_state_dict(state)
        resumed = [mb.sample_ids.tolist() for mb in loader]
    with plait.Loader(spec, 0, steps=5) as loader:
        unbroken = [mb.sample_ids.tolist() for mb in loader][6:]
    assert resumed == unbroken and len(resumed) == 4
    assert cli.main(["run", spec_path, "--steps", "2", "--quiet", "--resume", str(path)]) == 0
    legacy = tmp_path / "legacy.json"  # what --save-state wrote before: {"data": ...}
    legacy.write_text(json.dumps({"data": state["data"]}))
    with plait.Loader(spec, 0, steps=5) as loader:
        loader.load_state_dict(json.loads(legacy.read_text()))
        assert [mb.sample_ids.tolist() for mb in loader] == unbroken
