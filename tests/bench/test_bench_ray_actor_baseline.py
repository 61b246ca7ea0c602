"""`python -m benchmarks.ray_actor_baseline` at a reduced size, on the session's Ray instance: both bare
actors are called at about the asked rate and forward every call to the leaf, and the RSS of all three is
sampled and fitted (the soak's Ray baseline)."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("ray")

from benchmarks import ray_actor_baseline  # noqa: E402  (the benchmark under test)
from benchmarks.common import main as bench_main  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_bare_actors_are_called_and_their_rss_fitted(tmp_path, ray_session):
    out = tmp_path / "baseline.json"
    rc = bench_main(ray_actor_baseline, ["--minutes", "0.08", "--warmup-s", "1.5", "--interval-s", "0.3",
                                         "--rate", "20", "--callers", "2", "--reply-kib", "4", "--forward", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    forwarding, leaf = data["actors"][:2], data["actors"][2]
    assert [(a["actor"], a["max_concurrency"]) for a in data["actors"]] == [("forwarding", 64), ("forwarding", 1),
                                                                            ("leaf", 4)]
    assert leaf["calls_per_s"] == pytest.approx(sum(a["calls_per_s"] for a in forwarding), abs=0.2)
    for actor in data["actors"]:
        assert 10 <= actor["calls_per_s"] / (2 if actor is leaf else 1) <= 22  # paced at 20 a second each
        assert actor["rss_start_mib"] > 20 and len(actor["rss_mib"]) == len(data["sample_t"]) >= 10
        assert math.isfinite(actor["slope_mib_per_hour"]) and math.isfinite(actor["band_slope_mib_per_hour"])


def test_a_warmup_longer_than_the_run_is_refused(capsys):
    assert bench_main(ray_actor_baseline, ["--minutes", "0.05", "--warmup-s", "10"]) == 2
    assert "--warmup-s 10" in capsys.readouterr().err
