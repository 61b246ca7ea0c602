"""The command line: invalid specs exit 2 with the field and reason and no stack trace; run/inspect work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from plait import cli
from helpers import make_spec, text_source, token_parquet

PLAIT = str(Path(sys.executable).parent / "plait")
GOOD = {"name": "web", "path": "/data/*.parquet", "tokens_field": "input_ids"}

BAD_SPECS = {
    "typo": ({"sources": [{**GOOD, "wieght": 2}]}, ["sources[0](web).wieght", "Extra inputs are not permitted"]),
    "missing": ({"sources": [{"name": "web", "tokens_field": "t"}]}, ["sources[0](web).path", "Field required"]),
    "both_fields": ({"sources": [{**GOOD, "text_field": "text"}]}, ["sources[0](web)", "exactly one of text_field"]),
    "negative_weight": ({"sources": [{**GOOD, "weight": -1}]}, ["sources[0](web).weight", "greater than or equal to 0"]),
    "unknown_in_schedule": (
        {"sources": [GOOD], "mixture": {"schedule": [{"step": 0, "weights": {"webb": 1}}]}},
        ["mixture", "schedule[0] names unknown sources ['webb']"],
    ),
    "duplicate_names": ({"sources": [GOOD, GOOD]}, ["sources", "source names must be unique", "'web'"]),
    "not_a_mapping": (["just", "a", "list"], ["<file>", "mapping"]),
}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_invalid_spec_exits_2_naming_field_and_reason(case, tmp_path, capsys):
    data, needles = BAD_SPECS[case]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    assert cli.main(["run", str(path), "--steps", "1", "--quiet"]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert "invalid spec" in captured.err and str(path) in captured.err
    for needle in needles:
        assert needle in captured.err, (needle, captured.err)


@pytest.mark.subprocess
def test_invalid_spec_subprocess(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"sources": [{**GOOD, "wieght": 2, "name": "a" * 90}]}))
    proc = subprocess.run([PLAIT, "run", str(path)], capture_output=True, text=True, timeout=120,
                          env={"COLUMNS": "60", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    # the whole field path on one line, however narrow the terminal
    assert f"sources[0]({'a' * 90}).wieght: Extra inputs are not permitted" in proc.stderr


def test_missing_spec_file_and_bad_data(tmp_path, capsys):
    assert cli.main(["run", str(tmp_path / "nope.yaml")]) == 2
    assert "no such spec file" in capsys.readouterr().err
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(make_spec([{**GOOD, "path": str(tmp_path / "*.parquet")}])))
    assert cli.main(["run", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "source 'web'" in err and "matches no files" in err and "Traceback" not in err


def test_bad_arguments_exit_2(tmp_path, capsys):
    ds = token_parquet(tmp_path / "d", files=1, docs_per_file=4, row_group_size=4)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(make_spec([ds])))
    for bad in (["--dp", "0"], ["--dp", "-1"], ["--steps", "0"], ["--steps", "x"]):
        with pytest.raises(SystemExit) as info:  # argparse: usage error, exit 2
            cli.main(["run", str(path), "--quiet", *bad])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {bad[0]}" in err and "Traceback" not in err
    assert cli.main(["run", str(path), "--quiet", "--dp", "3", "--steps", "1", "--json", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["dp"] == 3


@pytest.fixture
def spec_path(tmp_path):
    a = token_parquet(tmp_path / "a", name="a", files=2, docs_per_file=10, row_group_size=4, lo=5, hi=200)
    b = text_source(tmp_path / "b", fmt="jsonl.gz", name="b", files=2, docs_per_file=10, eos=256)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(make_spec([a, b], seq_len=128, microbatches=2, dp=2)))
    return path


def test_run_summary_json(spec_path, tmp_path, capsys):
    out = tmp_path / "summary.json"
    assert cli.main(["run", str(spec_path), "--steps", "4", "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["steps"] == 4 and s["dp"] == 2 and s["tokens"] > 0
    # Padding is unfilled seq_len capacity: it moves with the data and is 1 - fill, never 0 by construction.
    slots = 4 * 2 * 2 * 128  # steps x dp x micro-batches x seq_len
    assert s["fill"] == pytest.approx(s["tokens"] / slots)
    assert s["padding_fraction"] == pytest.approx(1 - s["fill"]) and 0 < s["padding_fraction"] < 1
    assert s["errors"] == {"a": 0, "b": 0}
    assert set(s["digests"]) == {"0", "1"}
    assert set(s["mixture"]) == {"a", "b"}
    printed = capsys.readouterr().out
    assert "run summary" in printed and "mixture" in printed


def test_save_state_and_resume_continue_the_stream(spec_path, tmp_path):
    full, part, rest = tmp_path / "full.json", tmp_path / "part.json", tmp_path / "rest.json"
    assert cli.main(["run", str(spec_path), "--steps", "5", "--quiet", "--save-state", str(full)]) == 0
    assert cli.main(["run", str(spec_path), "--steps", "2", "--quiet", "--save-state", str(part)]) == 0
    assert cli.main(["run", str(spec_path), "--steps", "3", "--quiet", "--resume", str(part),
                     "--save-state", str(rest)]) == 0
    assert json.loads(full.read_text()) == json.loads(rest.read_text())


def test_inspect(spec_path, capsys):
    assert cli.main(["inspect", str(spec_path), "--docs", "2"]) == 0
    out = capsys.readouterr().out
    assert "sources of" in out and "first documents" in out
    assert "parquet" in out and "jsonl" in out


def test_resume_from_a_trainer_checkpoint(spec_path, tmp_path):
    """`plait run --resume` accepts a Loader.state_dict() taken at a step boundary, refuses a mid-step one."""
    import plait

    full = tmp_path / "full.json"
    assert cli.main(["run", str(spec_path), "--steps", "5", "--quiet", "--save-state", str(full)]) == 0
    loader = plait.Loader(str(spec_path), dp_rank=0, steps=5, read_ahead=0)
    it = iter(loader)
    for _ in range(2 * 2):  # two whole steps of 2 micro-batches
        next(it)
    boundary = tmp_path / "boundary.json"
    boundary.write_text(json.dumps(loader.state_dict()))
    next(it)
    middle = tmp_path / "middle.json"
    middle.write_text(json.dumps(loader.state_dict()))
    it.close()
    rest = tmp_path / "rest.json"
    assert cli.main(["run", str(spec_path), "--steps", "3", "--quiet", "--resume", str(boundary),
                     "--save-state", str(rest)]) == 0
    assert json.loads(rest.read_text()) == json.loads(full.read_text())
    assert cli.main(["run", str(spec_path), "--steps", "3", "--quiet", "--resume", str(middle)]) == 2
