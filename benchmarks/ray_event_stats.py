"""CPU per actor call and per idle actor second with Ray's event stats on (its default) and off.

    python -m benchmarks.ray_event_stats [--rounds 3] [--seconds 10]

Ray's `event_stats` (a system config) times every handler its C++ event loops run (EventTracker:
each gRPC reply, timer and task in the core worker, raylet and GCS) for the debug_state files it writes
every `event_stats_print_interval_ms`. One Ray instance per setting and round (alternating, fresh
processes), started as plait starts one (plait.runtime.ray.common.long_run_settings), 8 actors as plait's
SourceLoaders (num_cpus 0, max_concurrency 4, no task events) each answering a loader-like gather of
768 patch rows (~0.45 MiB, inline); the driver calls all 8 and waits, for --seconds; then the instance
idles for --seconds. CPU: every process of the run (driver, actors, raylet, GCS, agents), user + system.

Measured 2026-12-05 (2 cores shared with other sessions, load 13-18; `--rounds 2 --seconds 8`): CPU ms per
call 3.14 and 3.81 on, 2.98 and 3.19 off; idle 85 and 75 ms/s on, 84 and 81 off. Within the noise of a
shared machine: plait leaves Ray's default (benchmarks/reports/2026-12-05-ray-cpu.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROWS, ROW_BYTES = 768, 14 * 14 * 3


def one(event_stats: bool, seconds: float) -> dict:
    import numpy as np
    import ray

    from benchmarks.ray_inline_returns import timed_calls

    from plait.runtime.ray.common import actor_options, long_run_settings

    init, _ = long_run_settings()
    init["_system_config"]["event_stats"] = event_stats
    ray.init(num_cpus=8, **init)

    class Loader:
        def gather(self, request):
            return {"tokens": np.arange(2000, dtype=np.int32), "pixels": np.ones((ROWS, ROW_BYTES), np.uint8)}

    loaders = [ray.remote(Loader).options(**actor_options(num_cpus=0, max_concurrency=4)).remote() for _ in range(8)]
    calls, busy, cpu = timed_calls(loaders, seconds)
    before, t0 = cpu(), time.perf_counter()
    time.sleep(seconds)
    idle, idle_s = cpu() - before, time.perf_counter() - t0
    ray.shutdown()
    return {"event_stats": event_stats, "calls": calls, "cpu_ms_per_call": round(1000 * busy / calls, 3),
            "idle_cpu_ms_per_s": round(1000 * idle / idle_s, 1), "load_average": round(os.getloadavg()[0], 1)}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ray_event_stats", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--one", choices=("on", "off"), help=argparse.SUPPRESS)  # a child: one instance
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one == "on", args.seconds)))
        return
    import subprocess

    for _ in range(args.rounds):
        for setting in ("on", "off"):
            done = subprocess.run([sys.executable, "-m", "benchmarks.ray_event_stats", "--one", setting,
                                   "--seconds", str(args.seconds)], capture_output=True, text=True, check=True)
            print(done.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
