"""`python -m benchmarks.suite_cpu`: where the test suite's CPU goes (issue 23: CI time).

Runs `make test` (the README's test command) while sampling every process of the machine with psutil every
`--interval-s` seconds. A pytest plugin (this module, loaded with `-p benchmarks.suite_cpu`) records each
test's worker, start and end. Each process's CPU is credited to the xdist worker it descends from and to the
test running there when the CPU was spent (CPU of processes that belong to no worker is reported apart);
Ray worker processes (`default_worker.py`, `ray::...`) are counted apart as the share that Ray's per-process
start-up cost sets. Sampled, so a process that lives less than one interval is missed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from benchmarks.common import main, write_result

HELP = "where `make test`'s CPU goes: per test, per kind of process"
DESCRIPTION = __doc__
TESTS_FILE = "PLAIT_SUITE_CPU_TESTS"  # where the plugin appends one JSON line per test
ROOT = Path(__file__).resolve().parents[1]


def add_arguments(p) -> None:
    p.add_argument("--workers", type=int, default=2, help="xdist workers (make's TEST_WORKERS)")
    p.add_argument("--interval-s", type=float, default=0.5, help="sampling interval")
    p.add_argument("--pytest-args", default="", help="more pytest arguments (e.g. a test selection)")
    p.add_argument("--top", type=int, default=20, help="tests listed")
    p.add_argument("--json", metavar="PATH")


# ----- the pytest plugin (in each xdist worker) --------------------------------------------------------
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t0 = time.time()
    yield
    path = os.environ.get(TESTS_FILE)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"id": item.nodeid, "pid": os.getpid(), "t0": t0, "t1": time.time()}) + "\n")


# ----- sampling ----------------------------------------------------------------------------------------
class Sampler(threading.Thread):
    """Every process's cumulative CPU seconds, each `interval` seconds: increments per (pid, start time)."""

    def __init__(self, interval: float):
        super().__init__(daemon=True)
        self.interval, self.stop = interval, threading.Event()
        self.procs: dict[tuple[int, float], dict] = {}  # (pid, create_time) -> cmd, ppid, cpu, increments
        self.busy0 = self.busy1 = None

    def run(self) -> None:
        import psutil

        me, start = os.getpid(), time.time()
        self.busy0 = psutil.cpu_times()
        while not self.stop.wait(self.interval):
            now = time.time()
            for p in psutil.process_iter(["pid", "ppid", "cmdline", "name", "cpu_times", "create_time"]):
                i = p.info
                if i["pid"] == me or i["cpu_times"] is None:
                    continue
                cpu = i["cpu_times"].user + i["cpu_times"].system
                rec = self.procs.setdefault((i["pid"], i["create_time"]), {  # older processes: from now on
                    "cmd": " ".join(i["cmdline"] or [i["name"] or ""])[:200], "ppid": i["ppid"],
                    "cpu": cpu if i["create_time"] < start else 0.0, "increments": []})
                if i["cmdline"]:
                    rec["cmd"] = " ".join(i["cmdline"])[:200]  # a Ray worker renames itself ray::Class later
                rec["increments"].append((now, cpu - rec["cpu"]))
                rec["cpu"] = cpu
        self.busy1 = psutil.cpu_times()


def program(cmd: str) -> str:
    """What a process runs, for the per-program table: a Ray worker by its actor class (`ray::IDLE` is a
    worker that never ran an actor or task), Python by its `-m` module or script, anything else by its
    executable's name."""
    words = cmd.split()
    if not words:
        return "?"
    if words[0].startswith("ray::"):
        return words[0].split(".")[0]
    if "default_worker.py" in cmd:
        return "ray worker (starting)"
    exe = os.path.basename(words[0])
    if exe.startswith("python"):
        rest = [w for w in words[1:] if not w.startswith("-") or w == "-m"]
        if rest[:1] == ["-m"] and len(rest) > 1:
            return f"python -m {rest[1]}"
        return f"python {os.path.basename(rest[0])}" if rest else "python"
    return exe


def attribute(sampler: Sampler, tests: list[dict]) -> dict:
    """CPU seconds per test and per kind of process (see the module's docstring)."""
    workers = {t["pid"] for t in tests}
    parent = {pid: rec["ppid"] for (pid, _), rec in sampler.procs.items()}
    runs = defaultdict(list)
    for t in tests:
        runs[t["pid"]].append(t)

    def owner(pid: int) -> int | None:
        for _ in range(32):
            if pid in workers:
                return pid
            if pid not in parent:
                return None
            pid = parent[pid]
        return None

    per_test, kinds, ray_workers = Counter(), Counter(), 0
    programs, processes = Counter(), Counter()
    for (pid, _), rec in sampler.procs.items():
        ray_worker = "default_worker.py" in rec["cmd"] or rec["cmd"].startswith("ray::")
        ray_workers += ray_worker
        w = owner(pid)
        kind = ("pytest worker" if pid in workers else "Ray worker process" if ray_worker
                else "other process of the tests" if w is not None else "outside the tests")
        if kind != "outside the tests":
            programs[program(rec["cmd"])] += rec["cpu"]
            processes[program(rec["cmd"])] += 1
        for t, spent in rec["increments"]:
            kinds[kind] += spent
            if w is not None:
                running = [x["id"] for x in runs[w] if x["t0"] <= t <= x["t1"] + sampler.interval]
                per_test[running[-1] if running else "(between tests)"] += spent
    busy = lambda c: c.user + c.system + c.nice + c.irq + c.softirq  # noqa: E731
    return {"machine_busy_cpu_s": busy(sampler.busy1) - busy(sampler.busy0), "cpu_s_by_kind": dict(kinds),
            "ray_worker_processes": ray_workers, "cpu_s_by_test": dict(per_test.most_common()),
            "cpu_s_by_program": {name: {"cpu_s": cpu, "processes": processes[name]}
                                 for name, cpu in programs.most_common()}}


def run(args) -> int:
    with tempfile.TemporaryDirectory(prefix="plait-suite-cpu-") as tmp:
        tests_file = Path(tmp) / "tests.jsonl"
        env = {**os.environ, TESTS_FILE: str(tests_file),
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        sampler = Sampler(args.interval_s)
        sampler.start()
        t0 = time.perf_counter()
        done = subprocess.run(["make", "test", f"TEST_WORKERS={args.workers}",
                               f"PYTEST_ARGS=-p benchmarks.suite_cpu {args.pytest_args}"], cwd=ROOT, env=env)
        wall = time.perf_counter() - t0
        sampler.stop.set()
        sampler.join()
        tests = [json.loads(line) for line in tests_file.read_text().splitlines()] if tests_file.exists() else []
    result = {"wall_s": wall, "tests": len(tests), "make_test_rc": done.returncode, **attribute(sampler, tests)}
    print(f"make test: {wall:.0f} s, exit {done.returncode}; the machine busy {result['machine_busy_cpu_s']:.0f} "
          f"CPU-seconds; {result['ray_worker_processes']} Ray worker processes")
    for kind, cpu in sorted(result["cpu_s_by_kind"].items(), key=lambda kv: -kv[1]):
        print(f"  {cpu:7.1f} CPU-s  {kind}")
    print("by program (processes of the tests; a process's CPU since it started or since sampling began):")
    for name, row in list(result["cpu_s_by_program"].items())[: args.top]:
        print(f"  {row['cpu_s']:7.1f} CPU-s  {row['processes']:4d} processes  {name}")
    for test, cpu in list(result["cpu_s_by_test"].items())[: args.top]:
        print(f"  {cpu:7.1f} CPU-s  {test}")
    write_result(args.json, result)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
