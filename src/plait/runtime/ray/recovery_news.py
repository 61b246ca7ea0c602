"""The job's recoveries, told in each trainer's own log.

A loader replaced, a shadow restarted, a Planner taken over: the actor that recovered logs it, but an
actor's log is a file on some node of the cluster that a user rarely reads. Each trainer process hears of
them with its heartbeat (the Planner answers a beat with the recovery events the trainer has not heard of yet:
usually none) and logs each new one once, on the `plait.recovery` logger (WARNING: shown without any logging set up).
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("plait.recovery")
TOLD_KEPT = 1024  # events remembered as told (a job's recoveries are few; bounded all the same)


def describe(job: str, event: dict) -> str | None:
    """One line for a recovery event of job `job` (plait.runtime.ray.recovery), None for routine ones."""
    role, step = event.get("role"), event.get("step")
    at = f" at step {step}" if step is not None else ""
    took = f" in {event['recovery_s']:.2f} s" if event.get("recovery_s") is not None else ""
    if role == "loader":
        return (f"job {job!r}: SourceLoader {event.get('actor')} died{at}; replaced by {event.get('replacement')} "
                f"({event.get('how')}){took}")
    if role == "planner" and event.get("how") == "standby":
        return (f"job {job!r}: the Planner died; its standby's successor took over{at} (re-plans from step "
                f"{event.get('from_step')}: the same stream)")
    if role == "planner":
        return f"job {job!r}: the Planner died{at}; recreated from the data state of step {event.get('from_step')}{took}"
    if role == "constructor":
        return f"job {job!r}: a Constructor died{at}; recreated{took}, it rebuilds for ranks {event.get('ranks')}"
    if role == "shadow":
        return f"job {job!r}: a shadow of SourceLoader {event.get('actor')} died{at}; a new one starts a few steps later"
    if role == "stray-loaders":
        return (f"job {job!r}: the new Planner ended {len(event.get('actors', ()))} loader actor(s) it does not use: "
                f"{', '.join(event.get('actors', ()))}")
    return None


class RecoveryNews:
    """What this trainer process has told of job `job`'s recoveries (each event once)."""

    def __init__(self, job: str):
        self.job = job
        self.planner = None  # the Planner heard from last, and how many of its events this process has had
        self.heard = 0
        self.told: dict[tuple, None] = {}
        self.lock = threading.Lock()

    def heard_from(self, planner) -> int:
        """How many of `planner`'s events this process has had (none of a new Planner's: it keeps its own)."""
        return self.heard if planner == self.planner else 0

    def hear(self, planner, count: int, events: list[dict]) -> None:
        """A heartbeat's answer: `planner` holds `count` recovery events, `events` the ones not yet heard."""
        self.planner, self.heard = planner, int(count)
        for event in events:
            self.tell(event)

    def tell(self, event: dict) -> None:
        """Log `event` unless told already (the driver's own recoveries come here too). An event without
        its time is a reference to one told where it happened (a late caller's view of a takeover)."""
        if event.get("at") is None:
            return
        key = (event.get("role"), str(event.get("actor")), event.get("at"))
        with self.lock:
            if key in self.told:
                return
            self.told[key] = None
            while len(self.told) > TOLD_KEPT:
                self.told.pop(next(iter(self.told)))
        line = describe(self.job, event)
        if line is not None:
            log.warning("%s", line)
