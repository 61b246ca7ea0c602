"""States handed back by users are validated: a garbage or tampered state is refused with one sentence
(PlaitError, no traceback from the CLI); a good state says where it is (step boundary, tokens seen)."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

import plait
from plait import cli
from plait.client import LayoutChangeWarning
from plait.errors import PlaitError
from plait.state.schema import seal
from helpers import make_spec, token_parquet


@pytest.fixture
def spec(tmp_path):
    ds = token_parquet(tmp_path / "a", files=2, docs_per_file=30, row_group_size=6, lo=4, hi=40)
    return make_spec([ds], seq_len=64, microbatches=2, dp=2)


def saved_state(spec, consumed: int) -> dict:
    loader = plait.Loader(spec, 0, steps=10, read_ahead=0)
    it = iter(loader)
    for _ in range(consumed):
        next(it)
    it.close()
    return json.loads(json.dumps(loader.state_dict()))


@pytest.mark.parametrize("mutate, message", [
    (lambda s: s.__setitem__("data", "garbage"), "not a valid plait Loader state \\(data: "),
    (lambda s: s.pop("next_microbatch"), "next_microbatch: Field required"),
    (lambda s: s.__setitem__("next_microbatch", 99), "next_microbatch 99 is beyond"),
    (lambda s: s["data"]["sources"]["tok"].__setitem__("cursor", [0, 0, 0, -5]), "negative"),
    (lambda s: s["data"]["sources"]["tok"].__setitem__("cursor", [0, 50, 0, 0]), "outside the source"),
    (lambda s: s["data"]["sources"]["tok"].__setitem__("cursor", [0, 0, 0, 10**9]), "does not hold"),
    (lambda s: s["data"]["sources"].clear(), "no cursor for source"),
    (lambda s: s["data"]["carry"].append([7] * 3), "carried chunk \\d+ of the data state is malformed"),
    (lambda s: s["data"].__setitem__("step", -1), "step"),
])
def test_tampered_states_are_refused_with_a_reason(spec, mutate, message):
    """Resealed (a new checksum), so the range checks behind the checksum are the ones that refuse."""
    state = saved_state(spec, 3)
    mutate(state)
    state = seal(state)
    loader = plait.Loader(spec, 0, steps=10)
    with pytest.raises(PlaitError, match=message):
        loader.load_state_dict(state)


def test_a_state_is_identical_on_all_ranks_at_a_step_boundary(spec):
    states = []
    for rank in range(2):
        loader = plait.Loader(spec, rank, steps=10, read_ahead=0)
        it = iter(loader)
        for _ in range(4):  # two whole steps of two micro-batches
            next(it)
        it.close()
        states.append(loader.state_dict())
    assert states[0] == states[1]
    assert states[0]["at_step_boundary"] is True
    mid = saved_state(spec, 3)
    assert mid["at_step_boundary"] is False


def test_tokens_and_samples_seen_count_the_whole_job(spec):
    seen_tokens = seen_samples = 0
    loader = plait.Loader(spec, 0, steps=6, read_ahead=0)
    assert loader.state_dict()["tokens_seen"] == 0
    for mb in loader:
        if mb.microbatch + 1 == mb.num_microbatches:
            seen_tokens += mb.stats["tokens"]  # the whole step, all ranks
            seen_samples += mb.stats["samples"]
            state = loader.state_dict()
            assert state["tokens_seen"] == seen_tokens and state["samples_seen"] == seen_samples
    resumed = plait.Loader(spec, 1, steps=8)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert resumed.state_dict()["tokens_seen"] == seen_tokens  # carried through a resume


def test_a_boundary_state_resumed_on_another_layout_says_what_changed(spec):
    state = saved_state(spec, 4)
    other = copy.deepcopy(spec)
    other["packing"]["seq_len"] = 128
    loader = plait.Loader(other, 0, steps=10)
    with pytest.warns(LayoutChangeWarning, match="seq_len 64 -> 128"):
        loader.load_state_dict(state)


@pytest.mark.parametrize("content", ["not json at all", "[1, 2, 3]", '{"data": {"step": "x"}}',
                                     '{"version": 1, "data": {}, "next_microbatch": 99}'])
def test_cli_resume_with_a_bad_file_is_one_sentence_not_a_traceback(spec, tmp_path, capsys, content):
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    bad = tmp_path / "state.json"
    bad.write_text(content)
    assert cli.main(["run", str(spec_path), "--steps", "2", "--quiet", "--resume", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err
