"""The spec fails at load time, naming the field and the reason."""

from __future__ import annotations

import pytest
import yaml

import plait
from plait.errors import SpecError

GOOD = {"name": "web", "path": "/data/web/*.parquet", "tokens_field": "input_ids"}


def problems(data) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as info:
        plait.load_spec(data)
    assert info.value.problems, "a SpecError must list at least one (field, reason)"
    return info.value.problems


def test_valid_spec_loads():
    spec = plait.load_spec({"sources": [GOOD, {**GOOD, "name": "code", "weight": 3}], "seed": 7})
    assert spec.source_names == ["web", "code"]
    assert spec.sources[1].weight == 3


def test_unknown_field_typo_names_the_field():
    [(field, reason)] = problems({"sources": [{**GOOD, "wieght": 2}]})
    assert field == "sources[0](web).wieght"
    assert "not permitted" in reason


def test_unknown_top_level_section():
    [(field, reason)] = problems({"sources": [GOOD], "packnig": {"seq_len": 128}})
    assert field == "packnig" and "not permitted" in reason


def test_missing_field():
    src = dict(GOOD)
    del src["path"]
    [(field, reason)] = problems({"sources": [src]})
    assert field == "sources[0](web).path"
    assert "required" in reason.lower()


def test_missing_sources():
    [(field, reason)] = problems({"seed": 1})
    assert field == "sources" and "required" in reason.lower()


def test_text_and_tokens_field_both_set():
    [(field, reason)] = problems({"sources": [{**GOOD, "text_field": "text"}]})
    assert field == "sources[0](web)"
    assert "text_field" in reason and "tokens_field" in reason


def test_neither_text_nor_tokens_field():
    src = {k: v for k, v in GOOD.items() if k != "tokens_field"}
    [(field, reason)] = problems({"sources": [src]})
    assert field == "sources[0](web)" and "exactly one" in reason


def test_negative_weight():
    [(field, reason)] = problems({"sources": [{**GOOD, "weight": -0.5}]})
    assert field == "sources[0](web).weight"
    assert ">= 0" in reason or "greater than or equal to 0" in reason


def test_negative_schedule_weight():
    data = {"sources": [GOOD], "mixture": {"schedule": [{"step": 0, "weights": {"web": -1}}]}}
    [(field, reason)] = problems(data)
    assert field.startswith("mixture.schedule[0]") and ">= 0" in reason


def test_schedule_names_unknown_source():
    data = {"sources": [GOOD], "mixture": {"schedule": [{"step": 0, "weights": {"web": 1, "cod": 1}}]}}
    [(field, reason)] = problems(data)
    assert field == "mixture"
    assert "schedule[0]" in reason and "'cod'" in reason


def test_schedule_must_start_at_zero_and_increase():
    data = {"sources": [GOOD], "mixture": {"schedule": [{"step": 5, "weights": {"web": 1}}]}}
    [(field, reason)] = problems(data)
    assert field == "mixture.schedule" and "step 0" in reason
    data = {"sources": [GOOD], "mixture": {"schedule": [{"step": 0, "weights": {"web": 1}}, {"step": 0, "weights": {"web": 2}}]}}
    [(field, reason)] = problems(data)
    assert field == "mixture.schedule" and "increasing" in reason


def test_duplicate_source_names():
    [(field, reason)] = problems({"sources": [GOOD, dict(GOOD)]})
    assert field == "sources"
    assert "unique" in reason and "'web'" in reason


def test_all_weights_zero():
    [(_, reason)] = problems({"sources": [{**GOOD, "weight": 0}]})
    assert "positive weight" in reason


def test_several_problems_are_all_listed():
    data = {"sources": [{**GOOD, "wieght": 1, "bos": "x"}], "packing": {"seq_len": 2}}
    fields = {f for f, _ in problems(data)}
    assert fields == {"sources[0](web).wieght", "sources[0](web).bos", "packing.seq_len"}


def test_non_mapping_yaml_file(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    [(field, reason)] = problems(path)
    assert field == "<file>" and "mapping" in reason


def test_non_mapping_object():
    [(field, reason)] = problems([1, 2])
    assert "mapping" in reason


def test_invalid_yaml_and_missing_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("sources: [\n")
    [(field, reason)] = problems(path)
    assert field == "<file>" and "YAML" in reason
    [(field, reason)] = problems(tmp_path / "nope.yaml")
    assert "no such spec file" in reason
    [(field, reason)] = problems(tmp_path)  # a folder
    assert field == "<file>" and "cannot read" in reason
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00garbage")
    [(field, reason)] = problems(tmp_path / "bin.yaml")
    assert field == "<file>"


def test_error_message_lists_origin_field_and_reason(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"sources": [{**GOOD, "wieght": 2}]}))
    with pytest.raises(SpecError) as info:
        plait.load_spec(path)
    text = str(info.value)
    assert str(path) in text and "sources[0](web).wieght" in text and "not permitted" in text


def test_relative_paths_resolve_against_the_spec_file(tmp_path):
    path = tmp_path / "sub" / "spec.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump({"sources": [{"name": "a", "path": "data/*.parquet", "tokens_field": "t"},
                                                {"name": "b", "path": "s3://bucket/x/*.jsonl", "text_field": "t"}]}))
    spec = plait.load_spec(path)
    assert spec.sources[0].path == str(tmp_path / "sub" / "data" / "*.parquet")
    assert spec.sources[1].path == "s3://bucket/x/*.jsonl"


def test_fingerprint_ignores_layout_but_not_data():
    a = plait.load_spec({"sources": [GOOD], "topology": {"dp": 2}})
    assert a.data_fingerprint() == a.with_overrides(topology={"dp": 8}).data_fingerprint()
    assert a.data_fingerprint() != a.with_overrides(seed=1).data_fingerprint()
    assert a.with_overrides(topology={"dp": 8}).topology.dp == 8


def test_bos_eos_must_be_valid_token_ids():
    [(field, reason)] = problems({"sources": [{**GOOD, "bos": -1}]})
    assert field == "sources[0](web).bos" and "greater than or equal to 0" in reason
    [(field, reason)] = problems({"sources": [{**GOOD, "eos": 2**31}]})
    assert field == "sources[0](web).eos"
    assert plait.load_spec({"sources": [{**GOOD, "bos": 0, "eos": 2**31 - 1}]}).sources[0].eos == 2**31 - 1
