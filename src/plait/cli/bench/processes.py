"""Trainer and server processes of the memory benches (`plait bench memory`, and the project's soak and
memory suites in benchmarks/): each is measured while every process of the set-up is alive."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def torchrun_env(local_rank: int, local_world_size: int, run_id: str) -> dict[str, str]:
    """What torchrun sets for a process of a one-node launch (plait.runtime.node_share reads it)."""
    return {"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world_size), "RANK": str(local_rank),
            "WORLD_SIZE": str(local_world_size), "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": "0"}


def start_serve(spec_path: Path, job: str, ray_address: str | None, loaders: int | None, env: dict) -> tuple:
    """`plait serve SPEC --job JOB` on an existing Ray instance, or with `ray_address` None the one-process
    server (`--runtime local`, no Ray); returns (process, PLAIT_ADDRESS, PLAIT_TOKEN)."""
    cmd = [str(Path(sys.executable).parent / "plait"), "serve", str(spec_path), "--job", job]
    cmd += ["--runtime", "local"] if ray_address is None else ["--ray-address", ray_address, "--loaders", str(loaders or 1)]
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
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def start_trainers(module: str, cfgs: list[dict], env: dict) -> tuple[list, list]:
    """One `python -m MODULE --trainer CFG` process per config; returns them and the JSON line each printed
    once ready (it then waits for `finish`, so every process is measured while all are alive)."""
    procs = [subprocess.Popen([sys.executable, "-m", module, "--trainer", json.dumps(cfg)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) for cfg in cfgs]
    reports = []
    for cfg, p in zip(cfgs, procs):
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"a {cfg.get('mode') or cfg.get('runtime')} trainer failed (exit {p.wait()})")
        reports.append(json.loads(line))
    return procs, reports


def finish(procs) -> None:
    for p in procs:
        try:
            p.stdin.write("go\n")
            p.stdin.flush()
        except BrokenPipeError:
            pass
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
