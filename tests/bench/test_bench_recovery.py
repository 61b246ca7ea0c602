"""`python -m benchmarks.recovery`'s in-process simulation (a SourceLoader per source, shadows, deaths at
seeded steps): repeated deaths lose and repeat nothing, with and without shadows, and sparse deltas stay
exact. The benchmark is the subject here; the corpus comes from the tests' own fixtures."""

from __future__ import annotations

import pytest

from benchmarks.recovery import simulate  # the benchmark under test
from fixtures import mixed_spec


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return mixed_spec(tmp_path_factory.mktemp("shadow"), dp=4)


@pytest.mark.parametrize("shadows", [1, 0])
def test_repeated_loader_deaths_lose_and_repeat_nothing(spec, shadows, caplog):
    caplog.set_level("WARNING", logger="plait.recovery")
    out = simulate(spec, steps=24, failures=4, shadows=shadows, interval=1, seed=5)
    assert out["failures"] == 4
    assert (out["lost"], out["duplicated"], out["same_order"]) == (0, 0, True)
    assert out["delta_bytes_max"] < 4096
    failures = [r for r in caplog.records if r.getMessage().startswith("failure:")]
    recoveries = [r for r in caplog.records if r.getMessage().startswith("recovery:")]
    assert len(failures) == len(recoveries) == 4
    if shadows:
        assert all(ev["how"].startswith("shadow promoted") for ev in out["events"])
        assert all(ev["reread_blocks"] == 0 for ev in out["events"])
    else:
        assert all(ev["how"].startswith("cold restart") for ev in out["events"])


def test_sparse_deltas_stay_exact(spec):
    """With a delta every 4 steps the shadow lags; what it missed is read again, nothing else changes."""
    sparse = simulate(spec, steps=12, failures=2, shadows=1, interval=4, seed=1)
    assert (sparse["lost"], sparse["duplicated"], sparse["same_order"]) == (0, 0, True)
