"""Which trainer processes a job still has, as its Planner sees them: each attached process has a token
and a heartbeat; one whose heartbeat stopped for two intervals (killed, crashed, its node lost) is gone.

A job whose trainers are all gone ends by itself within seconds (`RosterWatch`), instead of waiting for
its `job_idle_timeout`; a trainer that restarts under the job's name waits for that (`JobNameTaken`
tells it how long) and then starts the job again from its saved state.
"""

from __future__ import annotations

import threading
import time

from plait.errors import PlaitError

HEARTBEAT_INTERVAL_S = 5.0  # default: a trainer killed without close() frees its job about 10 s later
MISSED_BEATS = 2  # a trainer not heard from for this many intervals is gone
LIVENESS_GROUP = "liveness"  # the Planner's concurrency group for heartbeats: a busy Planner still hears them


class JobNameTaken(PlaitError):
    """A job of this name still has live trainers. The actor says only that (`plain`); who started the new
    one (a Loader, `plait serve`) adds what to do about it, in its own terms. `wait_s`: how long until its
    trainers would count as gone."""

    def __init__(self, message: str, wait_s: float = 0.0, plain: str | None = None):
        super().__init__(message)
        self.wait_s = wait_s
        self.plain = plain or message

    def __reduce__(self):  # crosses Ray's process boundary with its wait and plain wording
        return (type(self), (str(self), self.wait_s, self.plain))


class TrainerRoster:
    """The trainer processes attached to a job, by token, with when each was last heard from.

    Thread-safe: heartbeats arrive on the Planner's liveness thread, attach/detach on its main one."""

    def __init__(self, interval: float | None, run: int = 0):
        self.interval = float(interval or HEARTBEAT_INTERVAL_S)
        self.run = int(run)  # the torchrun restart its creator belongs to (TORCHELASTIC_RESTART_COUNT)
        self.gone_after = MISSED_BEATS * self.interval
        self.seen: dict[str, float] = {}
        self.anonymous = 0  # attached without a token (a recreated Planner's first call)
        self.had_trainers = False
        self.ending = False
        self.lock = threading.Lock()

    @property
    def count(self) -> int:
        return len(self.seen) + self.anonymous

    def add(self, token: str | None) -> int:
        with self.lock:
            if self.ending:
                raise JobNameTaken("the job is ending (its trainers stopped); start it again", wait_s=1.0)
            if token is None:
                self.anonymous += 1
            else:
                self.seen[token] = time.monotonic()
            self.had_trainers = True
            return self.count

    def touch(self, token: str | None) -> None:
        """A heartbeat; an unknown token (a successor Planner, a recreated one) joins the roster."""
        if token is None:
            return
        with self.lock:
            if self.ending:
                return
            if token not in self.seen and self.anonymous:  # the one a recreated Planner counted unnamed
                self.anonymous -= 1
            self.seen[token] = time.monotonic()
            self.had_trainers = True

    def remove(self, token: str | None) -> int:
        with self.lock:
            if token is None or token not in self.seen:
                self.anonymous = max(0, self.anonymous - 1)
            else:
                del self.seen[token]
            return self.count

    def tokens(self) -> list[str]:
        with self.lock:
            return list(self.seen)

    def restore(self, tokens, anonymous: int = 0) -> None:
        """A successor's start: the dead Planner's trainers, each heard from now."""
        with self.lock:
            now = time.monotonic()
            self.seen = {t: now for t in tokens}
            self.anonymous = int(anonymous)
            self.had_trainers = self.had_trainers or bool(self.seen or self.anonymous)

    def abandoned(self) -> bool:
        """Drop trainers not heard from for `gone_after`; True (once) when none is left of a job that had
        some, the roster then refusing newcomers: the job ends."""
        with self.lock:
            now = time.monotonic()
            self.seen = {t: at for t, at in self.seen.items() if now - at <= self.gone_after}
            if self.ending or not self.had_trainers or self.anonymous or self.seen:
                return False
            self.ending = True
            return True

    def refuse_creator(self, job: str, started_ago: str) -> None:
        """Another client means to create job `job`: refuse, saying how long until its trainers would be gone
        (a restart after a crash waits that long, then starts the job again)."""
        with self.lock:
            now = time.monotonic()
            last = max(self.seen.values(), default=now)
            n = self.count
        wait = max(0.0, self.gone_after - (now - last)) + self.interval
        raise JobNameTaken(f"a job named {job!r} is running ({n} trainer{'' if n == 1 else 's'} attached, started "
                           f"{started_ago} ago)", wait_s=wait)


    def check_run(self, job: str, run: int) -> None:
        if run > self.run:
            raise JobNameTaken(f"job {job!r} is left from an earlier run (torchrun restart {self.run}); this trainer "
                               f"(restart {run}) waits for it to end", wait_s=self.gone_after + self.interval)


class RosterWatch(threading.Thread):
    """A daemon thread of the Planner actor: calls `on_abandoned()` once, when every trainer of the job
    has detached or stopped its heartbeat."""

    def __init__(self, roster: TrainerRoster, on_abandoned):
        super().__init__(name="plait-roster-watch", daemon=True)
        self.roster = roster
        self.on_abandoned = on_abandoned

    def run(self) -> None:
        period = min(max(self.roster.interval / 4, 0.05), 5.0)
        while True:
            time.sleep(period)
            if self.roster.abandoned():
                self.on_abandoned()
                return
