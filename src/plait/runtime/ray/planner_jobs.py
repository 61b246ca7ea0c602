"""Who uses a job's Planner, and when the job ends for lack of them.

`JobPresence` is the Planner actor's side of a job's lifetime: the trainer processes attached (by heartbeat
token: plait.runtime.ray.liveness.TrainerRoster), the Constructors started for it, when a trainer was last
seen. It is one of the Planner's request observers (plait.runtime.ray.planner_requests): every trainer's
request counts as seen there, at one place, instead of each Planner method noting it. With
`job_idle_timeout`, an `IdleWatch` thread ends the whole job when no trainer was seen for that long; a
`RosterWatch` ends it when every trainer that attached detached or stopped beating.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from plait.errors import PlaitError
from plait.runtime.ray.common import NAMESPACE, ray_module
from plait.runtime.ray.liveness import JobNameTaken, RosterWatch, TrainerRoster
from plait.runtime.ray.planner_reports import job_memory
from plait.runtime.ray.planner_requests import CONSTRUCTOR, MEMBERS, Request, planner_call

job_log = logging.getLogger("plait.jobs")
# A launch's ranks start together (torchrun spawns them at once, after its rendezvous) and its creator needs
# seconds to start the job: a job started more than this before a joiner's process is an earlier launch's
# (the clocks of a cluster's machines agree far better than this).
LAUNCH_SKEW_S = 2.0
LAUNCH_WAIT_S = 60.0  # after an earlier launch's job ends, how long its joiner waits for its own creator's


class JobPresence:
    """The attached trainers and Constructors of job `job`, and when a trainer was last seen."""

    def __init__(self, job: str, options: dict):
        self.job = job
        self.trainers = TrainerRoster(options.get("heartbeat_interval"), options.get("run", 0))
        self.constructors: set[str] = set()
        self.started = time.time()
        self.creator = options.get("creator")  # the client whose start made this actor (attach=False)
        self.last_seen = time.monotonic()  # the last call of a trainer (or its heartbeat)
        self.idle_timeout = options.get("job_idle_timeout")

    def watch(self, end_job: Callable[[str], None]) -> None:
        """Start the threads that end the job (`end_job(why)`) when it is idle or abandoned."""
        if self.idle_timeout:
            IdleWatch(self.idle_timeout, lambda: self.last_seen, lambda: end_job(self.idle_reason())).start()
        RosterWatch(self.trainers, lambda: end_job("its trainers detached or stopped")).start()

    def idle_reason(self) -> str:
        return f"no trainer seen for {time.monotonic() - self.last_seen:.0f} s (job_idle_timeout)"

    # ----- a request observer (plait.runtime.ray.planner_requests) ------------------------------------
    def on_planned(self, plans) -> None:
        """Planning says nothing about who uses the job."""

    def on_request(self, request: Request) -> None:
        if request.trainer:
            self.seen()

    def seen(self) -> None:
        self.last_seen = time.monotonic()

    # ----- trainers and Constructors ------------------------------------------------------------------
    def attach(self, checks: dict, creator: str | None, joining: bool, trainer: str | None, run: int,
               joins_after: float | None = None) -> int:
        """Trainer process `trainer` (its heartbeat token) joins; `checks` are the Planner's refusals
        ({message: refused?}: another spec, another topology). `joining=False` (a client that means to
        create the job, token `creator`) is refused unless this very actor was started by it: a live job's
        name is not reused silently (plait.runtime.ray.liveness.JobNameTaken says how long until it ends).
        A joiner of a launch (`joins_after`: when its process started) is refused by a job started before
        that: a crashed launch's job, still waiting for its trainers' heartbeats to stop, which the joiner
        would keep alive, its own launch's creator then refused by it."""
        if not joining and creator != self.creator:
            self.trainers.refuse_creator(self.job, format_age(time.time() - self.started))
        if joining and joins_after is not None and self.started < joins_after - LAUNCH_SKEW_S:
            raise JobNameTaken(f"job {self.job!r} was started {format_age(joins_after - self.started)} before this "
                               "trainer's process: an earlier launch's job, not yet ended (this launch's rank 0 "
                               "starts the job again once it has)",
                               wait_s=self.trainers.gone_after + self.trainers.interval + LAUNCH_WAIT_S)
        self.trainers.check_run(self.job, run)  # a later torchrun restart does not join the previous run's job
        for message, refused in checks.items():
            if refused:
                raise PlaitError(message)
        return self.trainers.add(trainer)

    def touch(self, trainer: str | None) -> None:
        """A trainer's heartbeat: the job is in use, `trainer` alive."""
        self.seen()
        self.trainers.touch(trainer)

    def detach(self, trainer: str | None) -> int:
        return self.trainers.remove(trainer)

    def restore(self, meta: dict) -> None:
        """A successor continues the dead Planner's trainers and Constructors (the standby's facts)."""
        tokens = meta.get("trainers", ())
        self.trainers.restore(tokens, anonymous=int(meta.get("clients", 0)) - len(tokens))
        self.constructors = set(meta.get("constructors", ()))
        self.started = float(meta.get("started", self.started))

    def facts(self) -> dict:
        """What a successor needs to know of them (the standby keeps it)."""
        return {"clients": self.trainers.count, "trainers": self.trainers.tokens(),
                "constructors": sorted(self.constructors), "started": self.started}

    def info(self) -> dict:
        """The lifetime part of what `plait jobs` shows."""
        return {"job": self.job, "started": self.started, "clients": self.trainers.count,
                "idle_s": time.monotonic() - self.last_seen, "idle_timeout": self.idle_timeout}


class LifetimeRequests:
    """The Planner actor's requests about the job's lifetime: trainers attach, beat and detach, the job
    ends (a part of plait.runtime.ray.planner_actor's PlannerActor, which holds `presence`, `planner`,
    `standby`, `layouts`, `metrics`, `lock` and `observers`)."""

    presence: JobPresence

    @planner_call(MEMBERS)
    def attach(self, fingerprint: str, ranks: int | None = None, creator: str | None = None,
               joining: bool = True, trainer: str | None = None, run: int = 0, joins_after: float | None = None) -> int:
        """Trainer process `trainer` (its heartbeat token) joins the job (planner_jobs.JobPresence.attach)."""
        job, own = self.job, self.planner.ranks
        checks = {f"job {job!r} runs a different spec (data fingerprint differs)":
                  fingerprint != self.spec.data_fingerprint(),
                  f"job {job!r} plans for {own} DP ranks, this client's topology has {ranks}: every trainer "
                  "process of a job must use the same spec and layout": ranks is not None and ranks != own}
        return self.presence.attach(checks, creator, joining, trainer, run, joins_after)

    def touch(self, trainer: str | None = None, heard: int = 0) -> tuple[int, list[dict]]:
        """A trainer's heartbeat (on the LIVENESS_GROUP thread, beside planning: not a locked request).
        Answers with the job's recovery events after the first `heard` (all of them when there are fewer:
        a new Planner's) and how many there are, for the trainer to tell in its own log
        (plait.runtime.ray.recovery_news). Read without the lock: a beat never waits for planning."""
        self.presence.touch(trainer)
        events = list(self.loaders.events)
        return len(events), events[heard:] if heard <= len(events) else events

    @planner_call(CONSTRUCTOR)
    def register_constructor(self, name: str) -> None:
        self.presence.constructors.add(name)

    @planner_call(MEMBERS)
    def detach(self, trainer: str | None = None) -> int:
        return self.presence.detach(trainer)

    @planner_call()
    def shutdown(self) -> None:
        """End the job's Constructors, loaders and shadows (the caller then ends this actor)."""
        ray = ray_module()
        self.standby.close()  # first: nobody must take over from a Planner that ends
        if self.layouts.control is not None:
            self.layouts.control.stop()
        for name in self.presence.constructors:
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE))
            except Exception:  # noqa: BLE001
                pass
        self.layouts.close()

    def _end_job(self, why: str) -> None:
        """The job is idle or abandoned (`why`): end it, this actor last."""
        job_log.warning("job %r: %s: ending it", self.job, why)
        try:
            self.shutdown()
        finally:
            ray = ray_module()
            ray.kill(ray.get_runtime_context().current_actor)

    @planner_call()
    def job_info(self) -> dict:
        """What `plait jobs` shows (not a trainer's call: it does not keep the job alive)."""
        return {**self.presence.info(), "step": self.planner.step, "metrics": self.metrics.address, **self.memory()}

    @planner_call()
    def memory(self) -> dict:
        """Resident memory of the job's actors (each measures itself), in bytes, and how many answered."""
        handles = list(self.loaders.handles) + [sh for group in self.loaders.shadows for sh in group]
        return job_memory(handles + self.standby.handles(), list(self.presence.constructors))


def format_age(seconds: float) -> str:
    """`42 s`, `7 min`, `3.5 h`, `2.1 d`."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


class IdleWatch(threading.Thread):
    """A daemon thread of the Planner actor: calls `on_idle()` once, when `last_seen()` (a monotonic time)
    is more than `timeout` seconds ago."""

    def __init__(self, timeout: float, last_seen, on_idle):
        super().__init__(name="plait-idle-watch", daemon=True)
        self.timeout = float(timeout)
        self.last_seen = last_seen
        self.on_idle = on_idle

    def run(self) -> None:
        period = min(max(self.timeout / 8, 0.1), 10.0)
        while True:
            time.sleep(period)
            if time.monotonic() - self.last_seen() > self.timeout:
                self.on_idle()
                return
