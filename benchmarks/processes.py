"""The server and Ray processes of the memory, soak and e2e benchmarks: `plait serve` started and stopped
as a user runs it, and every process this benchmark started sorted into plait's roles and Ray's daemons."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROLES = ("PlannerActor", "LoaderActor", "ConstructorActor")


def start_serve(spec_path: Path, job: str, ray_address: str | None, loaders: int | None, env: dict) -> tuple:
    """`plait serve SPEC --job JOB` on an existing Ray instance, or with `ray_address` None the one-process
    server (`--runtime local`, no Ray); returns (process, PLAIT_ADDRESS, PLAIT_TOKEN)."""
    cmd = [str(Path(sys.executable).parent / "plait"), "serve", str(spec_path), "--job", job]
    on_ray = ["--ray-address", str(ray_address), "--loaders", str(loaders or 1)]
    cmd += ["--runtime", "local"] if ray_address is None else on_ray
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    printed: dict[str, str] = {}
    while "PLAIT_TOKEN" not in printed:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"plait serve ended: {proc.stderr.read()[-3000:]}")
        key, _, value = line.strip().partition("=")
        printed[key] = value
    return proc, printed["PLAIT_ADDRESS"], printed["PLAIT_TOKEN"]


def stop_serve(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def init_ray():
    """A local Ray instance for a memory benchmark's trainers to join (no dashboard, quiet)."""
    import ray

    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, namespace="plait",
             log_to_driver=False, configure_logging=False)
    return ray


def plait_processes(exclude: set[int], serve_pid: int | None, measure) -> tuple[dict, dict]:
    """This process's descendants (`exclude`: the trainers) as plait's roles {role: [measure(pid)]} (a
    server, the job's actors) and Ray's daemons {name: [measure(pid)]}."""
    import psutil

    roles: dict[str, list] = {}
    daemons: dict[str, list] = {}
    for child in psutil.Process().children(recursive=True):
        if child.pid in exclude:
            continue
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        size = measure(child.pid)
        role = "serve" if child.pid == serve_pid else next((r for r in ROLES if f"ray::{r}" in cmd), None)
        if role:
            roles.setdefault(role, []).append(size)
        else:
            name = "worker (idle/other)" if "ray::" in cmd else "agents" if ("dashboard" in cmd or "agent" in cmd) \
                else (os.path.basename(cmd.split()[0]) if cmd else "?")
            daemons.setdefault(name, []).append(size)
    return roles, daemons
