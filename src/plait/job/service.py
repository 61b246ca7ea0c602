"""`JobService`: one job's shared stream, served rank by rank (plan -> build -> serve), without Ray.

It composes the two halves of a job's service: the plan stream (job.plan_stream: every step planned once
for all ranks in a bounded window, generations, states, the one waiting rule with job.consumers as who is
slowest) and the rank builds (job.rank_builds: each (step, DP rank) built once a few steps ahead on a small
pool of threads, served cut to the asking CP rank), the builds asking the stream in process. The runtimes
wrap it: `plait serve --runtime local` and the node-shared data plane (plait.runtime.serve_local,
plait.runtime.node_share) put a Flight server in front of it; plait.runtime.local serves a trainer's own
process (and `plait run`) through it. The Ray actors compose the same halves (plait.runtime.ray).

The roles run in this process (`JobRoles`: plait.runtime.local.LocalRoles). Locks: the stream's lock
guards the window and the Planner (planning is serialised); the roles guard their SourceLoader themselves
during a build's gather, so the packing of different ranks' builds overlaps.
"""

from __future__ import annotations

import os
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from plait.batch import MicroBatch
from plait.job.builds import Key
from plait.job.consumers import Consumers
from plait.job.cp_builds import is_dynamic
from plait.job.plan_stream import AFTER_KEPT, PlanStream, StreamRoles, same_state  # noqa: F401 - this module's API too
from plait.job.rank_builds import RankBuilds
from plait.job.window import REPORT_S, WINDOW, PlanWindow
from plait.plan import StepPlan


WINDOW_ENV = "PLAIT_PLAN_WINDOW"  # planned steps the shared stream keeps (default WINDOW)
REPORT_ENV = "PLAIT_LAG_REPORT_S"  # seconds a rank waits for a slower one before it is logged


class JobRoles(StreamRoles, Protocol):
    """What JobService drives: the plan stream's roles (job.plan_stream.StreamRoles) and the builds (the
    job's driver, plait.runtime.JobDriver)."""

    def build(self, plan: StepPlan, dp_rank: int) -> list[MicroBatch]: ...
    def error_report(self) -> dict: ...
    def close(self) -> None: ...


class JobService:
    """A job's shared plan stream and builds over `roles` (thread-safe). `build_ahead`: steps built ahead of
    each rank's request; `expected`: trainer processes that will join (their missing ones hold the stream
    at its start for `grace_s`); `window`: planned steps kept (default $PLAIT_PLAN_WINDOW or 64);
    `every_rank_reads`: every DP rank reads (one process reads them all: a step's blocks stay until each
    rank built it), else only the ranks whose readers are live pin a step's blocks."""

    def __init__(self, roles: JobRoles, *, build_ahead: int = 2, expected: int = 0, grace_s: float = 60.0,
                 window: int | None = None, threads: int | None = None, every_rank_reads: bool = True):
        self.roles = roles
        self.ranks = roles.planner.ranks
        self.consumers = Consumers(expected=expected, grace_s=grace_s, every_rank_reads=every_rank_reads)
        size = int(window or os.environ.get(WINDOW_ENV) or WINDOW)
        report_s = float(os.environ.get(REPORT_ENV) or REPORT_S)
        self.stream = PlanStream(roles, self.consumers, size=size, report_s=report_s)
        self.builds = RankBuilds(self.stream, self._build, builds=self.stream.builds_per_step,
                                 dynamic=is_dynamic(roles.spec), ahead=build_ahead, threads=threads)
        self.stream.on_reset = self.builds.forget
        self.window, self.cache = self.stream.window, self.builds.cache
        # the plan stream's answers, as they are
        self.base, self.seek, self.seek_with_changes = self.stream.base, self.stream.seek, self.stream.seek_with_changes
        self.state_at, self.state_after = self.stream.state_at, self.stream.state_after
        self.replan_after, self.set_weights, self.report = (self.stream.replan_after, self.stream.set_weights,
                                                            self.stream.report)
        self.join, self.leave, self.stop, self.get = self.stream.join, self.stream.leave, self.stream.stop, self.builds.get
        registry = getattr(getattr(roles, "telemetry", None), "registry", None)
        if registry is not None:
            registry.register(WindowMetrics(self.window))

    gen = property(lambda self: self.stream.gen, doc="The plan stream's current generation.")
    every_rank_reads = property(lambda self: self.consumers.every_rank_reads,
                                lambda self, every: setattr(self.consumers, "every_rank_reads", every),
                                doc="Whether a step's blocks stay until every rank built it (Consumers.reading).")

    def _build(self, plan: StepPlan, key: Key) -> list[MicroBatch]:
        return self.roles.build(plan, key[2])  # outside the stream's lock: the roles lock their loader's gather

    def error_report(self) -> dict:
        with self.stream.lock:
            return self.roles.error_report()

    def stats(self) -> dict:
        """The window (size, longest, waits, who was waited for) and the builds held."""
        with self.stream.lock:
            return {**self.window.stats(), "builds": len(self.cache.builds), "most_builds": self.cache.most,
                    "build_ahead": self.cache.ahead,
                    "readers": self.consumers.positions()}

    def close(self) -> None:
        self.builds.close()
        self.roles.close()


class WindowMetrics:
    """The plan window on the job's Prometheus endpoint: its length and the waits of its backpressure."""

    def __init__(self, window: PlanWindow):
        self.window = window

    def collect(self):
        w = self.window
        yield GaugeMetricFamily("plait_plan_window_steps", "Planned steps the shared stream holds now",
                                value=len(w.steps))
        yield CounterMetricFamily("plait_plan_window_waits", "Requests that waited for a slower rank (the "
                                  "window was full)", value=w.waits)
        yield CounterMetricFamily("plait_plan_window_wait_seconds", "Time requests waited for a slower rank",
                                  value=w.wait_seconds)
