"""`JobService`: one job's shared stream, served rank by rank (plan -> build -> serve), without Ray.

Every step is planned once for all ranks (job.window: a bounded window of planned steps, with
backpressure), each (step, DP rank) built once a few steps ahead on a small pool of threads (job.builds)
and served cut to the asking CP rank. A trainer that resumes from another data state `seek`s, which starts
a new generation of the stream. The runtimes wrap it: `plait serve --runtime local` and the node-shared
data plane (plait.runtime.serve_local, plait.runtime.node_share) put a Flight server in front of it.

The roles run in this process (`JobRoles`: plait.runtime.local.LocalRuntime). Locks: `lock` guards the
window, the builds and the Planner (planning is serialised); the roles guard their SourceLoader themselves
during a build's gather, so the packing of different ranks' builds overlaps.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from plait.batch import MicroBatch
from plait.errors import PlaitError
from plait.job.builds import BuildCache
from plait.job.cp_builds import build_ranks, is_dynamic, served_rank
from plait.job.consumers import Consumers
from plait.job.window import REPORT_S, WINDOW, PlanWindow, plain_state
from plait.plan import StepPlan


WINDOW_ENV = "PLAIT_PLAN_WINDOW"  # planned steps the shared stream keeps (default WINDOW)
REPORT_ENV = "PLAIT_LAG_REPORT_S"  # seconds a rank waits for a slower one before it is logged
AFTER_KEPT = 8  # states after a planned step kept for `state_after` (a trainer checkpoints the step it read)


class JobRoles(Protocol):
    """What JobService drives: the Planner (`planner.step`, `planner.ranks`) and the builds (the job's
    driver, plait.runtime.JobDriver, with its state and run-time mixing)."""

    planner: Any
    spec: Any

    def plan(self) -> StepPlan: ...
    def build(self, plan: StepPlan, dp_rank: int) -> list[MicroBatch]: ...
    def release(self, *in_flight: StepPlan) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict, *, allow_spec_change: bool = False) -> list[str]: ...


def same_state(a: dict, b: dict) -> bool:
    """Equal as a client sees them (a state that went through JSON has lists for tuples)."""
    return plain_state(a) == plain_state(b)


class JobService:
    """A job's shared plan stream and builds over `roles` (thread-safe). `build_ahead`: steps built ahead of
    each rank's request; `expected`: trainer processes that will join (their missing ones hold the stream
    at its start for `grace_s`); `window`: planned steps kept (default $PLAIT_PLAN_WINDOW or 64)."""

    def __init__(self, roles: JobRoles, *, build_ahead: int = 2, expected: int = 0, grace_s: float = 60.0,
                 window: int | None = None, threads: int | None = None, every_rank_reads: bool = True):
        self.roles = roles
        self.ranks = roles.planner.ranks
        self.dynamic = is_dynamic(roles.spec)
        self.builds_per_step = build_ranks(roles.spec, self.ranks)  # with dynamic CP one per pool rank
        self.lock = threading.RLock()
        self.consumers = Consumers(expected=expected, grace_s=grace_s)
        size = int(window or os.environ.get(WINDOW_ENV) or WINDOW)
        report_s = float(os.environ.get(REPORT_ENV) or REPORT_S)
        self.window = PlanWindow(self._plan_next, lambda: roles.planner.step, self.consumers, self.lock,
                                 size=size, report_s=report_s)
        self.base_state = roles.state_dict()
        self.built: dict[int, set[int]] = {}  # step -> DP ranks built (the step's blocks are released then)
        # A step's blocks go once every DP rank built it; in a trainer's own process only its rank reads
        # (plait.runtime.local), so there the ranks that asked are enough.
        self.every_rank_reads = every_rank_reads
        self.reading: set[int] = set()
        self.after: dict[int, dict] = {}  # step -> the Planner's state right after planning it (the last few)
        self.cache = BuildCache(self._build, build_ahead, threads)
        registry = getattr(getattr(roles, "telemetry", None), "registry", None)
        if registry is not None:
            registry.register(WindowMetrics(self.window))

    @property
    def gen(self) -> int:
        return self.window.gen

    def _plan_next(self) -> StepPlan:
        plan = self.roles.plan()
        self.after[plan.step] = self.roles.state_dict()
        self.after.pop(plan.step - AFTER_KEPT, None)
        return plan

    # ----- the plan stream ---------------------------------------------------------------------------
    def base(self) -> tuple[int, dict]:
        with self.lock:
            return self.gen, self.base_state

    def seek(self, state: dict) -> int:
        """Make step state['step'] start from `state`; a no-op when the stream already does."""
        with self.lock:
            step = state.get("step") if isinstance(state, dict) else None
            if isinstance(step, int):  # else not a state: the roles' check below names what is wrong
                plan = self.window.steps.get(step)
                if plan is not None and same_state(plan.state_before, state):
                    return self.gen
                if plan is None and self.roles.planner.step == step and same_state(self.roles.state_dict(), state):
                    return self.gen
            self.roles.load_state_dict(state)  # validates version, fields and fingerprint
            return self._new_generation()

    def seek_with_changes(self, state: dict) -> tuple[int, list[str]]:
        """`seek` to a state saved under another spec: (generation, the changes found). Every rank asks it
        with the same state; the first starts the new generation, the others join it (PlanWindow.change_once)."""
        def apply() -> tuple[int, list[str]]:
            changes = self.roles.load_state_dict(state, allow_spec_change=True) or []
            return self._new_generation(), list(changes)

        with self.lock:
            return self.window.change_once(state, apply)

    def _new_generation(self) -> int:
        self.built.clear()
        self.reading.clear()
        self.after.clear()
        self.cache.forget()
        self.base_state = self.roles.state_dict()
        return self.window.reset()

    def state_at(self, gen: int, step: int) -> dict:
        with self.lock:
            if gen == self.gen and step == self.base_state["step"]:
                return self.base_state
            if gen == self.gen and step == self.roles.planner.step:
                return self.roles.state_dict()
            self.window.admit(gen, step)
            return self._plan(gen, step).state_before

    def state_after(self, gen: int, step: int) -> dict | None:
        """The Planner's state right after it planned `step` of `gen` (None when no longer known): the
        data state a step-boundary checkpoint carries as `next`."""
        with self.lock:
            return self.after.get(step) if gen == self.gen else None

    def replan_after(self, state: dict, layout: dict) -> dict:
        """The data state after the step starting at `state`, re-planned on the saved `layout` (elastic
        resume, job.elastic): on the job's side, where the sources are."""
        from plait.job.elastic import replan_after

        return replan_after(self.roles.spec, state, layout)

    def set_weights(self, weights: dict, at_step: int) -> None:
        self.roles.set_weights(weights, at_step)  # the Planner refuses a step already planned

    def report(self, step: int, losses: dict) -> None:
        self.roles.report(step, losses)

    def error_report(self) -> dict:
        with self.lock:
            return self.roles.error_report()

    def _plan(self, gen: int, step: int) -> StepPlan:
        planned = self.roles.planner.step
        plan = self.window.plan(gen, step)
        if self.roles.planner.step != planned:
            self._release()
        return plan

    def _release(self) -> None:
        """The loader keeps the Planner's live blocks and those of planned steps some rank has not built."""
        steps = self.window.steps
        for s in [s for s in self.built if s not in steps]:
            del self.built[s]
        self.roles.release(*(plan for s, plan in steps.items() if not self._all_built(s)))

    def _all_built(self, step: int) -> bool:
        done = self.built.get(step, set())
        return len(done) == self.builds_per_step if self.every_rank_reads else done >= self.reading

    # ----- the readers --------------------------------------------------------------------------------
    def join(self, client: str, pid: int) -> None:
        self.consumers.join(client, pid)

    def leave(self, client: str) -> None:
        self.consumers.leave(client)
        with self.lock:
            self.window.moved()

    # ----- builds ---------------------------------------------------------------------------------------
    def _build(self, gen: int, step: int, dp_rank: int) -> tuple[dict, list[MicroBatch]]:
        with self.lock:
            plan = self._plan(gen, step)
        batches = self.roles.build(plan, dp_rank)  # outside the lock: the roles lock their loader's gather
        with self.lock:
            done = self.built.setdefault(step, set())
            done.add(dp_rank)
            if self._all_built(step):
                self._release()
        return plan.state_before, batches

    def get(self, gen: int, step: int, dp_rank: int, limit: int | None = None, cp: tuple[int, int] = (1, 0),
            with_state: bool = True, client: str | None = None) -> tuple[dict | None, list[MicroBatch]]:
        """(state at the start of `step` or None without `with_state`, the rank's micro-batches of `step` cut
        to CP rank cp[1] of cp[0]); the next `build_ahead` steps of the rank are queued behind it. `client`
        names the reader (default: its ranks). Waits while `step` is more than the window ahead of the
        slowest live reader."""
        if not 0 <= dp_rank < self.ranks:
            raise PlaitError(f"dp_rank {dp_rank} is not one of this job's {self.ranks} DP ranks")
        rank, cut = served_rank(self.dynamic, dp_rank, cp)  # dynamic CP: the pool rank's build, cut already
        key = (gen, step, rank)
        with self.lock:
            self.consumers.asked(client or f"rank-{dp_rank}-cp-{cp[1]}", dp_rank, cp[1], gen, step, limit)
            self.reading.add(rank)
            if self.window.moved():
                self._release()
            self.window.admit(gen, step)
            fut = self.cache.request(key, lambda s: (limit is None or s < int(limit)) and self.window.admits(s))
        try:
            built = fut.result()
        except BaseException:
            with self.lock:
                self.cache.forget(key)
            raise
        return BuildCache.served(built, cut, with_state)

    def stop(self, reason: str) -> None:
        """Refuse every request from now on with `reason`; requests waiting in the window fail with it too."""
        with self.lock:
            self.window.stop(reason)

    def stats(self) -> dict:
        """The window (size, longest, waits, who was waited for) and the builds held."""
        with self.lock:
            return {**self.window.stats(), "builds": len(self.cache.builds), "most_builds": self.cache.most,
                    "readers": self.consumers.positions()}

    def close(self) -> None:
        self.cache.close()
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
