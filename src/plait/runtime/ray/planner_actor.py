"""The Planner actor: the job's one plait.roles.planner.Planner, planning every global step exactly once.

It keeps a window of planned steps (job.window.PlanWindow, the window every runtime's job service keeps):
Constructors and clients ask for step t of generation g, nobody "advances" it. Metadata (block ids,
lengths) comes to it from the loaders by `block_meta`; it never sees a token. A client that resumes from
another data state `seek`s, which starts a new generation of the stream. `PlannerRecipe` is the one way a
Planner actor is started (by the first client of a job, and again after the Planner died).

Everything else is a collaborator: the loader layouts and their changes while the job runs
(plait.runtime.ray.planner_layout), the job's trainers and its end when idle (plait.runtime.ray.planner_jobs),
and the observers told once per planning call and once per request (plait.runtime.ray.planner_requests): the
standby that makes a successor (plait.runtime.ray.standby_planner), the routing's upkeep
(plait.runtime.ray.routing) and the loaders' shadows (plait.runtime.ray.recovery). Every request runs under
the actor's lock (`planner_call`): a Planner that also builds (plait.runtime.ray.planner_host) serves many
calls at once.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from plait.job.consumers import RankProgress
from plait.job.cp_builds import build_ranks, is_dynamic
from plait.job.window import WINDOW, PlanWindow
from plait.plan import RankPlan, StepPlan
from plait.runtime.placement import LoaderLayout
from plait.runtime.ray.common import actor_options, planner_name, ray_module
from plait.runtime.ray.job_metrics import JobMetrics
from plait.runtime.ray.liveness import LIVENESS_GROUP, JobNameTaken  # noqa: F401 - JobNameTaken: this module's API too
from plait.runtime.ray.loader_actor import LoaderConfig
from plait.runtime.ray.planner_jobs import JobPresence, LifetimeRequests, format_age  # noqa: F401 - format_age too
from plait.runtime.ray.planner_layout import LayoutControl, LayoutRequests
from plait.runtime.ray.planner_reports import ReportRequests, merge_error_reports  # noqa: F401 - merge_error_reports too
from plait.runtime.ray.planner_requests import BUILT, READ, STATE, Observers, planner_call
from plait.runtime.ray.recovery import ShadowUpkeep
from plait.runtime.ray.routing import RoutingUpkeep
from plait.runtime.ray.standby_planner import StandbyLink, StandbySync
from plait.spec import load_spec
from plait.telemetry import Stopwatch

job_log = logging.getLogger("plait.jobs")
# planned steps the Planner keeps (Constructors wait at its edge: `horizon`); docs/serving.md
PLAN_WINDOW = int(os.environ.get("PLAIT_PLAN_WINDOW") or WINDOW)


class NoReaders:
    """The Ray Planner's window is held by no reader: its Constructors wait at `horizon` before they ask
    (the backpressure is theirs), so the oldest planned step goes once the window is full."""

    def slowest(self, gen: int, base_step: int) -> tuple[int | None, str]:
        return None, ""


class PlannerActor(LayoutRequests, LifetimeRequests, ReportRequests):
    """The job's one Planner, planning a shared, windowed plan stream."""

    def __init__(self, spec_dict: dict, job: str, options: dict):
        from plait.roles.planner import Planner

        self.lock = threading.RLock()  # every request (planner_call), and the window's waits
        self.spec = load_spec(spec_dict)
        self.job = job
        self.options = options
        self.layouts = LayoutControl(self.spec, spec_dict, job, options, now=lambda: self.planner.step,
                                     on_replaced=self._release)
        self.planner = Planner(self.spec, self.layouts.metadata, dp=options.get("dp"))
        self.window = PlanWindow(self._plan_next, lambda: self.planner.step, NoReaders(), self.lock,
                                 size=PLAN_WINDOW)
        self.base_state = self.planner.state_dict()
        self.built: dict[int, set[int]] = {}  # planned step -> DP ranks built (its blocks are released then)
        self.progress = RankProgress()  # how far each rank's builds got: the window's edge (`horizon`)
        self.planned = 0  # steps planned in total (each exactly once per generation)
        self.presence = JobPresence(job, options)
        # The job's /metrics (plait.runtime.ray.job_metrics): served here when the spec sets metrics.port.
        self.metrics = JobMetrics(self.spec, lambda: self.loaders.handles, lambda: list(self.presence.constructors))
        self.loaders.on_event = self._observe_event
        self.layouts.record(self.metrics.telemetry.registry)
        if options.get("autoscale"):
            self.layouts.start_autoscaling(self.planner.ranks, lambda: list(self.presence.constructors),
                                           ray_module().get_runtime_context().current_actor)
        # A shared job's standby follows this Planner's per-step state and makes its successor, should it
        # die; a successor continues the dead one's stream (plait.runtime.ray.standby_planner).
        recipe = PlannerRecipe(spec_dict, job, {**options, "layout": self.layout.to_dict()}, self.spec.data_fingerprint(),
                               type(self))
        self.standby = StandbyLink.for_planner(recipe, PLAN_WINDOW)
        self.standby.adopt(self)
        self.standby.sync(self)
        # Told once per planning call and once per request (planner_requests), in this order.
        self.observers = Observers(RoutingUpkeep(self.routes, self.window), ShadowUpkeep(lambda: self.loaders),
                                   self.presence, StandbySync(self.standby, self))
        self.presence.watch(self._end_job)

    # ----- shared plan stream --------------------------------------------------------------------
    @property
    def gen(self) -> int:
        return self.window.gen

    @planner_call()
    def info(self) -> dict:
        return {"gen": self.gen, "fingerprint": self.spec.data_fingerprint(), "ranks": self.planner.ranks,
                "sources": self.spec.source_names,
                "loaders": len(self.loaders.handles), "pmap": self.pmap.to_dict(), "layout": self.layout.to_dict(),
                "idle_timeout": self.presence.idle_timeout, "routing_version": self.routes.version,
                "heartbeat_interval": self.presence.trainers.interval, "dynamic_cp": is_dynamic(self.spec)}

    def get_loaders(self) -> list:
        return self.loaders.handles

    @planner_call(STATE)
    def seek(self, state: dict) -> int:
        """Make step state['step'] start from `state`; a no-op when the stream already does."""
        step = int(state["step"])
        plan = self.window.steps.get(step)
        if plan is not None and plan.state_before == state:
            return self.gen
        if plan is None and self.planner.step == step and self.planner.state_dict() == state:
            return self.gen
        if self.standby.rewind(self, step, state):  # a successor serving a step its predecessor planned
            return self.gen
        self.planner.load_state_dict(state)  # validates version and fingerprint
        return self._new_generation()

    @planner_call(STATE)
    def seek_with_changes(self, state: dict) -> tuple[int, list[str]]:
        """`seek` to a state saved under another spec (weights, schedule, sources added or removed);
        returns (generation, the changes found). Every rank asks it with the same state: the first starts a
        new generation, the others join it (job.window.PlanWindow.change_once)."""
        def apply() -> tuple[int, list[str]]:
            changes = self.planner.load_state_dict(state, allow_spec_change=True) or []
            return self._new_generation(), list(changes)

        return self.window.change_once(state, apply)

    @planner_call(READ)
    def base(self) -> tuple[int, dict]:
        """The current generation and the data state it started from."""
        return self.gen, self.base_state

    def _new_generation(self) -> int:
        self.built.clear()
        self.base_state = self.planner.state_dict()
        return self.window.reset()

    @planner_call(STATE)
    def set_weights(self, weights: dict, at_step: int) -> None:
        """Run-time reweighting, applied once for the whole job (the Planner refuses a planned step)."""
        self.planner.set_weights(weights, at_step)

    @planner_call()
    def weight_overrides(self) -> list[dict]:
        """The weight changes recorded so far (`plait mix JOB --show`)."""
        return list(self.planner.state_dict().get("overrides", []))

    @planner_call(STATE)
    def report(self, step: int, losses: dict) -> None:
        self.planner.report(step, losses)

    def replan_after(self, state: dict, layout: dict) -> dict:
        """Elastic resume on the job's side: the data state after the step that starts at `state`,
        re-planned on the `layout` it ran on (metadata only, on a SourceLoader of its own: the job's
        stream and its loaders are untouched, so no lock)."""
        from plait.job.elastic import replan_after  # the Planner (and numba) only where a step is re-planned

        return replan_after(self.spec, state, layout)

    def _plan_next(self) -> StepPlan:
        """The window's way to plan the next step (a successor plans it from its predecessor's log)."""
        self.standby.align(self)
        with Stopwatch() as t:
            plan = self.planner.plan_step()
        self.metrics.telemetry.observe_plan(plan, t.seconds)
        self.planned += 1
        return plan

    def _plan(self, gen: int, step: int) -> StepPlan:
        self.window.check(gen)
        if step in self.window.steps:
            return self.window.steps[step]
        if step < self.planner.step:  # a successor re-plans a step its predecessor planned; else the window refuses
            self.standby.rewind(self, step)
        first, held = self.planner.step, set(self.window.steps)
        plan = self.window.plan(gen, step)
        for gone in held.union(range(first, self.planner.step)).difference(self.window.steps):
            self.built.pop(gone, None)
        self._release()
        self.observers.planned([self.window.steps[s] for s in range(first, self.planner.step)
                                if s in self.window.steps])
        return plan

    @planner_call(READ)
    def step_plan(self, gen: int, step: int) -> StepPlan:
        return self._plan(gen, step)

    @planner_call()
    def rank_plan(self, gen: int, step: int, dp_rank: int) -> RankPlan:
        return self._plan(gen, step).for_rank(dp_rank)

    @planner_call()
    def build_order(self, gen: int, step: int, dp_rank: int, routing_version: int | None,
                    with_state: bool = True) -> tuple[RankPlan, dict | None, dict | None]:
        """A Constructor's one call per build: the rank's plan, the state before the step (None without
        `with_state`), and the current routing when the Constructor's (`routing_version`) is not it."""
        plan = self.rank_plan(gen, step, dp_rank)
        state = self.state_at(gen, step) if with_state else None
        return plan, state, self.routes.order(gen, step, dp_rank, routing_version)

    @planner_call(READ)  # also asked by Constructors, for each build a trainer requested
    def state_at(self, gen: int, step: int) -> dict:
        if gen == self.gen and step == self.base_state["step"]:
            return self.base_state
        if gen == self.gen and step == self.planner.step:
            return self.planner.state_dict()
        return self._plan(gen, step).state_before

    @planner_call()
    def horizon(self, gen: int) -> tuple[int | None, str]:
        """The first step of `gen` a Constructor may not have planned yet (None: any) and the rank it waits
        for: the window keeps the slowest reading rank's steps, so a rank far ahead waits (docs/serving.md)."""
        low, who = self.progress.slowest(gen)
        if low is None or gen != self.gen:
            return None, ""
        return low + max(2, PLAN_WINDOW - int(self.options.get("prefetch", 2)) - 2), who

    @planner_call(BUILT)
    def mark_built(self, gen: int, step: int, dp_rank: int) -> None:
        self.progress.built(gen, step, dp_rank)
        self.routes.built(gen, step, dp_rank)
        if gen != self.gen or step not in self.window.steps:
            return
        done = self.built.setdefault(step, set())
        done.add(dp_rank)
        if len(done) == build_ranks(self.spec, self.planner.ranks):
            self._release()

    def _release(self) -> None:
        """Tell loaders which blocks are still live: the Planner's own, and those of unbuilt steps."""
        live = self.planner.live_blocks()
        drawn = set(self.planner.carry.block_keys()[0])  # what the next steps draw from: the loaders' budget
        for step, plan in self.window.steps.items():
            if len(self.built.get(step, ())) < build_ranks(self.spec, self.planner.ranks):
                drawn.update(plan.items.block_keys()[0])
        for ld in self.loaders.handles:
            ld.retain.remote(live | drawn, drawn)

    @planner_call()
    def stats(self) -> dict:
        return {"planned": self.planned, "step": self.planner.step, "gen": self.gen,
                "clients": self.presence.trainers.count, "constructors": sorted(self.presence.constructors),
                "routing_version": self.routes.version, "retiring": [r.version for r, _ in self.routes.retiring]}



@dataclass(frozen=True)
class PlannerRecipe:
    """How a job's Planner actor is made: by the job's first client, and again after it died."""

    spec_dict: dict
    job: str
    options: dict  # loaders, partitions, dp, lifetime, ...; `layout` once decided (a new Planner keeps it)
    fingerprint: str
    actor: type | None = None  # the actor class (default PlannerActor; plait.runtime.ray.planner_host's)

    @property
    def name(self) -> str:
        return planner_name(self.job)

    @property
    def shared(self) -> bool:
        return self.options.get("lifetime") == "detached"

    def loader_names(self) -> list[str]:
        """The first loaders' names (those a new Planner starts again)."""
        config = LoaderConfig(self.job, self.spec_dict, LoaderLayout.from_dict(self.options["layout"]))
        return [config.name(k) for k in range(config.layout.loaders)]

    def start(self):
        """Start the job's Planner actor, or find it by name when another client already did."""
        ray = ray_module()
        cls = self.actor or PlannerActor
        opts = actor_options(self.name, self.options.get("lifetime"), num_cpus=0, **getattr(cls, "ACTOR_OPTIONS", {}))
        actor = ray.remote(concurrency_groups={LIVENESS_GROUP: 1})(cls)  # heartbeats are heard while it plans
        return actor.options(**opts).remote(self.spec_dict, self.job, self.options)

