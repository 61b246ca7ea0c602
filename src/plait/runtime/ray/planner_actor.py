"""The Planner actor: the job's one plait.roles.planner.Planner, planning every global step exactly once.

It composes the plan half of the job's service (job.plan_stream.PlanStream, the one every runtime's job
service composes: a window of planned steps, generations, states, one waiting rule), with the ranks' builds
as who is slowest (job.consumers.RankProgress): Constructors and clients ask for step t of generation g,
nobody "advances" it, and a Constructor's request for a step too far ahead waits in `admit`. Metadata (block ids,
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
from plait.job.cp_builds import is_dynamic
from plait.job.plan_stream import PlanStream, kept_blocks
from plait.job.window import WINDOW
from plait.plan import RankPlan, StepPlan
from plait.runtime.placement import LoaderLayout
from plait.runtime.ray.common import actor_options, planner_name, ray_module
from plait.runtime.ray.job_metrics import JobMetrics
from plait.runtime.ray.liveness import LIVENESS_GROUP, JobNameTaken  # noqa: F401 - JobNameTaken: this module's API too
from plait.runtime.ray.loader_actor import LoaderConfig
from plait.runtime.ray.planner_jobs import JobPresence, LifetimeRequests, format_age  # noqa: F401 - format_age too
from plait.runtime.ray.planner_layout import LayoutControl, LayoutRequests
from plait.runtime.ray.planner_reports import ReportRequests, merge_error_reports  # noqa: F401 - merge_error_reports too
from plait.runtime.ray.planner_requests import BUILT, READ, STATE, WINDOW_GROUP, WINDOW_THREADS, Observers, planner_call
from plait.runtime.ray.recovery import ShadowUpkeep
from plait.runtime.ray.routing import RoutingUpkeep
from plait.runtime.ray.standby_planner import StandbyLink, StandbySync
from plait.spec import load_spec
from plait.telemetry import Stopwatch

job_log = logging.getLogger("plait.jobs")
# planned steps the Planner keeps ahead of the slowest building rank (Constructors wait in `admit`); docs/serving.md
PLAN_WINDOW = int(os.environ.get("PLAIT_PLAN_WINDOW") or WINDOW)



class PlannerRoles:
    """What the job's plan stream (job.plan_stream.PlanStream) drives on Ray: the Planner (planned from the
    dead one's log when a successor, timed for the job's metrics), and the loaders' blocks, told over Ray."""

    def __init__(self, actor: "PlannerActor"):
        self.actor = actor
        self.planner, self.spec = actor.planner, actor.spec

    def plan(self) -> StepPlan:
        actor = self.actor
        actor.standby.align(actor)
        with Stopwatch() as t:
            plan = self.planner.plan_step()
        actor.metrics.telemetry.observe_plan(plan, t.seconds)
        actor.planned += 1
        return plan

    def release(self, *in_flight: StepPlan) -> None:
        live, drawn = kept_blocks(self.planner, in_flight)
        for ld in self.actor.loaders.handles:
            ld.retain.remote(live | drawn, drawn)

    def state_dict(self) -> dict:
        return self.planner.state_dict()

    def load_state_dict(self, state: dict, *, allow_spec_change: bool = False) -> list[str]:
        return self.planner.load_state_dict(state, allow_spec_change=allow_spec_change)

    def set_weights(self, weights: dict, at_step: int) -> None:
        self.planner.set_weights(weights, at_step)

    def report(self, step: int, losses: dict) -> None:
        self.planner.report(step, losses)


class PlannerActor(LayoutRequests, LifetimeRequests, ReportRequests):
    """The job's one Planner, planning a shared, windowed plan stream (job.plan_stream): its builds are
    the Constructors', whose requests wait in its window (`admit`, on the WINDOW_GROUP's threads)."""

    def __init__(self, spec_dict: dict, job: str, options: dict):
        from plait.roles.planner import Planner

        self.lock = threading.RLock()  # every request (planner_call), and the window's waits
        self.spec = load_spec(spec_dict)
        self.job = job
        self.options = options
        self.layouts = LayoutControl(self.spec, spec_dict, job, options, now=lambda: self.planner.step,
                                     on_replaced=lambda: self.stream.release())
        self.planner = Planner(self.spec, self.layouts.metadata, dp=options.get("dp"))
        self.planned = 0  # steps planned in total (each exactly once per generation)
        # the ranks' builds say who is slowest (RankProgress): a rank far ahead waits in `admit`
        self.stream = PlanStream(PlannerRoles(self), RankProgress(), lock=self.lock, size=PLAN_WINDOW)
        self.stream.rewind = lambda step, state=None: self.standby.rewind(self, step, state)
        self.presence = JobPresence(job, options)
        # The job's /metrics (plait.runtime.ray.job_metrics): served here when the spec sets metrics.port.
        self.metrics = JobMetrics(self.spec, lambda: self.loaders.handles, self.builder_names)
        self.loaders.on_event = self._observe_event
        self.layouts.record(self.metrics.telemetry.registry)
        if options.get("autoscale"):
            self.layouts.start_autoscaling(self.planner.ranks, self.builder_names,
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
        self.stream.planned = self.observers.planned
        self.presence.watch(self._end_job)

    # ----- the plan stream's state, as the standby reads and restores it -------------------------------
    gen = property(lambda self: self.stream.gen)
    window = property(lambda self: self.stream.window)
    base_state = property(lambda self: self.stream.base_state,
                          lambda self, state: setattr(self.stream, "base_state", state))
    built = property(lambda self: self.stream.made, lambda self, made: setattr(self.stream, "made", made))

    def builder_names(self) -> list[str]:
        """The actors that build the job's batches (the Constructors that registered), whose figures /metrics
        and the autoscaler read; a Planner that builds is one of them (planner_host)."""
        return list(self.presence.constructors)

    # ----- requests ------------------------------------------------------------------------------------
    @planner_call()
    def info(self) -> dict:
        return {"gen": self.gen, "fingerprint": self.spec.data_fingerprint(), "ranks": self.planner.ranks,
                "sources": self.spec.source_names,
                "loaders": len(self.loaders.handles), "pmap": self.pmap.to_dict(), "layout": self.layout.to_dict(),
                "idle_timeout": self.presence.idle_timeout, "routing_version": self.routes.version,
                "heartbeat_interval": self.presence.trainers.interval, "dynamic_cp": is_dynamic(self.spec),
                "builds": self.stream.builds_per_step, "pixels_apart": self.options.get("pixels_apart")}

    def get_loaders(self) -> list:
        return self.loaders.handles

    @planner_call(STATE)
    def seek(self, state: dict) -> int:
        """Make step state['step'] start from `state`; a no-op when the stream already does."""
        return self.stream.seek(state)

    @planner_call(STATE)
    def seek_with_changes(self, state: dict) -> tuple[int, list[str]]:
        """`seek` to a state saved under another spec (weights, schedule, sources added or removed): the
        first rank's call starts a new generation, the others join it."""
        return self.stream.seek_with_changes(state)

    @planner_call(READ)
    def base(self) -> tuple[int, dict]:
        """The current generation and the data state it started from."""
        return self.stream.base()

    @planner_call(STATE)
    def set_weights(self, weights: dict, at_step: int) -> None:
        """Run-time reweighting, applied once for the whole job (the Planner refuses a planned step)."""
        self.stream.set_weights(weights, at_step)

    @planner_call()
    def weight_overrides(self) -> list[dict]:
        """The weight changes recorded so far (`plait mix JOB --show`)."""
        return list(self.planner.state_dict().get("overrides", []))

    @planner_call(STATE)
    def report(self, step: int, losses: dict) -> None:
        self.stream.report(step, losses)

    def replan_after(self, state: dict, layout: dict) -> dict:
        """Elastic resume on the job's side (no lock: the stream and its loaders are untouched)."""
        return self.stream.replan_after(state, layout)

    @planner_call(READ)
    def step_plan(self, gen: int, step: int) -> StepPlan:
        return self.stream.plan(gen, step)

    @planner_call()
    def rank_plan(self, gen: int, step: int, dp_rank: int) -> RankPlan:
        return self.stream.plan(gen, step).for_rank(dp_rank)

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
        return self.stream.state_at(gen, step, wait=False)  # waiting is `admit`'s, on its own threads

    @planner_call()
    def admit(self, gen: int, step: int, ask=None) -> int | None:
        """A Constructor's request for `step` of `gen` waits here while the step is more than the window
        ahead of the slowest building rank (docs/serving.md); the first step not admitted then (None: any).
        Asked on the WINDOW_GROUP's threads: a wait releases the lock, other requests go on."""
        return self.stream.admit(gen, step, ask)

    @planner_call(BUILT)
    def mark_built(self, gen: int, step: int, dp_rank: int) -> None:
        self.routes.built(gen, step, dp_rank)
        self.stream.built(gen, step, dp_rank)

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
        # heartbeats are heard while it plans; Constructors' requests wait in the window on threads of their own
        actor = ray.remote(concurrency_groups={LIVENESS_GROUP: 1, WINDOW_GROUP: WINDOW_THREADS})(cls)
        return actor.options(**opts).remote(self.spec_dict, self.job, self.options)

