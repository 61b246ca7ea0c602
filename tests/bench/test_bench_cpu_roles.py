"""benchmarks.e2e_cpu_roles: its command line (help measures nothing) and the marginal figures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.e2e_cpu_roles import marginal, table

ROOT = Path(__file__).resolve().parents[2]


def run(short_images, long_images, short_roles, long_roles):
    def record(images, roles):
        return {"strategy": "ray", "images_delivered": images, "total_cpu_s": sum(roles.values()),
                "roles": {r: {"cpu_s": c, "processes": 1} for r, c in roles.items()}}
    return record(short_images, short_roles), record(long_images, long_roles)


def test_marginal_cancels_fixed_costs_per_role():
    short, long = run(100, 300, {"driver": 5.0, "ray::LoaderActor": 2.0},
                      {"driver": 5.4, "ray::LoaderActor": 3.0, "raylet": 0.2})
    m = marginal(short, long)
    assert m["images"] == 200
    assert m["marginal_cpu_ms_per_image"] == pytest.approx(1000 * 1.6 / 200)
    assert m["roles"] == {"ray::LoaderActor": 5.0, "driver": 2.0, "raylet": 1.0}  # a role of one run counts 0 in the other
    assert "ray::LoaderActor" in table([m]) and "8.00" in table([m])


def test_marginal_refuses_runs_that_delivered_no_more_images():
    short, long = run(300, 300, {"driver": 1.0}, {"driver": 2.0})
    with pytest.raises(SystemExit, match="lengthen --lengths"):
        marginal(short, long)


@pytest.mark.subprocess
def test_help_measures_nothing_and_a_bad_strategy_is_named():
    done = subprocess.run([sys.executable, "-m", "benchmarks.e2e_cpu_roles", "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0 and "--lengths" in done.stdout and "STRATEGY" in done.stdout
    done = subprocess.run([sys.executable, "-m", "benchmarks.e2e_cpu_roles", "bogus"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert done.returncode != 0 and "unknown strategy 'bogus'" in done.stderr
