"""CPU per actor call of a loader-like gather, by the size of what it returns and Ray's inline limit.

    python -m benchmarks.ray_inline_returns [--rows 768,7680] [--inline 102400,1048576,8388608] [--seconds 15]

8 actors (num_cpus 0, max_concurrency 4, no task events: as plait's SourceLoaders) each return a dict of
tokens and a uint8 array of ROWS patch rows (588 bytes each: 768 rows ~ 3 images of 256 patches ~ 0.45 MiB,
one gather of the e2e data-bound row); the driver calls all 8 and waits, again and again, for --seconds.
CPU is every process of the run (driver, actors, raylet, GCS), user + system, from psutil; one Ray
instance per (rows, inline limit), started with `_system_config={"max_direct_call_object_size": LIMIT}`.
A return under the limit travels in the call's reply; above it, through the object store (plasma).

Measured 2026-12-05 (2 cores shared with other sessions, load 13-19; CPU ms per call, all processes):
0.45 MiB returns: 3.7-3.9 through plasma (Ray's 100 KiB default), 2.6 inline; 1 MiB: 4.5 plasma, 5.1
inline; 2 MiB: 5.2 plasma, 7.6 inline; 4.5 MiB: 5.2 plasma, 13.7 inline. plait's limit for a Ray instance
it starts (plait.runtime.ray.common.INLINE_RETURN_BYTES) is 512 KiB: small gathers inline, the rest through
the store.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROW_BYTES = 14 * 14 * 3


def timed_calls(loaders: list, seconds: float) -> tuple[int, float, object]:
    """Every loader's `gather` of a gather-like request at once, round after round, for `seconds` (after one
    warm-up round and 2 s of settling): (calls, CPU seconds every process of the run spent, the CPU clock:
    driver, actors and Ray's processes, user + system, from psutil)."""
    import numpy as np
    import psutil
    import ray

    ray.get([ld.gather.remote(None) for ld in loaders])
    time.sleep(2)
    procs = [psutil.Process(), *psutil.Process().children(recursive=True)]

    def cpu() -> float:
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    request = (np.arange(30), [(0, 1, 2)] * 20, np.arange(30), np.arange(30), np.zeros(30), np.ones(30))
    before, t0, calls = cpu(), time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        ray.get([ld.gather.remote(request) for ld in loaders])
        calls += len(loaders)
    return calls, cpu() - before, cpu


def one(rows: int, inline: int, seconds: float) -> dict:
    import numpy as np
    import ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             _system_config={"enable_metrics_collection": False, "max_direct_call_object_size": inline})

    @ray.remote(num_cpus=0)
    class Loader:
        def gather(self, request):
            return {"tokens": np.arange(2000, dtype=np.int32), "pixels": np.ones((rows, ROW_BYTES), np.uint8)}

    loaders = [Loader.options(enable_task_events=False, max_concurrency=4).remote() for _ in range(8)]
    calls, spent, _ = timed_calls(loaders, seconds)
    ray.shutdown()
    return {"rows": rows, "return_mib": round(rows * ROW_BYTES / 2**20, 2), "inline_limit": inline, "calls": calls,
            "cpu_ms_per_call": round(1000 * spent / calls, 3), "load_average": os.getloadavg()[0]}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ray_inline_returns", description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="768,7680", help="patch rows per return, comma-separated")
    p.add_argument("--inline", default="102400,1048576,8388608", help="max_direct_call_object_size values")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--one", help=argparse.SUPPRESS)  # a child: ROWS,LIMIT
    args = p.parse_args(argv)
    if args.one:
        rows, inline = (int(x) for x in args.one.split(","))
        print(json.dumps(one(rows, inline, args.seconds)))
        return
    import subprocess

    for rows in (int(x) for x in args.rows.split(",")):
        for inline in (int(x) for x in args.inline.split(",")):  # a Ray instance each: a process each
            done = subprocess.run([sys.executable, "-m", "benchmarks.ray_inline_returns", "--one", f"{rows},{inline}",
                                   "--seconds", str(args.seconds)], capture_output=True, text=True, check=True)
            print(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main(sys.argv[1:])
