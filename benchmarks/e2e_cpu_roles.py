"""CPU seconds per role per delivered image of one `plait bench e2e` data-bound (or cpu-pool) row.

    python -m benchmarks.e2e_cpu_roles per-rank|local|ray|cpu-pool [plait bench e2e options]
    e.g. python -m benchmarks.e2e_cpu_roles local --steps 20 --warmup 2 --images 240

Runs one strategy of the row in this process (the same code as `plait bench e2e`) while a thread samples,
every 0.3 s, the CPU times (user + system) of this process, each of its threads and every descendant
process (DataLoader workers; Ray's raylet, GCS, agents and actors, named by their process title), their
nice value and CPU affinity; a process that ends keeps its last sample. Prints one JSON line: per role
[CPU seconds, processes, CPU ms per delivered image], images delivered and decoded, steps/s; then the
driver's CPU per thread name (local: preprocessing pool, build threads) and, for cpu-pool, CPU per
(role, affinity). Two lengths (e.g. --steps 8 and 20) give the per-image cost with fixed costs cancelled:
(cpu_20 - cpu_8) / (images_20 - images_8). docs/e2e.md ("Why each miss, as measured") has the figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import time

import psutil

from plait.cli.bench.soak_sampler import ray_process_name

def role(p: psutil.Process, me: int) -> str:
    """driver, DataLoader worker, a Ray worker still starting, an actor's class (its title) or the
    program of one of Ray's own processes (plait.cli.bench.soak_sampler.ray_process_name)."""
    if p.pid == me:
        return "driver"
    if p.name().startswith("pt_data_worker"):
        return "DataLoader worker"
    name = ray_process_name(p)
    if name.startswith("ray::"):
        return name.split(".")[0]
    return "ray-worker-starting" if name == "default_worker.py" else name.removesuffix(".py")


class Sampler:
    def __init__(self):
        self.me = psutil.Process()
        self.procs: dict[int, tuple[str, float]] = {}
        self.nice: dict[int, int] = {}
        self.affinity: dict[int, tuple] = {}
        self.threads: dict[tuple[int, str], float] = {}
        self.stop = False
        self.thread = threading.Thread(target=self.run, daemon=True)

    def sample(self) -> None:
        for p in [self.me, *self.me.children(recursive=True)]:
            try:
                t, name = p.cpu_times(), role(p, self.me.pid)
                old = self.procs.get(p.pid)
                if old is not None and name in ("ray::IDLE", "ray-worker-starting") and old[0] not in ("ray-worker-starting",):
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
            time.sleep(0.3)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()
        self.sample()


def main(argv: list[str]) -> None:
    from rich.console import Console

    from plait.cli.bench import e2e
    from plait.cli.bench.e2e_run import GpuClock, autoscale_available, run_per_rank, run_plait, run_plait_local, start_ray

    which, rest = argv[0], argv[1:]
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    args = p.parse_args(rest)
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
            start_ray(num_cpus=args.cpus, include_dashboard=False)
            row = run_plait(spec, args, clock, autoscale=not args.no_autoscale and autoscale_available())
        elif which == "cpu-pool":
            from plait.cli.bench.e2e_workloads import run_cpu_pool

            args.strategy_list = ["plait"]
            row = run_cpu_pool(args, spec, clock, autoscale_available() and not args.no_autoscale, Console(stderr=True))[-1]
        else:
            from plait.kernels import warm_up

            warm_up()
            row = run_per_rank(spec, args, clock)
    load.append(os.getloadavg()[0])
    by, count = collections.defaultdict(float), collections.Counter()
    for name, cpu in s.procs.values():
        by[name] += cpu
        count[name] += 1
    images = row.get("images_delivered") or 1
    print(json.dumps({
        "strategy": which, "wall_s": round(time.perf_counter() - t0, 1), "load_average": load,
        "steps_per_s": row["steps_per_s"], "startup_s": row["startup_s"], "images_delivered": row.get("images_delivered"),
        "images_decoded": row.get("images_decoded"), "total_cpu_s": round(sum(by.values()), 2),
        "cpu_ms_per_image": round(1000 * sum(by.values()) / images, 2),
        "roles": {k: [round(v, 2), count[k], round(1000 * v / images, 2)] for k, v in sorted(by.items(), key=lambda x: -x[1])},
        "nice": dict(collections.Counter(f"{s.procs[p][0]}@{n}" for p, n in s.nice.items() if p in s.procs))}))
    threads = collections.defaultdict(float)
    for (_, name), cpu in s.threads.items():
        threads[name] += cpu
    print("driver threads:", {k: round(v, 2) for k, v in sorted(threads.items(), key=lambda x: -x[1]) if v >= 0.01})
    if which == "cpu-pool":
        cores = collections.defaultdict(float)
        for pid, (name, cpu) in s.procs.items():
            cores[f"{name}@{s.affinity.get(pid)}"] += cpu
        print("by role and affinity:", {k: round(v, 2) for k, v in sorted(cores.items(), key=lambda x: -x[1])})


if __name__ == "__main__":
    main(sys.argv[1:])
