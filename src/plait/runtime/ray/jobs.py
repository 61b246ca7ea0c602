"""A job's lifecycle on Ray, seen from the outside: joining a job by name, a trainer's heartbeat, closing
at interpreter exit, and listing and stopping jobs (`plait jobs`).

A job lives from its first trainer's start until
  * every trainer that attached has closed (`Loader.close()`, the `with` block, or interpreter exit:
    `close_at_exit`), the last one ending the actors (plait.runtime.ray.runtime.RayRuntime.close), or
  * no trainer was seen for the job's `job_idle_timeout` (a trainer killed without closing): the
    Planner's idle watch ends the job (plait.runtime.ray.planner_actor), or
  * someone runs `plait jobs stop NAME` (`stop_job`).
Ending a job ends its Constructors, loaders and shadows, then its Planner; their object-store data goes
with them.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref

from plait.errors import PlaitError
from plait.runtime.ray.common import NAMESPACE, dead_errors, get, job_of, planner_name, ray_module

ATTACH_WAIT_S = 30.0  # how long attach=True waits for the job's Planner to appear (ranks start unevenly)


def find_planner(job: str, wait: float = ATTACH_WAIT_S):
    """The handle of job `job`'s Planner actor, waiting up to `wait` seconds for another trainer process
    to start it; a PlaitError when none appears."""
    ray = ray_module()
    deadline = time.monotonic() + wait
    while True:
        try:
            return ray.get_actor(planner_name(job), namespace=NAMESPACE)
        except ValueError:
            if time.monotonic() >= deadline:
                raise PlaitError(f"no job named {job!r} is running (waited {wait:.0f} s for it to start): "
                                 "attach=True joins a job another trainer process created; drop it to "
                                 "create the job") from None
            time.sleep(0.1)


class Heartbeat(threading.Thread):
    """Tells the job's Planner, every `period` seconds, that this trainer process is alive (so a long
    evaluation or checkpoint does not count as idle). `runtime.planner` is the current handle (it changes
    when a dead Planner is recreated); the runtime is held weakly: one dropped without `close()` stops
    the heartbeat, and its job then ends after its idle timeout. Stops with `stop()` or the process."""

    def __init__(self, runtime, period: float):
        super().__init__(name="plait-heartbeat", daemon=True)
        self.runtime = weakref.ref(runtime)
        self.period = period
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.period):
            runtime = self.runtime()
            if runtime is None:
                return
            planner, job, runtime = runtime.planner, runtime.job, None
            try:
                get(planner.touch.remote(), timeout=max(self.period, 5.0))
            except dead_errors():  # a successor (plait.runtime.ray.standby_planner) is found by the job's name
                try:
                    get(find_planner(job, wait=0).touch.remote(), timeout=max(self.period, 5.0))
                except Exception:  # noqa: BLE001 - none yet: the driver's calls find out
                    pass
            except Exception:  # noqa: BLE001 - a busy Planner: the driver's calls find out
                pass

    def stop(self) -> None:
        self.stopped.set()


def heartbeat_period(idle_timeout: float | None) -> float | None:
    """A heartbeat well inside the idle timeout (None: no timeout, no heartbeat)."""
    if not idle_timeout:
        return None
    return min(max(float(idle_timeout) / 4, 0.1), 30.0)


# ----- interpreter exit -------------------------------------------------------------------------------
OPEN = weakref.WeakSet()  # runtimes not yet closed, closed at interpreter exit


def close_at_exit(runtime) -> None:
    """Close `runtime` (anything with `close()`) at interpreter exit, if it is still open then.

    The hook is (re-)registered after `import ray`, so it runs before Ray's own exit hook (atexit runs
    last-registered first) while Ray can still reach the job's actors."""
    OPEN.add(runtime)
    atexit.unregister(close_open_runtimes)
    atexit.register(close_open_runtimes)


def closed(runtime) -> None:
    OPEN.discard(runtime)


def close_open_runtimes() -> None:
    for runtime in list(OPEN):
        try:
            runtime.close()
        except Exception:  # noqa: BLE001 - at exit, best effort; Ray may be gone already
            pass


# ----- listing and stopping jobs (plait jobs) -----------------------------------------------------------
def actor_names_by_job() -> dict[str, list[str]]:
    """The named actors of NAMESPACE, by job."""
    ray = ray_module()
    out: dict[str, list[str]] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        job = job_of(entry["name"]) if entry.get("namespace") == NAMESPACE else None
        if job is not None:
            out.setdefault(job, []).append(entry["name"])
    return out


def list_jobs(timeout: float = 30.0) -> list[dict]:
    """One row per live job: `job`, `started` (epoch seconds), `clients`, `idle_s`, `idle_timeout`, `rss`
    (bytes, summed over the actors that answered), `actors`; a job whose Planner does not answer (or is
    gone, leaving named actors behind) has `state` "no planner" and what is known."""
    ray = ray_module()
    rows = []
    for job, names in sorted(actor_names_by_job().items()):
        row = {"job": job, "state": "running", "named_actors": len(names)}
        if planner_name(job) in names:
            try:
                row.update(get(ray.get_actor(planner_name(job), namespace=NAMESPACE).job_info.remote(),
                               timeout=timeout))
            except (ValueError, ray.exceptions.GetTimeoutError, *dead_errors()):
                row["state"] = "not answering"
        else:
            row["state"] = "no planner"
        rows.append(row)
    return rows


def stop_job(job: str, timeout: float = 60.0) -> int:
    """End job `job`: its Constructors, loaders and shadows (by its Planner), its Planner, then any named
    actor of it left over; waits until their names are free. Returns how many named actors it ended; a
    PlaitError when no such job runs."""
    ray = ray_module()
    names = actor_names_by_job().get(job)
    if not names:
        raise PlaitError(f"no job named {job!r} is running (`plait jobs` lists them)")
    if planner_name(job) in names:
        planner = ray.get_actor(planner_name(job), namespace=NAMESPACE)
        try:
            get(planner.shutdown.remote(), timeout=timeout)
        except Exception:  # noqa: BLE001 - a dead or stuck Planner: killed below all the same
            pass
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except ValueError:
            pass
    deadline = time.monotonic() + timeout
    while actor_names_by_job().get(job) and time.monotonic() < deadline:
        time.sleep(0.1)
    return len(names)
