"""The `context_parallel` and `cost.interconnect` spec sections: validated at load, fixed mode unchanged."""

import pytest

from plait.errors import SpecError
from plait.spec import load_spec

BASE = {"sources": [{"name": "a", "path": "x.parquet", "tokens_field": "t"}], "topology": {"dp": 4, "cp": 2},
        "packing": {"seq_len": 64}}


def test_fixed_mode_keeps_the_spec_and_its_digests():
    plain = load_spec(BASE)
    fixed = load_spec({**BASE, "context_parallel": {"mode": "fixed"}, "cost": {"interconnect": {}}})
    assert fixed.model_dump(mode="json") == plain.model_dump(mode="json")
    assert "context_parallel" not in plain.model_dump(mode="json")
    assert "interconnect" not in plain.model_dump(mode="json")["cost"]
    assert fixed.data_fingerprint() == plain.data_fingerprint()
    assert fixed.mixture_fingerprint() == plain.mixture_fingerprint()


def test_dynamic_defaults_and_round_trip():
    spec = load_spec({**BASE, "context_parallel": {"mode": "dynamic"}})
    assert spec.context_parallel.degree_cap(8) == 8 and spec.context_parallel.degree_cap(12) == 8
    assert load_spec(spec.model_dump(mode="json")) == spec
    assert spec.cost.interconnect.bandwidth_gbps == 450 and spec.cost.interconnect.ranks_per_node == 8


@pytest.mark.parametrize("section, field, reason", [
    ({"context_parallel": {"mode": "dynamic", "max_degree": 3}}, "context_parallel", "not a power of two"),
    ({"context_parallel": {"mode": "dynamic", "max_degree": 16}}, "context_parallel", "larger than the pool"),
    ({"context_parallel": {"mode": "sometimes"}}, "context_parallel.mode", "'fixed' or 'dynamic'"),
    ({"context_parallel": {"mode": "dynamic", "theta": 0}}, "context_parallel.theta", "greater than 0"),
    ({"context_parallel": {"mode": "dynamic"}, "packing": {"seq_len": 66}}, "context_parallel", "multiple of 2 x cp"),
    ({"context_parallel": {"mode": "dynamic"}, "balance": {"mode": "variable"}}, "context_parallel", "equal"),
    ({"cost": {"interconnect": {"latency_us": -1}}}, "cost.interconnect.latency_us", "greater than or equal"),
    ({"cost": {"interconnect": {"bandwidth": 1}}}, "cost.interconnect.bandwidth", "Extra inputs"),
])
def test_bad_sections_name_field_and_reason(section, field, reason):
    with pytest.raises(SpecError) as e:
        load_spec({**BASE, **section})
    text = str(e.value)
    assert f"{field}:" in text and reason in text
