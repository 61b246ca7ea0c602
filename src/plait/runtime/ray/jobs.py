"""A job's lifecycle on Ray, seen from the outside: joining a job by name, a trainer's heartbeat, closing
at interpreter exit, and listing and stopping jobs (`plait jobs`).

A job lives from its first trainer's start until
  * every trainer that attached has left (`Loader.close()`, the `with` block, its Loader garbage-collected,
    or interpreter exit: `Membership`), the last one ending the actors, or
  * every trainer left or stopped its heartbeat (killed, crashed: gone after two heartbeat intervals,
    plait.runtime.ray.liveness): the Planner ends the job itself, or
  * no trainer was seen for the job's `job_idle_timeout`: the Planner's idle watch ends the job, or
  * someone runs `plait jobs stop NAME` (`stop_job`).
Ending a job ends its Constructors, loaders and shadows, then its Planner; their object-store data goes
with them.
"""

from __future__ import annotations

import atexit
import json
import os
import tempfile
import threading
import time
import weakref

from plait.errors import PlaitError
from plait.runtime.ray.common import NAMESPACE, dead_errors, get, job_of, planner_name, ray_module, use_auth_mode
from plait.runtime.ray.liveness import LIVENESS_GROUP, JobNameTaken
from plait.runtime.ray.recovery_news import RecoveryNews

ATTACH_WAIT_S = 120.0  # how long attach=True waits for the job (and its local instance) to appear: ranks start
# unevenly, and a local Ray instance alone took 24 s to start on a loaded 2-core machine
LEFTOVER_WAIT_S = 60.0  # how long a new job waits for an ended job of its name to lose its last actors


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


class Membership:
    """This trainer process's place in job `job`: its token, its heartbeat, and leaving the job (`close()`,
    its runtime garbage-collected, or interpreter exit), the last one out ending the job's actors.

    It holds no reference to its runtime, so a runtime dropped without `close()` is still finalized
    (`leave_when_dropped`). `planner` is the current handle (the runtime replaces it when a dead Planner
    is succeeded or recreated)."""

    def __init__(self, job: str, token: str):
        self.job, self.token = job, token
        self.planner = None
        self.lock = threading.Lock()
        self.left = False
        self.heartbeat: Heartbeat | None = None
        self.news = RecoveryNews(job)  # the job's recoveries, told in this process's log

    def start_heartbeat(self, planner, interval: float) -> None:
        self.planner = planner
        self.heartbeat = Heartbeat(self, interval)
        self.heartbeat.start()
        ATTACHED.add(self)
        register_exit_hook()

    def leave(self, timeout: float = 30.0) -> int | None:
        """Detach from the job (once; later calls wait for the first); the last trainer out ends the job.
        The number of trainers left, None when the job could not be told (Ray or the job gone)."""
        with self.lock:
            if self.left:
                return None
            self.left = True
            try:
                if self.heartbeat is not None:
                    self.heartbeat.stop()
                return self._detach(timeout)
            finally:
                ATTACHED.discard(self)

    def _detach(self, timeout: float) -> int | None:
        ray = ray_module()
        if self.planner is None or not ray.is_initialized():  # Ray is gone: a call now would start a new one
            return None
        try:
            try:
                left = get(self.planner.detach.remote(self.token), timeout=timeout)
            except dead_errors():  # a successor (plait.runtime.ray.standby_planner) is found by the job's name
                self.planner = find_planner(self.job, wait=0)
                left = get(self.planner.detach.remote(self.token), timeout=timeout)
            if left <= 0:
                get(self.planner.shutdown.remote(), timeout=2 * timeout)
                ray.kill(self.planner)
            return left
        except Exception:  # noqa: BLE001 - best effort: the job's heartbeat watch ends it all the same
            return None


class Heartbeat(threading.Thread):
    """Tells the job's Planner, every `period` seconds, that this trainer process is alive (so a long
    evaluation or checkpoint does not count as idle, and the process is not taken for dead: see
    plait.runtime.ray.liveness). Heard on the Planner's own liveness thread. Stops with `stop()`, when
    its Membership leaves, or with the process."""

    def __init__(self, member: Membership, period: float):
        super().__init__(name="plait-heartbeat", daemon=True)
        self.member = member
        self.period = period
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.period):
            try:
                self.beat(self.member.planner)
            except dead_errors():  # a successor (plait.runtime.ray.standby_planner) is found by the job's name
                try:
                    # kept: else every later beat first fails on the dead handle and looks the successor up
                    # again, a ray.get_actor whose actor class the driver deserializes and keeps each time
                    # (a soak's tracemalloc saw those lookups pile up in the driver)
                    self.member.planner = find_planner(self.member.job, wait=0)
                    self.beat(self.member.planner)
                except Exception:  # noqa: BLE001 - none yet: the driver's calls find out
                    pass
            except Exception:  # noqa: BLE001 - a busy Planner: the driver's calls find out
                pass

    def beat(self, planner) -> None:
        news = self.member.news
        answer = get(planner.touch.options(concurrency_group=LIVENESS_GROUP).remote(self.member.token,
                                                                                    news.heard_from(planner)),
                     timeout=max(self.period, 5.0))
        news.hear(planner, *answer)

    def stop(self) -> None:
        self.stopped.set()


def heartbeat_period(info: dict, default: float) -> float:
    """Seconds between heartbeats: the job's interval, and well inside its idle timeout when it has one."""
    period = float(info.get("heartbeat_interval") or default)
    idle = info.get("idle_timeout")
    return min(period, max(float(idle) / 4, 0.05)) if idle else period


def join(recipe, dp: int, creator: str, attach: bool, member: Membership, run: int = 0,
         joins_after: float | None = None):
    """Attach `member` to job `recipe.job` and return its Planner: find it (attach=True, waiting for another
    process to start it) or create it. A job of that name whose trainers stopped (a restart after a crash,
    under the same name) is waited for until it has ended (JobNameTaken says how long), then started again;
    a joiner of a later torchrun restart (`run`), or of a later launch (`joins_after`), does not join the
    earlier one's job meanwhile."""
    deadline = None
    while True:
        try:
            if not attach:
                wait_for_leftovers(recipe.job)
            planner = find_planner(recipe.job) if attach else recipe.start()
            get(planner.attach.remote(recipe.fingerprint, dp, creator, attach, member.token, run, joins_after))
            return planner
        except JobNameTaken as e:
            deadline = deadline or time.monotonic() + e.wait_s
            if time.monotonic() >= deadline:
                raise
        except dead_errors():  # that job ended between finding it and attaching: start or find it again
            deadline = deadline or time.monotonic() + ATTACH_WAIT_S
            if time.monotonic() >= deadline:
                raise PlaitError(f"job {recipe.job!r} kept ending while this trainer attached; try again") from None
        time.sleep(0.2)


def wait_for_leftovers(job: str, timeout: float = LEFTOVER_WAIT_S) -> None:
    """Before creating job `job`: wait until no actor of an earlier job of that name is left without its
    Planner (an ended job's loaders and Constructors are killed asynchronously, after its Planner's name may
    already be free). A new Planner would otherwise find such a dying loader by its name, adopt it, and
    replace it a moment later. A live job (its Planner among the names) is left to the Planner's `attach`."""
    deadline = time.monotonic() + timeout
    while True:
        names = actor_names_by_job().get(job, [])
        if not names or planner_name(job) in names:
            return
        if time.monotonic() >= deadline:
            raise PlaitError(f"job {job!r} ended but {len(names)} of its actors are still alive after {timeout:.0f} s "
                             f"({', '.join(sorted(names)[:4])}): `plait jobs stop {job}` ends them")
        time.sleep(0.1)


# ----- torchrun: one job name, rank 0 creates it, the others attach -----------------------------------
def torchrun_options(rank: int, options: dict) -> dict:
    """The ray runtime's options for global `rank` of a torchrun job: one job name for every rank (default:
    torchrun's run id, else its master address and port), rank 0 creates the job, the others attach (and
    wait for it to appear), only to a job started by this launch (`joins_after`)."""
    out = dict(options)
    if not out.get("job"):
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        key = run_id if run_id not in ("", "none") else (f"{os.environ.get('MASTER_ADDR', 'local')}-"
                                                         f"{os.environ.get('MASTER_PORT', '0')}")
        out["job"] = f"torchrun-{key}"
    if "attach" not in out:
        out["attach"] = rank > 0
        if rank > 0:  # not the job a crashed earlier launch of that name left (it ends by itself)
            out.setdefault("joins_after", process_started(os.getpid()))
    return out


def address_file(job: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"plait-ray-{job.replace('/', '_')}.json")


def publish_local_instance(job: str) -> None:
    """The creator of job `job` started a local Ray instance: say where, for the job's other trainer
    processes on this machine (attach=True without an address), and who said it (this process: a file
    its crash leaves behind is known stale by its owner being gone)."""
    ray = ray_module()
    path = address_file(job)
    with open(path + ".tmp", "w") as f:
        json.dump({"address": ray.get_runtime_context().gcs_address, "pid": os.getpid(),
                   "pid_started": process_started(os.getpid()),
                   "auth_mode": os.environ.get("RAY_AUTH_MODE", "token")}, f)
    os.replace(path + ".tmp", path)


def unpublish_local_instance(job: str) -> None:
    try:
        os.remove(address_file(job))
    except OSError:
        pass


def process_started(pid: int) -> float | None:
    """When process `pid` started (epoch seconds), None when there is no such process: with the pid, it
    names one process (a pid is reused, its start time is not)."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def read_published(job: str) -> dict | None:
    """What job `job`'s creator on this machine published, None when nothing is, or when what is there
    was left by a creator that is gone (a crashed launch: its instance went with it)."""
    try:
        with open(address_file(job)) as f:
            found = json.load(f)
        address = found["address"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    owner = found.get("pid")
    if owner is not None and process_started(int(owner)) != found.get("pid_started"):
        return None
    return found if isinstance(address, str) else None


def local_instance_address(job: str, wait: float = ATTACH_WAIT_S) -> str:
    """The address of the local Ray instance job `job`'s creator started on this machine, waiting up to
    `wait` seconds for it (a relaunch's creator replaces what a crashed one left); a PlaitError when none
    appears. Its authentication mode becomes this process's, before Ray is imported (common.use_auth_mode)."""
    deadline = time.monotonic() + wait
    while True:
        found = read_published(job)
        if found is not None:
            use_auth_mode(found.get("auth_mode", "token"))  # its token file (~/.ray/auth_token) is shared
            return found["address"]
        if time.monotonic() >= deadline:
            stale = os.path.exists(address_file(job))
            raise PlaitError(f"no trainer process on this machine started job {job!r} (waited {wait:.0f} s"
                             + ("; what a crashed one left is ignored" if stale else "") +
                             "): pass address= (the Ray cluster) on every rank, or start rank 0 too") from None
        time.sleep(0.1)


# ----- leaving at garbage collection and at interpreter exit ------------------------------------------
OPEN = weakref.WeakSet()  # runtimes not yet closed, closed at interpreter exit
ATTACHED: set = set()  # memberships not yet left (also those whose runtime was dropped without close())


def leave_when_dropped(runtime, member: Membership) -> None:
    """When `runtime` is garbage-collected without `close()`, `member` leaves its job (on a thread of its
    own: a finalizer may run inside any call); at exit, `close_open_runtimes` waits for it."""
    finalizer = weakref.finalize(runtime, start_leaving, member)
    finalizer.atexit = False  # at exit close_open_runtimes runs first, while Ray still answers


def start_leaving(member: Membership) -> None:
    threading.Thread(target=member.leave, name="plait-leave", daemon=True).start()


def close_at_exit(runtime) -> None:
    """Close `runtime` (anything with `close()`) at interpreter exit, if it is still open then."""
    OPEN.add(runtime)
    register_exit_hook()


def register_exit_hook() -> None:
    """(Re-)registered after `import ray`, so it runs before Ray's own exit hook (atexit runs
    last-registered first) while Ray can still reach the job's actors."""
    atexit.unregister(close_open_runtimes)
    atexit.register(close_open_runtimes)


def closed(runtime) -> None:
    OPEN.discard(runtime)


def close_open_runtimes() -> None:
    """At exit: close the runtimes still open, then leave every job this process still belongs to."""
    for runtime in list(OPEN):
        try:
            runtime.close()
        except Exception:  # noqa: BLE001 - at exit, best effort; Ray may be gone already
            pass
    for member in list(ATTACHED):
        member.leave(timeout=10.0)


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
    rows, asked = [], {}
    for job, names in sorted(actor_names_by_job().items()):
        rows.append({"job": job, "state": "running", "named_actors": len(names)})
        if planner_name(job) not in names:
            rows[-1]["state"] = "no planner"
            continue
        try:  # every job asked at once: the answers take one job's time, not the sum of them
            asked[len(rows) - 1] = ray.get_actor(planner_name(job), namespace=NAMESPACE).job_info.remote()
        except ValueError:
            rows[-1]["state"] = "not answering"
    deadline = time.monotonic() + timeout
    for i, ref in asked.items():
        try:
            rows[i].update(get(ref, timeout=max(0.0, deadline - time.monotonic())))
        except (ray.exceptions.GetTimeoutError, *dead_errors()):
            rows[i]["state"] = "not answering"
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
