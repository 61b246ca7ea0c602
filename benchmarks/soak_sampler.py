"""Resident memory of a soak run's processes, by role, sampled over time; a least-squares slope per role.

A process's role comes from what it is: plait's Ray actors set their process title (`ray::PlannerActor`,
`ray::LoaderActor`, `ray::ConstructorActor`, ...), Ray's own daemons have their names (gcs_server,
raylet, dashboard, log_monitor, ...), and the processes the bench started itself are named by it
(`driver`, `trainer`, `node-host`, `server`). Every descendant of a started process is tracked, and so
is any process whose command line names the run's own temp dir (Ray's daemons and workers carry their
session dir there), so a process that detached from its parent is still counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import psutil

MIB = 2**20
# ray::<ClassName>[.method]: plait's actors by class; any other `ray::` process (idle workers, tasks) is Ray's.
ACTOR_ROLES = (("PlannerHostActor", "planner"), ("PlannerActor", "planner"), ("StandbyPlanner", "planner"),
               ("ShadowActor", "loader"), ("LoaderActor", "loader"), ("ConstructorActor", "constructor"),
               ("FlightServer", "constructor"))


def actor_role(cmdline: str) -> str | None:
    """The plait role of a Ray worker process from its title (None: not a plait actor)."""
    head = cmdline.split(" ", 1)[0]
    if not head.startswith("ray::"):
        return None
    # `ray::PlannerActor.step_plan`, or with the actor's name first: `ray::job-1d/planner:PlannerActor.__init__`
    name = head[len("ray::"):].rsplit(":", 1)[-1]
    for prefix, role in ACTOR_ROLES:
        if name.startswith(prefix):
            return role
    return None


def classify(cmdline: str, started: dict[int, str], pid: int) -> str:
    """The role of one process: named by the bench, a plait actor, or Ray's own."""
    if pid in started:
        return started[pid]
    return actor_role(cmdline) or "ray"


@dataclass
class Sampler:
    """Samples RSS and PSS (where the platform gives it) of every process of the run, summed per role.

    `started` maps the pids the bench launched to their roles; `marker` is a string (the run's temp dir)
    in the command line of every other process that belongs to the run."""

    started: dict[int, str]
    marker: str
    t0: float = field(default_factory=time.monotonic)
    samples: list[dict] = field(default_factory=list)  # {"t", "roles": {role: {"rss", "pss", "n"}}}
    pss_available: bool = True

    def processes(self) -> dict[int, tuple[psutil.Process, str]]:
        """Every live process of the run, with its role."""
        found: dict[int, tuple[psutil.Process, str]] = {}
        for pid in list(self.started):
            try:
                root = psutil.Process(pid)
                family = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for p in family:
                found.setdefault(p.pid, (p, ""))
        for p in psutil.process_iter(["pid", "cmdline"]):
            cmd = " ".join(p.info.get("cmdline") or [])
            if self.marker and self.marker in cmd:
                found.setdefault(p.pid, (p, ""))
        out = {}
        for pid, (p, _) in found.items():
            try:
                cmd = " ".join(p.cmdline()) or p.name()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            out[pid] = (p, classify(cmd, self.started, pid))
        return out

    def sample(self) -> dict:
        roles: dict[str, dict] = {}
        detail: dict[str, int] = {}
        for p, role in self.processes().values():
            try:
                if self.pss_available:
                    m = p.memory_full_info()
                    rss, pss = m.rss, getattr(m, "pss", None)
                else:
                    rss, pss = p.memory_info().rss, None
            except psutil.AccessDenied:
                self.pss_available = False
                continue
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
            r = roles.setdefault(role, {"rss": 0, "pss": 0, "n": 0})
            r["rss"] += rss
            r["pss"] = None if pss is None or r["pss"] is None else r["pss"] + pss
            r["n"] += 1
            if role == "ray":  # which of Ray's own processes grows: gcs_server, raylet, agents, idle workers
                name = ray_process_name(p)
                detail[name] = detail.get(name, 0) + rss
        s = {"t": time.monotonic() - self.t0, "roles": roles, "ray_processes": detail}
        self.samples.append(s)
        return s

    def left_alive(self) -> list[dict]:
        """The run's processes still alive (after it ended)."""
        return [{"pid": pid, "role": role, "cmdline": _cmd(p)[:200]} for pid, (p, role) in self.processes().items()
                if _alive(p)]


def ray_process_name(p: psutil.Process) -> str:
    """A short name for one of Ray's processes: its title (`ray::IDLE`, `ray::DashboardAgent`) or program
    (gcs_server, raylet, log_monitor.py, ...)."""
    try:
        args = p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "?"
    head = args[0].split(" ")[0] if args else p.name()
    if not head.startswith("ray::") and len(args) > 1 and head.rsplit("/", 1)[-1].startswith("python"):
        head = next((a for a in args[1:] if a.endswith(".py")), head)  # python .../log_monitor.py
    return head.rsplit("/", 1)[-1]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()) or p.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "?"


def slope_per_hour(t: np.ndarray, y: np.ndarray) -> float:
    """Least-squares slope of y (bytes) over t (seconds), in MiB per hour (nan under two samples)."""
    if len(t) < 2 or np.ptp(t) <= 0:
        return float("nan")
    return float(np.polyfit(t, y, 1)[0]) * 3600 / MIB


def band_slope_per_hour(t: np.ndarray, y: np.ndarray) -> float:
    """How fast the band y moves in, in MiB/hour (nan under six samples): the mean of its top's
    (maximum) and bottom's (minimum) drift from the first third of t to the last, per hour between them. A
    process whose buffers fill and are trimmed moves in a band (a sawtooth of +-10 MiB): a tooth at either
    end of a least-squares fit tilts it by MiB/hour, the band's edges do not move; steady growth moves
    both edges alike."""
    if len(t) < 6 or np.ptp(t) <= 0:
        return float("nan")
    third = (t[-1] - t[0]) / 3
    first, last = y[t <= t[0] + third], y[t >= t[-1] - third]
    drift = ((last.max() - first.max()) + (last.min() - first.min())) / 2
    return float(drift) / MIB / (2 * third / 3600)


def fit_figures(t: np.ndarray, y: np.ndarray) -> dict:
    """The figures a soak reads from one RSS series y (bytes) over t (seconds, the fit only), in MiB/hour:
    the least-squares slope, that slope over a day, its second half's slope alone (warm-up flattens
    there, growth does not) and the drift of its band's edges (`band_slope_per_hour`)."""
    late = t >= t[0] + (t[-1] - t[0]) / 2
    slope = slope_per_hour(t, y)
    return {"slope_mib_per_hour": round(slope, 2), "growth_mib_per_day": round(slope * 24, 1),
            "late_slope_mib_per_hour": round(slope_per_hour(t[late], y[late]), 2),
            "band_slope_mib_per_hour": round(band_slope_per_hour(t, y), 2)}


def fit_start(samples: list[dict], warmup_s: float) -> float:
    """Where the slopes start: `warmup_s` after the last role first appeared, i.e. after the whole data
    plane runs (Ray's Constructors start with the first build, minutes after the driver on a loaded
    machine; a fit that starts before them measures start-up, not growth). Falls back to `warmup_s` from
    the start when that would leave fewer than 3 samples."""
    first_seen: dict[str, float] = {}
    for s in samples:
        for role in s["roles"]:
            first_seen.setdefault(role, s["t"])
    start = max(first_seen.values(), default=0.0) + warmup_s
    return start if sum(s["t"] >= start for s in samples) >= 3 else warmup_s


def role_table(samples: list[dict], warmup_s: float) -> list[dict]:
    """Per role: RSS (and PSS) at the first and last sample of the fit (`fit_start`) and the
    `fit_figures` of its RSS over the fit; a role absent from a sample counts 0 there."""
    names = sorted({r for s in samples for r in s["roles"]}, key=_role_order)
    start = fit_start(samples, warmup_s)
    after = [s for s in samples if s["t"] >= start] or samples[-1:]
    t = np.array([s["t"] for s in after])
    out = []
    for name in names:
        rss = np.array([s["roles"].get(name, {}).get("rss", 0) for s in after], dtype=np.float64)
        pss_values = [s["roles"].get(name, {}).get("pss") for s in after]
        row = {"role": name, "processes": max(s["roles"].get(name, {}).get("n", 0) for s in after),
               "fit_from_s": round(float(t[0]), 1),
               "rss_start_mib": round(rss[0] / MIB, 1), "rss_end_mib": round(rss[-1] / MIB, 1),
               "rss_max_mib": round(rss.max() / MIB, 1), **fit_figures(t, rss), "samples": len(after)}
        if all(v is not None for v in pss_values):
            pss = np.array(pss_values, dtype=np.float64)
            row.update(pss_start_mib=round(pss[0] / MIB, 1), pss_end_mib=round(pss[-1] / MIB, 1),
                       pss_slope_mib_per_hour=round(slope_per_hour(t, pss), 2))
        out.append(row)
    return out


def ray_process_table(samples: list[dict], warmup_s: float) -> list[dict]:
    """Ray's own processes by name (summed over processes of one name), fitted as `role_table` does:
    which of them grows (the `ray` role is their sum)."""
    after = [s for s in samples if s["t"] >= fit_start(samples, warmup_s)] or samples[-1:]
    names = sorted({n for s in after for n in s.get("ray_processes", {})})
    t = np.array([s["t"] for s in after])
    out = []
    for name in names:
        rss = np.array([s.get("ray_processes", {}).get(name, 0) for s in after], dtype=np.float64)
        out.append({"name": name, "rss_start_mib": round(rss[0] / MIB, 1), "rss_end_mib": round(rss[-1] / MIB, 1),
                    "slope_mib_per_hour": round(slope_per_hour(t, rss), 2)})
    return out


ROLE_ORDER = ("driver", "trainer", "node-host", "server", "planner", "loader", "constructor", "ray")


def _role_order(name: str) -> tuple[int, str]:
    return (ROLE_ORDER.index(name) if name in ROLE_ORDER else len(ROLE_ORDER), name)
