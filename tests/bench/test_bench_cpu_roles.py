"""benchmarks.e2e_cpu_roles: its command line (help measures nothing) and the marginal figures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.e2e_cpu_roles import marginal, ray_process_name, table, untruncated

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


def test_an_actor_read_by_its_short_process_name_counts_under_its_title():
    """An actor whose arguments read empty (psutil, mid-setproctitle) has a 15-character process name: its
    CPU goes to its full title, not to a role of its own (a Planner at +1.5 and -1.1 ms per image)."""
    names = {"ray::PlannerActor", "ray::PlannerAct", "raylet"}
    assert untruncated("ray::PlannerAct", names) == "ray::PlannerActor"
    assert untruncated("ray::LoaderActo", names) == "ray::LoaderActo"  # no full title seen: kept
    assert untruncated("raylet", names) == "raylet"
    short, long = run(100, 300, {"ray::PlannerAct": 1.0}, {"ray::PlannerActor": 1.4})
    assert marginal(short, long)["roles"] == {"ray::PlannerActor": 2.0}  # not +7 and -5 for two names


class Titled:
    """A psutil.Process stand-in: its arguments and its (15-character) process name."""

    def __init__(self, args, name):
        self.args, self.short = args, name

    def cmdline(self):
        return self.args

    def name(self):
        return self.short


def test_ray_process_names_from_titles_programs_and_short_names():
    assert ray_process_name(Titled(["ray::LoaderActor.gather_payload", "", ""], "ray::LoaderActo")) == \
        "ray::LoaderActor.gather_payload"
    assert ray_process_name(Titled(["/venv/bin/python", "/x/ray/_private/log_monitor.py", "--x"], "python")) == \
        "log_monitor.py"
    assert ray_process_name(Titled([""], "ray::PlannerAct")) == "ray::PlannerAct"  # arguments read empty


def test_the_samplers_own_cpu_is_kept_apart_from_the_drivers():
    """The sampling thread scans every thread of every process: more for Ray's ~15 processes than for the
    local runtime's one. Its CPU is the measurement's: `own_cpu_s`, and no driver thread of that name."""
    import time

    from benchmarks.e2e_cpu_roles import SAMPLER_THREAD, Sampler

    with Sampler() as s:
        time.sleep(0.7)  # two or three samples
    sampled = [cpu for (_, name), cpu in s.threads.items() if name == SAMPLER_THREAD]
    assert len(sampled) == 1 and s.own_cpu_s > 0
    assert s.own_cpu_s == pytest.approx(sampled[0], abs=0.05)  # what the driver's total leaves out
