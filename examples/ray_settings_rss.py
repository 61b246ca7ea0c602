"""RSS of Ray's own processes (GCS, raylet, dashboard, agents, log monitor) over a few minutes of actor
calls, on a local instance started with plait's long-run settings and with Ray's defaults, one after the
other in the same run (docs/ray-long-runs.md cites its output).

    python examples/ray_settings_rss.py --minutes 3 --json rss.json

The workload is what a plait job does to Ray: a steady stream of small actor calls (each one a task event
the GCS keeps) from a driver. Only Ray's processes are counted, not the driver or the actor.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import json, os, sys, time
import psutil, ray
from plait.runtime.ray.common import long_run_settings

settings, minutes = sys.argv[1], float(sys.argv[2])
if settings == "plait":
    init, env = long_run_settings()
    os.environ.update(env)
else:
    init = {"include_dashboard": True, "log_to_driver": True}
ray.init(num_cpus=1, **init)


@ray.remote(num_cpus=0)
class Echo:
    def call(self, x):
        return x


echo = Echo.remote()
ray.get(echo.call.remote(0))
me = psutil.Process()
actor_pid = ray.get(echo.__ray_call__.remote(lambda self: os.getpid()))
session = ray._private.worker.global_worker.node.get_session_dir_path()  # on every Ray process command line


def ray_processes():
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["pid"] not in (me.pid, actor_pid) and session in cmd:
            out.append(p)
    return out


samples, t0, calls = [], time.monotonic(), 0
next_sample = t0
while time.monotonic() - t0 < minutes * 60:
    ray.get([echo.call.remote(i) for i in range(50)])
    calls += 50
    if time.monotonic() >= next_sample:
        rss = 0
        for p in ray_processes():
            try:
                rss += p.memory_info().rss
            except psutil.Error:
                pass
        samples.append((round(time.monotonic() - t0, 1), round(rss / 2**20, 1)))
        next_sample += 10
print(json.dumps({"settings": settings, "calls": calls, "samples": samples, "loadavg": os.getloadavg()}))
ray.shutdown()
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--json", default=None, help="write both runs here")
    args = p.parse_args()
    runs = []
    for settings in ("plait", "ray-defaults"):
        env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
        out = subprocess.run([sys.executable, "-c", CHILD, settings, str(args.minutes)], capture_output=True,
                             text=True, env=env, check=True).stdout
        run = json.loads(out.strip().splitlines()[-1])
        first, last = run["samples"][1], run["samples"][-1]  # after the first 10 s (start-up)
        slope = (last[1] - first[1]) / max(last[0] - first[0], 1) * 3600
        print(f"{settings:13s} Ray's processes: {first[1]:7.1f} MiB at {first[0]:5.0f} s -> {last[1]:7.1f} MiB at "
              f"{last[0]:5.0f} s ({slope:+.0f} MiB/hour), {run['calls']} actor calls, load {run['loadavg'][0]:.1f}")
        runs.append(run)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
