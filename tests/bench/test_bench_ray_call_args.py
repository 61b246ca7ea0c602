"""`python -m benchmarks.ray_call_args` at a reduced size, on the session's Ray instance: both forms of a
gather's request reach the actor and are answered alike, and every per-call figure is measured."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("ray")

from benchmarks import ray_call_args  # noqa: E402  (the benchmark under test)
from benchmarks.common import main as bench_main  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_both_forms_carry_the_same_request():
    args = SimpleNamespace(items=40, blocks=3)
    req = ray_call_args.request(args)
    source, keys, block_index, position, offset, length = req
    assert len(keys) == 3 and all(isinstance(k, tuple) and len(k) == 4 for k in keys)
    assert len(source) == len(block_index) == len(position) == len(offset) == len(length) == 40
    assert block_index.max() < 3
    answering = ray_call_args.Answering()
    assert np.array_equal(answering.one(req), answering.six(*req)) and len(answering.one(req)) == 40


def test_both_forms_are_called_and_measured(tmp_path, ray_session):
    out = tmp_path / "call-args.json"
    rc = bench_main(ray_call_args, ["--calls", "60", "--rounds", "2", "--items", "64", "--blocks", "4",
                                    "--callers", "2", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["calls"] == 120 and set(data["per_call"]) == {"six", "one"}
    for form in data["per_call"].values():
        assert form["wall_us_per_call"] > 0 and form["caller_cpu_us_per_call"] > 0
        assert form["actor_cpu_us_per_call"] >= 0
    assert {"wall", "caller_cpu"} <= set(data["ratio_six_over_one"])
