"""CPU per role per delivered image of one `plait bench e2e` data-bound (or cpu-pool) row, at the margin.

    python -m benchmarks.e2e_cpu_roles [per-rank] [local] [ray] [cpu-pool] [--lengths 8,20] [--json PATH]
                                       [plait bench e2e options, e.g. --images 240 --warmup 2]

Each strategy runs alone, once per length, in a fresh process of its own (the same code as `plait bench e2e`)
while a thread samples, every 0.3 s, the CPU times (user + system) of that process, each of its threads and
every descendant process (DataLoader workers; Ray's raylet, GCS, agents and actors, named by their process
title), their nice value and CPU affinity; a process that ends keeps its last sample. The sampling thread's own
CPU is left out (`sampler_cpu_s` in the JSON). Two lengths give the
CPU per delivered image with the fixed costs (start-up, imports, Ray's start) cancelled:

    marginal_cpu_ms_per_image = 1000 * (cpu_long - cpu_short) / (images_long - images_short)

per strategy and per role. Prints a table; `--json PATH` writes every run and the marginal figures.
docs/e2e.md ("Why each miss, as measured") has the figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time

import psutil


def ray_process_name(p: psutil.Process) -> str:
    """A short name for one of Ray's processes: its title (`ray::IDLE`, `ray::LoaderActor.gather`) or program
    (gcs_server, raylet, log_monitor.py, ...); "?" when it cannot be read (it ended)."""
    try:
        args = p.cmdline()
        if not args or not args[0]:  # psutil reads no arguments of a title that setproctitle rewrote
            args = [p.name()]
    except psutil.Error:
        return "?"
    head = args[0].split(" ")[0]
    if not head.startswith("ray::") and len(args) > 1 and head.rsplit("/", 1)[-1].startswith("python"):
        head = next((a for a in args[1:] if a.endswith(".py")), head)  # python .../log_monitor.py
    return head.rsplit("/", 1)[-1]


def role(p: psutil.Process, me: int) -> str:
    """driver, DataLoader worker, a Ray worker still starting, an actor's class (its title) or the
    program of one of Ray's own processes (ray_process_name)."""
    if p.pid == me:
        return "driver"
    if p.name().startswith("pt_data_worker"):
        return "DataLoader worker"
    name = ray_process_name(p)
    if name.startswith("ray::"):
        return name.split(".")[0]
    return "ray-worker-starting" if name == "default_worker.py" else name.removesuffix(".py")


SAMPLER_THREAD = "cpu-sampler"


class Sampler:
    """CPU times of this process, its threads and its descendants, every 0.3 s. Its own thread's CPU is
    kept apart (`own_cpu_s`) and left out of the driver's: scanning every thread of every process costs
    more the more processes a strategy runs (Ray's ~15 against the local runtime's one) and the longer
    it runs, so counted in it would charge the measurement to the strategy (0.1-0.2 ms per image)."""

    def __init__(self):
        self.me = psutil.Process()
        self.procs: dict[int, tuple[str, float]] = {}
        self.nice: dict[int, int] = {}
        self.affinity: dict[int, tuple] = {}
        self.threads: dict[tuple[int, str], float] = {}
        self.stop = False
        self.own_cpu_s = 0.0  # the sampling thread's own CPU: the measurement's, not the strategy's
        self.thread = threading.Thread(target=self.run, name=SAMPLER_THREAD, daemon=True)

    def sample(self) -> None:
        for p in [self.me, *self.me.children(recursive=True)]:
            try:
                t, name = p.cpu_times(), role(p, self.me.pid)
                old = self.procs.get(p.pid)
                if old is not None and name in ("ray::IDLE", "ray-worker-starting", "?") and old[0] not in ("ray-worker-starting", "?"):
                    name = old[0]  # an actor's title stays its role between calls
                self.procs[p.pid] = (name, t.user + t.system)
                self.nice[p.pid] = p.nice()
                self.affinity[p.pid] = tuple(p.cpu_affinity())
            except psutil.Error:
                pass
        names = {t.native_id: t.name for t in threading.enumerate()}
        for th in self.me.threads():
            name = names.get(th.id, "other")
            name = "-".join(name.split("-")[:2]) if name.startswith("plait-") else name
            self.threads[(th.id, name)] = th.user_time + th.system_time

    def run(self) -> None:
        while not self.stop:
            self.sample()
            self.own_cpu_s = time.thread_time()
            time.sleep(0.3)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()
        self.sample()


STRATEGIES = ("per-rank", "local", "ray", "cpu-pool")


def measure(which: str, e2e_argv: list[str]) -> dict:
    """One strategy at one length, in this process: CPU per role (seconds, processes), images, steps/s."""
    from rich.console import Console

    from benchmarks import e2e  # add_arguments, parse (sets strategy_list), prepare_data, e2e_spec
    from benchmarks.e2e_per_rank import run_per_rank
    from benchmarks.e2e_ray import autoscale_available, run_plait, start_ray
    from plait.cli.bench.e2e_run import GpuClock, run_plait_local

    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    args = p.parse_args(e2e_argv)
    dps = e2e.parse(args)
    demo, image_dir = e2e.prepare_data(None, args.images)
    spec = e2e.e2e_spec(demo, image_dir, dps[0], args)
    clock = GpuClock.of_spec(spec, args.data_bound_tflops)
    load = [os.getloadavg()[0]]
    t0 = time.perf_counter()
    with Sampler() as s:
        if which == "local":
            row = run_plait_local(spec, args, clock)
        elif which == "ray":
            start_ray_as_plait(start_ray, args.cpus)
            row = run_plait(spec, args, clock, autoscale=not args.no_autoscale and autoscale_available())
        elif which == "cpu-pool":
            from benchmarks.e2e_workloads import run_cpu_pool

            args.strategy_list = ["plait"]
            row = run_cpu_pool(args, spec, clock, autoscale_available() and not args.no_autoscale, Console(stderr=True))[-1]
        else:
            from plait.kernels import warm_up

            warm_up()
            row = run_per_rank(spec, args, clock)
    load.append(os.getloadavg()[0])
    by, count = collections.defaultdict(float), collections.Counter()
    full = {name for name, _ in s.procs.values()}
    for name, cpu in s.procs.values():
        name = untruncated(name, full)
        by[name] += cpu
        count[name] += 1
    by["driver"] -= s.own_cpu_s
    threads = collections.defaultdict(float)
    for (_, name), cpu in s.threads.items():
        if name != SAMPLER_THREAD:
            threads[name] += cpu
    cores = collections.defaultdict(float)
    for pid, (name, cpu) in s.procs.items():
        cores[f"{name}@{s.affinity.get(pid)}"] += cpu
    return {
        "strategy": which, "steps": args.steps, "wall_s": round(time.perf_counter() - t0, 1), "load_average": load,
        "steps_per_s": row["steps_per_s"], "startup_s": row["startup_s"], "images_delivered": row.get("images_delivered"),
        "images_decoded": row.get("images_decoded"), "total_cpu_s": round(sum(by.values()), 3),
        "sampler_cpu_s": round(s.own_cpu_s, 3),
        "roles": {k: {"cpu_s": round(v, 3), "processes": count[k]} for k, v in sorted(by.items(), key=lambda x: -x[1])},
        "nice": dict(collections.Counter(f"{s.procs[p][0]}@{n}" for p, n in s.nice.items() if p in s.procs)),
        "driver_threads": {k: round(v, 2) for k, v in sorted(threads.items(), key=lambda x: -x[1]) if v >= 0.01},
        "by_role_and_affinity": {k: round(v, 2) for k, v in sorted(cores.items(), key=lambda x: -x[1])},
    }


def untruncated(name: str, names: set[str]) -> str:
    """An actor's title as read from its 15-character process name (`ray::PlannerAct`, when its arguments
    read empty) -> its full title seen in another sample (`ray::PlannerActor`), where there is one."""
    if len(name) != 15 or not name.startswith("ray::"):
        return name
    longer = sorted(n for n in names if n.startswith(name) and n != name)
    return longer[0] if longer else name


def start_ray_as_plait(start_ray, cpus: int) -> None:
    """A Ray instance of `cpus` CPUs set up as plait sets up one it starts (plait.runtime.ray.common.
    long_run_settings and malloc_env: no dashboard or metrics export, bounded task events, returns up to
    1 MiB inline, jemalloc in the workers),
    so that the row measures plait's data plane, not Ray's defaults (as benchmarks.e2e_workloads does)."""
    from plait.runtime.ray.common import long_run_settings, malloc_env
    from plait.runtime.ray.instance import daemon_env

    settings, env = long_run_settings()
    for name, value in env.items():
        os.environ.setdefault(name, value)
    with daemon_env(malloc_env()):
        start_ray(num_cpus=cpus, include_dashboard=False, _system_config=settings["_system_config"])


def marginal(short: dict, long: dict) -> dict:
    """CPU ms per delivered image between two runs of one strategy, in all and per role (a role missing from
    one run counts 0 there)."""
    images = (long["images_delivered"] or 0) - (short["images_delivered"] or 0)
    if images <= 0:
        raise SystemExit(f"{long['strategy']}: the longer run delivered no more images than the shorter one "
                         f"({long['images_delivered']} vs {short['images_delivered']}): lengthen --lengths")
    names = set(short["roles"]) | set(long["roles"])
    cpu: dict[str, float] = collections.defaultdict(float)
    for run, sign in ((long, 1.0), (short, -1.0)):  # an actor's short name in one run, its title in the other
        for r, figures in run["roles"].items():
            cpu[untruncated(r, names)] += sign * figures["cpu_s"]
    return {"strategy": long["strategy"], "images": images,
            "marginal_cpu_ms_per_image": round(1000 * (long["total_cpu_s"] - short["total_cpu_s"]) / images, 3),
            "roles": {r: round(1000 * c / images, 3) for r, c in sorted(cpu.items(), key=lambda x: -x[1])}}


def run_alone(which: str, steps: int, e2e_argv: list[str]) -> dict:
    """`measure` in a fresh Python process: nothing of one strategy (a Ray instance, pools) stays for the next."""
    cmd = [sys.executable, "-m", "benchmarks.e2e_cpu_roles", "--one", which, "--", "--steps", str(steps), *e2e_argv]
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]  # Ray may print after it
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{which} at {steps} steps failed:\n{done.stdout[-1000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.e2e_cpu_roles",
        description="CPU per role per delivered image of the data-bound e2e row, at the margin between two "
                    "lengths. Options it does not know go to `plait bench e2e` (e.g. --images 240 --warmup 2).")
    p.add_argument("strategies", nargs="*", metavar="STRATEGY",
                   help=f"any of {', '.join(STRATEGIES)} (default: local ray)")
    p.add_argument("--lengths", default="8,20", help="two step counts: the margin between them (default 8,20)")
    p.add_argument("--json", metavar="PATH", help="write the runs and the marginal figures as JSON")
    p.add_argument("--one", choices=STRATEGIES, help=argparse.SUPPRESS)  # a child: measure one run, print JSON
    return p


def main(argv: list[str]) -> None:
    ours, forwarded = argv, []
    if "--" in argv:
        cut = argv.index("--")
        ours, forwarded = argv[:cut], argv[cut + 1:]
    args, rest = parser().parse_known_args(ours)
    forwarded = rest + forwarded
    if args.one:
        print(json.dumps(measure(args.one, forwarded)))
        return
    unknown = [s for s in args.strategies if s not in STRATEGIES]
    if unknown:
        raise SystemExit(f"unknown strategy {unknown[0]!r}: choose from {', '.join(STRATEGIES)}")
    strategies = args.strategies or ["local", "ray"]
    lengths = sorted(int(x) for x in args.lengths.split(","))
    if len(lengths) != 2 or lengths[0] == lengths[1]:
        raise SystemExit(f"--lengths takes two different step counts, got {args.lengths!r}")
    runs, margins = [], []
    for which in strategies:
        short, long = (run_alone(which, n, forwarded) for n in lengths)
        runs += [short, long]
        margins.append(marginal(short, long))
    print(table(margins))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"lengths": lengths, "e2e_options": forwarded, "marginal": margins, "runs": runs}, f, indent=1)


def table(margins: list[dict]) -> str:
    """Strategies as columns, the total and then each role as rows: CPU ms per delivered image."""
    roles = sorted({r for m in margins for r in m["roles"]}, key=lambda r: -max(m["roles"].get(r, 0) for m in margins))
    names = [m["strategy"] for m in margins]
    width = max([len("CPU ms per image")] + [len(r) for r in roles])
    lines = ["  ".join([f"{'CPU ms per image':<{width}}", *(f"{n:>9}" for n in names)])]
    lines.append("  ".join([f"{'all roles':<{width}}", *(f"{m['marginal_cpu_ms_per_image']:>9.2f}" for m in margins)]))
    for r in roles:
        lines.append("  ".join([f"{r:<{width}}", *(f"{m['roles'].get(r, 0.0):>9.2f}" for m in margins)]))
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
