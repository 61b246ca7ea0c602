"""`build_ahead=` is one Loader option for every runtime that builds: checked, and handed to the runtime
under one name (RayOptions once called it `prefetch`, which on a Loader means read_ahead)."""

from __future__ import annotations

import pytest

from helpers import make_spec, token_parquet

import plait
from plait.errors import PlaitError
from plait.runtime.options import build_ahead_option


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    ds = token_parquet(tmp_path_factory.mktemp("options"), files=1, docs_per_file=40, row_group_size=5, lo=4, hi=30)
    return plait.load_spec(make_spec([ds], seq_len=32, microbatches=1, dp=2, steps=3))


def test_build_ahead_reaches_the_local_job_service_and_keeps_the_stream(spec):
    want = [mb.sample_ids.tolist() for mb in plait.Loader(spec, dp_rank=1, read_ahead=0)]
    with plait.Loader(spec, dp_rank=1, read_ahead=0, build_ahead=3) as loader:
        assert loader.runtime.service.cache.ahead == 3
        assert [mb.sample_ids.tolist() for mb in loader] == want


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_a_bad_build_ahead_is_refused_naming_the_value(spec, bad):
    with pytest.raises(PlaitError, match=r"build_ahead= takes a whole number of steps, 0 or more \(got "):
        plait.Loader(spec, dp_rank=0, build_ahead=bad)


def test_each_runtime_gets_build_ahead_under_its_own_name_and_a_thin_client_refuses_it():
    assert build_ahead_option("ray", {"build_ahead": 4, "loaders": 2}) == {"build_ahead": 4, "loaders": 2}
    assert build_ahead_option("node", {"build_ahead": 0}) == {"build_ahead": 0}
    assert build_ahead_option("local", {"build_ahead": None}) == {}
    with pytest.raises(PlaitError, match="plait serve --build-ahead"):
        build_ahead_option("flight", {"build_ahead": 2})
