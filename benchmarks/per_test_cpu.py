"""CPU per test: what each test costs the whole machine, its subprocesses, Ray actors and daemons included.

    PER_TEST_CPU=cpu.jsonl python -m pytest -p benchmarks.per_test_cpu -n 0     # record (serially)
    python -m benchmarks.per_test_cpu cpu.jsonl [--top 40]                       # the tables

As a pytest plugin it reads the machine's busy CPU time (/proc/stat: every process, not only pytest's
children) before and after each test and appends {"id", "cpu", "wall"} to the file PER_TEST_CPU names.
Run the suite serially (`-n 0`): with two workers each test would be charged its neighbour's CPU too.
What a test is charged includes the background of whatever runs beside it (a Ray instance of the session
idles at ~0.05 CPU-s a second), so the figures say where the time goes, not what a test costs alone.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

import pytest

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def busy_cpu_s() -> float:
    """CPU seconds the machine has been busy since boot (all cores, idle and iowait left out)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / CLOCK_TICKS


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    out = os.environ.get("PER_TEST_CPU")
    cpu, wall, start = busy_cpu_s(), time.monotonic(), time.time()
    yield
    if out:  # worker and start: a timeline of a run with xdist workers (its CPU figures then mix the workers')
        with open(out, "a") as f:
            f.write(json.dumps({"id": item.nodeid, "cpu": round(busy_cpu_s() - cpu, 2),
                                "wall": round(time.monotonic() - wall, 2), "start": round(start, 2),
                                "busy_at_start": round(cpu, 2),
                                "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.per_test_cpu", description=__doc__.splitlines()[0])
    p.add_argument("file", help="the JSON lines the plugin wrote")
    p.add_argument("--top", type=int, default=25, help="tests and modules listed (default 25)")
    args = p.parse_args(argv)
    rows = [json.loads(line) for line in open(args.file)]
    total = sum(r["cpu"] for r in rows)
    ranked = sorted(rows, key=lambda r: -r["cpu"])
    print(f"{len(rows)} tests, {total:.0f} CPU-s busy in {sum(r['wall'] for r in rows):.0f} s of wall")
    for n in [n for n in (10, 25, 50, 100) if n < len(rows)]:
        print(f"  the {n} dearest tests: {sum(r['cpu'] for r in ranked[:n]):6.0f} CPU-s"
              f" ({sum(r['cpu'] for r in ranked[:n]) / max(total, 1e-9):.0%})")
    modules: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        module = modules[r["id"].split("::")[0]]
        module[0] += r["cpu"]
        module[1] += r["wall"]
    print(f"\n{'CPU-s':>7} {'wall s':>7}  module")
    for name, (cpu, wall) in sorted(modules.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{cpu:7.1f} {wall:7.1f}  {name}")
    print(f"\n{'CPU-s':>7} {'wall s':>7}  test")
    for r in ranked[:args.top]:
        print(f"{r['cpu']:7.1f} {r['wall']:7.1f}  {r['id']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
