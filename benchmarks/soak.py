"""`python -m benchmarks.soak`: does any process of a long job grow? Stream for N minutes, sample memory by role.

It writes a multi-source spec (`--sources` pre-tokenized Parquet sources, `plait bench memory`'s
generator), then streams it as fast as it can for `--minutes` in the processes the runtime needs:

  local   `plait run SPEC --runtime local` (role `driver`: the whole data plane in one process)
  ray     `plait run SPEC --runtime ray` (roles `driver`, `planner`, `loader`, `constructor`, and `ray`:
          Ray's own processes: gcs_server, raylet, dashboard, log_monitor, idle workers, ...)
  node    `--dp` trainer processes started as torchrun would (LOCAL_RANK 0 hosts the node's data plane:
          role `node-host`; the others read from it over Flight: role `trainer`)
  flight  `plait serve SPEC --runtime local` (role `server`) and `--dp` thin Flight clients (`trainer`)

Every `--interval-s` it samples the RSS (and PSS, which splits shared pages fairly) of every process of
the run, summed per role; from `--warmup-s` after the last role appeared (the whole data plane running)
it fits a least-squares line per role and reports the start, end and slope (MiB/hour, and extrapolated
to a day), the slope of the fit's second half (warm-up flattens there; growth does not) and how fast
the band the RSS moves in drifts (its top and bottom from the first third to the last: the teeth of
buffers filling and trimmed do not tilt it). After the
run ends it waits 10 s and lists the run's processes still alive (`left_after_exit`). `--plot PATH`
draws RSS over time per role. `--tracemalloc DIR` is for finding what grows, not for figures: every
plait process of the run dumps its top growing allocation sites there (plait.telemetry.MemoryTrace).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import main
from benchmarks.processes import start_serve, stop_serve
from benchmarks.soak_sampler import Sampler, ray_process_table, role_table
from plait.cli.bench.memory import make_sources, spec_dict_of, torchrun_env
from plait.errors import PlaitError

HELP = "memory over a long run: RSS/PSS of every process by role, slope per hour after a warm-up"
DESCRIPTION = __doc__
RUNTIMES = ("local", "node", "ray", "flight")
EXIT_GRACE_S = 10.0  # a process of the run still alive this long after it ended is reported


def add_arguments(p) -> None:
    p.add_argument("--minutes", type=float, default=10.0, help="how long to stream (float; default 10)")
    p.add_argument("--runtime", choices=RUNTIMES, default="local", help="which runtime's processes to soak")
    p.add_argument("--warmup-s", type=float, default=None,
                   help="seconds left out of the slope, counted from when the last role (process kind) appeared "
                   "(default: a fifth of the run, at most 120)")
    p.add_argument("--interval-s", type=float, default=None, help="seconds between samples (default 5; less "
                   "for runs under a minute)")
    p.add_argument("--sources", type=int, default=16, help="Parquet sources in the spec")
    p.add_argument("--dp", type=int, default=2, help="DP ranks (node, flight: one trainer process each)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per micro-batch")
    p.add_argument("--loaders", type=int, default=2, help="ray: SourceLoader actors")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")
    p.add_argument("--plot", metavar="PATH", help="draw RSS over time per role (PNG)")
    p.add_argument("--tracemalloc", metavar="DIR", help="diagnose, not measure: every plait process of the run "
                   "writes tracemalloc's top 20 growing allocation sites to DIR every --tracemalloc-every s "
                   "(PLAIT_TRACEMALLOC; tracing slows the processes and adds memory, so its slopes are not figures)")
    p.add_argument("--tracemalloc-every", type=float, default=60.0, help="seconds between two dumps (default 60)")
    p.add_argument("--exit-grace-s", type=float, default=EXIT_GRACE_S,
                   help=f"a process of the run still alive this long after it ended is reported (default {EXIT_GRACE_S:g})")


def run(args) -> int:
    if args.minutes <= 0:
        raise PlaitError("--minutes must be > 0")
    seconds = args.minutes * 60
    warmup = args.warmup_s if args.warmup_s is not None else min(120.0, seconds / 5)
    interval = args.interval_s if args.interval_s is not None else (5.0 if seconds >= 60 else max(1.0, seconds / 20))
    if warmup >= seconds:
        raise PlaitError(f"--warmup-s {warmup:g} leaves nothing of a {seconds:g} s run to fit a slope on")
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # Started in the background (`&`, nohup): SIGINT is ignored here and would be in every process we
        # start, so Ctrl-C (how the run is ended) would not reach them. A handler is reset at exec.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.tracemalloc:  # inherited by every process of the run (Ray's workers through its raylet)
        os.environ.update(PLAIT_TRACEMALLOC=str(Path(args.tracemalloc).resolve()),
                          PLAIT_TRACEMALLOC_EVERY=str(args.tracemalloc_every))
    result = soak(args.runtime, seconds, warmup, interval, sources=args.sources, dp=args.dp, seq_len=args.seq_len,
                  loaders=args.loaders, exit_grace_s=args.exit_grace_s)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)
        print(f"plot: {args.plot}")
    return 0


def soak(runtime: str, seconds: float, warmup: float, interval: float, *, sources: int = 16, dp: int = 2,
         seq_len: int = 2048, loaders: int = 2, exit_grace_s: float = EXIT_GRACE_S) -> dict:
    """Stream for `seconds`, sampling every `interval`; the result `--json` writes."""
    # A short temp dir of the run's own: Ray's session (its sockets have a length limit) and the node share.
    root = Path(tempfile.mkdtemp(prefix="soak-", dir=os.environ.get("TMPDIR") or "/tmp"))
    try:
        spec = spec_dict_of(make_sources(root / "data", sources, files=2, block_mb=1.0), dp, seq_len)
        spec_path = root / "spec.json"
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_TMPDIR": str(root / "ray"),
               "PLAIT_NODE_DIR": str(root / "node"), "TMPDIR": str(root),
               # trainers run `python -m benchmarks.soak`: the repository's root on their path, wherever run from
               "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                           os.environ.get("PYTHONPATH")]))}
        load = [os.getloadavg()]
        job = Run(runtime, spec_path, env, dp, loaders, deadline=time.monotonic() + seconds)
        job.start()
        sampler = Sampler(started=job.roles, marker=str(root))
        try:
            while time.monotonic() < job.deadline and job.alive():
                sampler.sample()
                load.append(os.getloadavg())
                time.sleep(max(0.0, min(interval, job.deadline - time.monotonic())))
            sampler.sample()
        finally:
            outcome = job.stop()
        time.sleep(exit_grace_s)
        left = sampler.left_alive()
        for p in left:  # nothing of the bench may outlive it
            _kill(p["pid"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"runtime": runtime, "minutes": round(seconds / 60, 3), "warmup_s": warmup, "interval_s": interval,
            "sources": sources, "dp": dp, "exit_grace_s": exit_grace_s, "roles": role_table(sampler.samples, warmup),
            "ray_processes": ray_process_table(sampler.samples, warmup), "left_after_exit": left,
            "samples": [{"t": round(s["t"], 2), "rss_mib": {r: round(v["rss"] / 2**20, 2) for r, v in s["roles"].items()},
                         **({"ray_processes_mib": {k: round(v / 2**20, 2) for k, v in s["ray_processes"].items()}}
                            if s["ray_processes"] else {})}
                        for s in sampler.samples],
            "loadavg": {"start": list(load[0]), "max_1min": max(x[0] for x in load), "end": list(os.getloadavg())},
            "outcome": outcome}


class Run:
    """The processes one soak starts for a runtime, and how they are stopped."""

    def __init__(self, runtime: str, spec_path: Path, env: dict, dp: int, loaders: int, deadline: float):
        self.runtime, self.spec_path, self.env, self.dp, self.loaders = runtime, spec_path, env, dp, loaders
        self.deadline = deadline
        self.procs: list[subprocess.Popen] = []
        self.serve = None
        self.roles: dict[int, str] = {}

    def start(self) -> None:
        plait = str(Path(sys.executable).parent / "plait")
        if self.runtime in ("local", "ray"):
            cmd = [plait, "run", str(self.spec_path), "--steps", str(10**9), "--quiet", "--runtime", self.runtime]
            if self.runtime == "ray":
                cmd += ["--loaders", str(self.loaders)]
            self._spawn(cmd, self.env, "driver")
            return
        cfg: dict = {"spec": str(self.spec_path), "deadline_wall": time.time() + self.deadline - time.monotonic(),
                     "lockstep": str(self.spec_path.parent / "lockstep"), "ranks": self.dp}
        Path(cfg["lockstep"]).mkdir(exist_ok=True)
        if self.runtime == "flight":
            self.serve, address, token = start_serve(self.spec_path, "soak", None, None, self.env)
            self.roles[self.serve.pid] = "server"
            cfg.update(runtime="flight", job="soak", job_address=address, token=token)
        run_id = f"soak-{os.getpid()}"
        for r in range(self.dp):
            env = self.env
            if self.runtime == "node":
                env = {**self.env, **torchrun_env(r, self.dp, run_id)}
            role = "node-host" if self.runtime == "node" and r == 0 else "trainer"
            self._spawn([sys.executable, "-m", "benchmarks.soak", "--trainer", json.dumps({**cfg, "rank": r})],
                        env, role)

    def _spawn(self, cmd: list[str], env: dict, role: str) -> None:
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(p)
        self.roles[p.pid] = role

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def stop(self) -> dict:
        """Ends the run as a user would (Ctrl-C for `plait run`; the trainers stop at the deadline by
        themselves, then the server); returns each process's exit status and its last output lines."""
        for p in self.procs:
            if self.runtime in ("local", "ray") and p.poll() is None:
                p.send_signal(signal.SIGINT)
        out = []
        for p in self.procs:
            try:
                stdout, stderr = p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
                stdout, stderr = p.communicate()
            out.append({"role": self.roles[p.pid], "exit": p.returncode, "stdout": stdout[-500:],
                        "stderr": stderr[-1500:] if p.returncode not in (0, 130) else ""})
        if self.serve is not None:
            stop_serve(self.serve)
            out.append({"role": "server", "exit": self.serve.returncode})
        return {"processes": out}


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    load, nan = result["loadavg"], float("nan")
    table = Table(title=f"soak: runtime {result['runtime']}, {result['minutes']:g} min, slope from "
                        f"{result['warmup_s']:g} s after the last role started (load average {load['start'][0]:.1f} -> max {load['max_1min']:.1f})")
    for col in ("role", "processes", "fit from (s)", "RSS start (MiB)", "RSS end (MiB)", "slope (MiB/hour)",
                "growth (MiB/day)", "2nd half (MiB/hour)", "band (MiB/hour)", "PSS start -> end (MiB)"):
        table.add_column(col, justify="left" if col == "role" else "right")
    for r in result["roles"]:
        pss = f"{r['pss_start_mib']:,.1f} -> {r['pss_end_mib']:,.1f}" if "pss_start_mib" in r else "-"
        table.add_row(r["role"], str(r["processes"]), f"{r['fit_from_s']:g}", f"{r['rss_start_mib']:,.1f}",
                      f"{r['rss_end_mib']:,.1f}", f"{r['slope_mib_per_hour']:+,.2f}", f"{r['growth_mib_per_day']:+,.1f}",
                      f"{r['late_slope_mib_per_hour']:+,.2f}", f"{r.get('band_slope_mib_per_hour', nan):+,.2f}", pss)
    console = Console(width=max(120, Console().width))  # the table is unreadable folded
    console.print(table)
    for proc in result["outcome"]["processes"]:
        if proc["exit"] not in (0, 130, None):  # 130: ended by Ctrl-C, as the bench ends `plait run`
            console.print(f"[bold yellow]a {proc['role']} process ended with exit {proc['exit']}[/] (the run may "
                          f"have stopped early): {proc.get('stderr', '')[-600:]}", highlight=False)
    if result.get("ray_processes"):
        console.print("Ray's own processes (MiB/hour): " + ", ".join(
            f"{p['name']} {p['rss_start_mib']:,.0f} -> {p['rss_end_mib']:,.0f} ({p['slope_mib_per_hour']:+,.1f})"
            for p in result["ray_processes"]), highlight=False)
    left = result["left_after_exit"]
    console.print(f"left {result.get('exit_grace_s', EXIT_GRACE_S):g} s after exit: {len(left)} process(es)"
                  + "".join(f"\n  {p['pid']} {p['role']}: {p['cmdline']}" for p in left), highlight=False)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    t = [s["t"] / 60 for s in result["samples"]]
    for r in result["roles"]:
        ax.plot(t, [s["rss_mib"].get(r["role"], 0.0) for s in result["samples"]], marker=".",
                label=f"{r['role']} ({r['slope_mib_per_hour']:+.1f} MiB/h)")
    fit_from = min((r["fit_from_s"] for r in result["roles"]), default=result["warmup_s"])
    ax.axvline(fit_from / 60, color="grey", ls=":", label="start of the fit (end of warm-up)")
    ax.set(title=f"RSS per role, runtime {result['runtime']}", xlabel="minutes", ylabel="RSS (MiB)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _trainer() -> None:
    """A trainer process (`python -m benchmarks.soak --trainer CFG`): iterates until the deadline."""
    import plait

    cfg = json.loads(sys.argv[2])
    options = {k: cfg[k] for k in ("runtime", "job", "address", "job_address", "token") if k in cfg}
    batches = 0
    lockstep = Lockstep(Path(cfg["lockstep"]), cfg["rank"], cfg["ranks"], cfg["deadline_wall"])
    with plait.Loader(cfg["spec"], dp_rank=cfg["rank"], steps=10**9, **options) as loader:
        for _ in loader:
            batches += 1
            if time.time() >= cfg["deadline_wall"]:
                break
            if batches % LOCKSTEP_EVERY == 0:
                lockstep.wait(batches)
    print(json.dumps({"batches": batches}), flush=True)


LOCKSTEP_EVERY = 16  # batches between two lockstep checks of the trainers


class Lockstep:
    """Keeps the trainers within a few steps of each other, as a job's gradient all-reduce does (free
    running, one rank would run thousands of steps ahead and the slow one fall out of the plan window).
    Each rank writes its batch count to a file; a rank ahead of the slowest by more than LOCKSTEP_EVERY
    waits for it (until the deadline)."""

    def __init__(self, folder: Path, rank: int, ranks: int, deadline_wall: float):
        self.folder, self.rank, self.ranks, self.deadline = folder, rank, ranks, deadline_wall

    def wait(self, batches: int) -> None:
        tmp = self.folder / f".{self.rank}"
        tmp.write_text(str(batches))
        os.replace(tmp, self.folder / str(self.rank))
        while time.time() < self.deadline and self.slowest() < batches - LOCKSTEP_EVERY:
            time.sleep(0.005)

    def slowest(self) -> int:
        counts = []
        for r in range(self.ranks):
            try:
                counts.append(int((self.folder / str(r)).read_text() or 0))
            except (OSError, ValueError):
                counts.append(0)
        return min(counts)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--trainer":
        _trainer()
    else:
        sys.exit(main(sys.modules[__name__]))
