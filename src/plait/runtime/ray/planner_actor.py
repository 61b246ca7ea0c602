"""The Planner actor: the job's one plait.roles.planner.Planner, planning every global step exactly once.

It decides the loader layout (plait.runtime.placement; measured in a throw-away Ray task for
`loaders="auto"`), starts the loaders and their shadows (a `LoaderFleet`, plait.runtime.ray.recovery, which
also replaces them when they die) and keeps a window of planned steps: Constructors and clients ask for
step t of generation g, nobody "advances" it. Metadata (block ids, lengths) comes to it from the loaders
by `block_meta`; it never sees a token. A client that resumes from another data state `seek`s, which starts
a new generation of the stream. `PlannerRecipe` is the one way a Planner actor is started (by the first
client of a job, and again after the Planner died). It counts the attached trainers and, with
`job_idle_timeout`, ends the whole job when no trainer was seen for that long (`IdleWatch`;
plait.runtime.ray.jobs). The layout can change while the job runs (`rescale`, by hand or by the
autoscaling loop of `RayOptions.autoscale`): plait.runtime.ray.routing and plait.runtime.ray.autoscaler.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

from plait.errors import PlaitError
from plait.job.consumers import RankProgress
from plait.job.window import WINDOW, StaleGeneration
from plait.plan import RankPlan, StepPlan
from plait.runtime.placement import LoaderLayout, PartitionMap
from plait.runtime.ray.common import (
    NAMESPACE,
    actor_options,
    dead_errors,
    get,
    planner_name,
    process_rss,
    ray_module,
)
from plait.runtime.ray.autoscaler import Autoscaler, ControlLoop, ScalingRecord, collect_figures
from plait.runtime.ray.job_metrics import JobMetrics
from plait.runtime.ray.layout_probe import layout_for
from plait.runtime.ray.liveness import LIVENESS_GROUP, JobNameTaken, RosterWatch, TrainerRoster
from plait.runtime.ray.loader_actor import LoaderConfig
from plait.runtime.ray.recovery import LoaderFleet
from plait.runtime.ray.routing import Routing, RoutingTable, check_layout
from plait.runtime.ray.standby_planner import StandbyLink
from plait.spec import load_spec
from plait.telemetry import Stopwatch

scale_log = logging.getLogger("plait.scaling")
job_log = logging.getLogger("plait.jobs")
# planned steps the Planner keeps (Constructors wait at its edge: `horizon`); docs/serving.md
PLAN_WINDOW = int(os.environ.get("PLAIT_PLAN_WINDOW") or WINDOW)


class LoaderMetadata:
    """The Planner's MetadataProvider: asks the loader that owns each block (a dead one is replaced).
    `fleet` and `pmap` are swapped by a rescale (between two planning calls: never during one)."""

    def __init__(self, fleet: LoaderFleet, pmap: PartitionMap, first_keys: dict[int, tuple]):
        self.fleet = fleet
        self.pmap = pmap
        self.first = first_keys

    def first_key(self, source: int):
        return self.first[source]

    def block_meta(self, source: int, key):
        owner = self.pmap.loader_of(source, key[0], key[1])
        while True:
            handle = self.fleet.handles[owner]
            try:
                return get(handle.block_meta.remote(source, tuple(key)))
            except dead_errors():  # metadata is a pure function of the key: ask the new owner
                self.fleet.replace_if_current(owner, handle)


class PlannerActor:
    """The job's one Planner, plus the bookkeeping of a shared, windowed plan stream."""

    def __init__(self, spec_dict: dict, job: str, options: dict):
        self.spec = load_spec(spec_dict)
        self.job = job
        self.options = options
        layout = layout_for(self.spec, options)
        # A successor (plait.runtime.ray.standby_planner) continues the dead Planner's layout version: its
        # loaders, found by their versioned names, and the routing version the Constructors hold.
        version = int(options.get("layout_version") or 0)
        fleet = self._fleet(replace(LoaderConfig.from_options(job, spec_dict, layout, options), version=version),
                            options)
        self.num_files: dict[int, int] = {}
        for counts in get([ld.num_files.remote() for ld in fleet.handles]):
            self.num_files.update({int(s): n for s, n in counts.items()})
        owner = layout.owner()
        pmap = PartitionMap(self.spec.seed, self.num_files, layout.num_partitions, owner)
        self.routes = RoutingTable(Routing(version, layout, pmap, fleet))
        self.prepared: dict[int, Routing] = {}  # layouts started, not yet switched to (prepare_layout)
        self.version_lock, self.last_version = threading.Lock(), version
        by_loader: dict[int, list[int]] = {}
        for s in range(len(self.spec.sources)):
            by_loader.setdefault(owner[(s, 0)], []).append(s)
        first: dict[int, tuple] = {}
        for part in get([fleet.handles[k].first_keys.remote(srcs) for k, srcs in by_loader.items()]):
            first.update({int(s): tuple(v) for s, v in part.items()})
        from plait.roles.planner import Planner

        self.metadata = LoaderMetadata(fleet, pmap, first)
        self.planner = Planner(self.spec, self.metadata, dp=options.get("dp"))
        if "takeover" not in options:  # a successor's start later (plait.runtime.ray.standby_planner)
            fleet.start_shadows()
        self.gen = 0
        self.window: OrderedDict[int, StepPlan] = OrderedDict()
        self.base_state = self.planner.state_dict()
        self.built: dict[int, set[int]] = {}
        self.progress = RankProgress()  # how far each rank's builds got: the window's edge (`horizon`)
        self.planned = 0  # steps planned in total (each exactly once per generation)
        self.trainers = TrainerRoster(options.get("heartbeat_interval"), options.get("run", 0))  # attached trainer processes
        self.constructors: set[str] = set()
        self.started = time.time()
        self.creator = options.get("creator")  # the client whose start made this actor (attach=False)
        self.last_seen = time.monotonic()  # the last call of a trainer (or its heartbeat)
        self.idle_timeout = options.get("job_idle_timeout")
        # The job's /metrics (plait.runtime.ray.job_metrics): served here when the spec sets metrics.port.
        self.metrics = JobMetrics(self.spec, lambda: self.loaders.handles, lambda: list(self.constructors))
        self.loaders.on_event = self._observe_event
        self.scaling = ScalingRecord(self.spec.source_names, self.metrics.telemetry.registry, options.get("autoscale"))
        self.scaling.start(layout)
        self.autoscaler, self.control = None, None
        if options.get("autoscale"):
            self._start_autoscaling(options["autoscale"])
        if self.idle_timeout:
            IdleWatch(self.idle_timeout, lambda: self.last_seen, self._end_idle_job).start()
        RosterWatch(self.trainers, lambda: self._end_idle_job("its trainers detached or stopped")).start()
        # A shared job's standby follows this Planner's per-step state and makes its successor, should it
        # die; a successor continues the dead one's stream (plait.runtime.ray.standby_planner).
        recipe = PlannerRecipe(spec_dict, job, {**options, "layout": self.layout.to_dict()}, self.spec.data_fingerprint(),
                               type(self))
        self.standby = StandbyLink.for_planner(recipe, PLAN_WINDOW)
        self.standby.adopt(self)
        self.standby.sync(self)

    # ----- the current layout, and changing it while the job runs (plait.runtime.ray.routing) ------
    @property
    def loaders(self) -> LoaderFleet:
        return self.routes.current.fleet

    @property
    def layout(self) -> LoaderLayout:
        return self.routes.current.layout

    @property
    def pmap(self) -> PartitionMap:
        return self.routes.current.pmap

    def _fleet(self, config: LoaderConfig, options: dict | None = None, previous=None) -> LoaderFleet:
        """The loaders of `config`'s layout. Only the first fleet takes `loader_generations` (a successor's
        view of the dead Planner's replacements); a new layout's loaders start at generation 0."""
        options = options if options is not None else {k: v for k, v in self.options.items() if k != "loader_generations"}
        return LoaderFleet(config, self.spec, options, now=lambda: self.planner.step, on_replaced=self._release,
                           previous=previous)

    def routing(self) -> dict:
        """The current routing (version, PartitionMap, loader handles), as a Constructor starts with it."""
        return self.routes.current.to_dict()

    def rescale(self, layout_dict: dict, reason: str = "manual", kind: str = "manual") -> int:
        """Re-partition the sources over new loaders (`layout_dict`: a LoaderLayout's to_dict); returns the new
        layout version. The new loaders (and their shadows) start under names of their own and answer the
        Planner's metadata from now on; Constructors get the new routing with their next build order; the
        old loaders end once no build handed out under them is unfinished. The stream does not change."""
        return self.switch_layout(self.prepare_layout(layout_dict), reason, kind)

    def prepare_layout(self, layout_dict: dict) -> int:
        """Start the loaders (and shadows) of a new layout and wait until they answer; returns its version
        (`switch_layout` makes it current). The autoscaling thread calls it directly: starting worker
        processes takes seconds, and planning goes on meanwhile."""
        layout = LoaderLayout.from_dict(layout_dict)
        check_layout(layout, self.spec)
        with self.version_lock:
            self.last_version += 1
            version = self.last_version
        current = self.loaders
        fleet = self._fleet(replace(current.config, layout=layout, version=version), previous=current)
        fleet.events, fleet.on_event = current.events, current.on_event  # one recovery log for the job
        try:
            get([ld.num_files.remote() for ld in fleet.handles])  # started and answering before the switch
        except Exception:
            fleet.retire()  # the old layout stays; nothing of the new one is left running
            raise
        fleet.start_shadows()
        pmap = PartitionMap(self.spec.seed, self.num_files, layout.num_partitions, layout.owner())
        self.prepared[version] = Routing(version, layout, pmap, fleet)
        return version

    def switch_layout(self, version: int, reason: str = "manual", kind: str = "manual") -> int:
        """Make the prepared layout `version` current (between two planning calls); returns the current
        version (an older prepared one than the current is ended instead)."""
        new = self.prepared.pop(version)
        if new.version < self.routes.version:
            new.fleet.retire()
            return self.routes.version
        self.routes.switch(new)
        self.metadata.fleet, self.metadata.pmap = new.fleet, new.pmap
        self._release()
        self.scaling.event(kind, reason, self.planner.step, new.layout)
        # the standby must know the layout in use before anyone can need a successor (planning does not
        # reproduce it; a successor with the old layout would start the retired loaders again)
        self.standby.sync(self, wait=True)
        return version

    def scaling_report(self) -> dict:
        """Rescaling events and the timeline of the layout (plait.runtime.ray.autoscaler.ScalingRecord)."""
        return self.scaling.report()

    def _start_autoscaling(self, options: dict) -> None:
        from plait.runtime.autoscale import AutoscaleOptions

        opts = AutoscaleOptions.from_option(options)
        files = [self.num_files[s] for s in range(len(self.spec.sources))]
        self.autoscaler = Autoscaler(opts, files, float(self.options.get("cpus") or 1), self.spec.source_names,
                                     self.planner.ranks, self.scaling)
        this = ray_module().get_runtime_context().current_actor

        def apply(change: tuple[dict, str, str]) -> None:  # on the control thread: start, then switch
            get(this.switch_layout.remote(self.prepare_layout(change[0]), change[1], change[2]))

        self.control = ControlLoop(opts.interval_s, self._figures, lambda f: get(this.autoscale_tick.remote(f)),
                                   apply)
        self.control.start()

    def _figures(self) -> dict:
        """Read by the control thread: the current loaders' and the Constructors' counters."""
        fleet = self.loaders
        return collect_figures(list(fleet.handles), list(fleet.names), list(self.constructors),
                               float(self.options.get("loader_cpus") or 0))

    def autoscale_tick(self, figures: dict) -> tuple[dict, str, str] | None:
        """One control interval (called by the control thread through this actor's queue): the layout to
        change to (layout dict, reason, kind), or None."""
        return self.autoscaler.tick(figures, self.layout, self.planner.step)

    def _seen(self) -> None:
        self.last_seen = time.monotonic()

    # ----- shared plan stream --------------------------------------------------------------------
    def info(self) -> dict:
        return {"gen": self.gen, "fingerprint": self.spec.data_fingerprint(), "ranks": self.planner.ranks,
                "sources": self.spec.source_names,
                "loaders": len(self.loaders.handles), "pmap": self.pmap.to_dict(), "layout": self.layout.to_dict(),
                "idle_timeout": self.idle_timeout, "routing_version": self.routes.version,
                "heartbeat_interval": self.trainers.interval}

    def get_loaders(self) -> list:
        return self.loaders.handles

    def seek(self, state: dict) -> int:
        """Make step state['step'] start from `state`; a no-op when the stream already does."""
        self._seen()
        step = int(state["step"])
        plan = self.window.get(step)
        if plan is not None and plan.state_before == state:
            return self.gen
        if plan is None and self.planner.step == step and self.planner.state_dict() == state:
            return self.gen
        if self.standby.rewind(self, step, state):  # a successor serving a step its predecessor planned
            return self.gen
        self.planner.load_state_dict(state)  # validates version and fingerprint
        self.window.clear()
        self.built.clear()
        self.base_state = self.planner.state_dict()
        self.gen += 1
        self.routes.forget(lambda gen, _: gen == self.gen)
        self.standby.sync(self, wait=True)
        return self.gen

    def seek_with_changes(self, state: dict) -> tuple[int, list[str]]:
        """`seek` to a state saved under another spec (weights, schedule, sources added or removed);
        returns (generation, the changes found). Always a new generation: the stream changes."""
        self._seen()
        changes = self.planner.load_state_dict(state, allow_spec_change=True) or []
        self.window.clear()
        self.built.clear()
        self.base_state = self.planner.state_dict()
        self.gen += 1
        self.standby.sync(self, wait=True)
        return self.gen, list(changes)

    def set_weights(self, weights: dict, at_step: int) -> None:
        """Run-time reweighting, applied once for the whole job (the Planner refuses a planned step)."""
        self._seen()
        self.planner.set_weights(weights, at_step)
        self.standby.sync(self, wait=True)

    def weight_overrides(self) -> list[dict]:
        """The weight changes recorded so far (`plait mix JOB --show`)."""
        return list(self.planner.state_dict().get("overrides", []))

    def report(self, step: int, losses: dict) -> None:
        self._seen()
        self.planner.report(step, losses)
        self.standby.sync(self, wait=True)

    def _plan(self, gen: int, step: int) -> StepPlan:
        if gen != self.gen:
            raise StaleGeneration(f"the plan stream was reset (generation {self.gen}, asked {gen})")
        if step in self.window:
            return self.window[step]
        if step < self.planner.step and not self.standby.rewind(self, step):
            raise PlaitError(f"step {step} left the Planner's window; resume from a saved state")
        while self.planner.step <= step:
            self.standby.align(self)
            with Stopwatch() as t:
                plan = self.planner.plan_step()
            self.metrics.telemetry.observe_plan(plan, t.seconds)
            self.planned += 1
            self.window[plan.step] = plan
            while len(self.window) > PLAN_WINDOW:
                old, _ = self.window.popitem(last=False)
                self.built.pop(old, None)
            self.routes.forget(lambda g, t: g == self.gen and t in self.window)
        self.routes.retire_due()
        self._release()
        self.loaders.after_planning(self.planner.step)
        self.standby.sync(self)
        return self.window[step]

    def step_plan(self, gen: int, step: int) -> StepPlan:
        self._seen()
        return self._plan(gen, step)

    def rank_plan(self, gen: int, step: int, dp_rank: int) -> RankPlan:
        return self._plan(gen, step).for_rank(dp_rank)

    def build_order(self, gen: int, step: int, dp_rank: int, routing_version: int | None,
                    with_state: bool = True) -> tuple[RankPlan, dict | None, dict | None]:
        """A Constructor's one call per build: the rank's plan, the state before the step (None without
        `with_state`), and the current routing when the Constructor's (`routing_version`) is not it."""
        plan = self.rank_plan(gen, step, dp_rank)
        state = self.state_at(gen, step) if with_state else None
        return plan, state, self.routes.order(gen, step, dp_rank, routing_version)

    def state_at(self, gen: int, step: int) -> dict:
        self._seen()  # also asked by Constructors, for each build a trainer requested
        if gen == self.gen and step == self.base_state["step"]:
            return self.base_state
        if gen == self.gen and step == self.planner.step:
            return self.planner.state_dict()
        return self._plan(gen, step).state_before

    def horizon(self, gen: int) -> tuple[int | None, str]:
        """The first step of `gen` a Constructor may not have planned yet (None: any) and the rank it waits
        for: the window keeps the slowest reading rank's steps, so a rank far ahead waits (docs/serving.md)."""
        low, who = self.progress.slowest(gen)
        if low is None or gen != self.gen:
            return None, ""
        return low + max(2, PLAN_WINDOW - int(self.options.get("prefetch", 2)) - 2), who

    def mark_built(self, gen: int, step: int, dp_rank: int) -> None:
        self.progress.built(gen, step, dp_rank)
        self.routes.built(gen, step, dp_rank)
        if gen != self.gen or step not in self.window:
            return
        done = self.built.setdefault(step, set())
        done.add(dp_rank)
        if len(done) == self.planner.ranks:
            self._release()
            self.standby.sync(self)  # the oldest step still needed moved

    def _release(self) -> None:
        """Tell loaders which blocks are still live: the Planner's own, and those of unbuilt steps."""
        live = self.planner.live_blocks()
        for step, plan in self.window.items():
            if len(self.built.get(step, ())) < self.planner.ranks:
                live.update(plan.items.block_keys()[0])
        for ld in self.loaders.handles:
            ld.retain.remote(live)

    def stats(self) -> dict:
        return {"planned": self.planned, "step": self.planner.step, "gen": self.gen, "clients": self.trainers.count,
                "constructors": sorted(self.constructors), "routing_version": self.routes.version,
                "retiring": [r.version for r, _ in self.routes.retiring]}

    # ----- lifetime -----------------------------------------------------------------------------
    def attach(self, fingerprint: str, ranks: int | None = None, creator: str | None = None,
               joining: bool = True, trainer: str | None = None, run: int = 0) -> int:
        """Trainer process `trainer` (its heartbeat token) joins the job. `joining=False` (a client that means
        to create the job, token `creator`) is refused unless this very actor was started by it: a live job's
        name is not reused silently (plait.runtime.ray.liveness.JobNameTaken says how long until it ends)."""
        if not joining and creator != self.creator:
            self.trainers.refuse_creator(self.job, format_age(time.time() - self.started))
        self.trainers.check_run(self.job, run)  # a later torchrun restart does not join the previous run's job
        if fingerprint != self.spec.data_fingerprint():
            raise PlaitError(f"job {self.job!r} runs a different spec (data fingerprint differs)")
        if ranks is not None and ranks != self.planner.ranks:
            raise PlaitError(f"job {self.job!r} plans for {self.planner.ranks} DP ranks, this client's topology has "
                             f"{ranks}: every trainer process of a job must use the same spec and layout")
        self._seen()
        count = self.trainers.add(trainer)
        self.standby.sync(self)
        return count

    def touch(self, trainer: str | None = None) -> None:
        """A trainer's heartbeat (on the LIVENESS_GROUP thread): the job is in use, `trainer` alive."""
        self._seen()
        self.trainers.touch(trainer)

    def register_constructor(self, name: str) -> None:
        self.constructors.add(name)
        self.standby.sync(self)

    def base(self) -> tuple[int, dict]:
        """The current generation and the data state it started from."""
        self._seen()
        return self.gen, self.base_state

    def detach(self, trainer: str | None = None) -> int:
        self._seen()
        count = self.trainers.remove(trainer)
        self.standby.sync(self)
        return count

    def shutdown(self) -> None:
        """End the job's Constructors, loaders and shadows (the caller then ends this actor)."""
        ray = ray_module()
        self.standby.close()  # first: nobody must take over from a Planner that ends
        if self.control is not None:
            self.control.stop()
        for name in self.constructors:
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE))
            except Exception:  # noqa: BLE001
                pass
        for routing in self.prepared.values():  # started for a switch that never came
            routing.fleet.retire()
        self.routes.close()

    def _end_idle_job(self, why: str = "") -> None:
        """No trainer was seen for `job_idle_timeout` seconds (or `why`): end the job, this actor last."""
        job_log.warning("job %r: %s: ending it", self.job,
                        why or f"no trainer seen for {time.monotonic() - self.last_seen:.0f} s (job_idle_timeout)")
        try:
            self.shutdown()
        finally:
            ray = ray_module()
            ray.kill(ray.get_runtime_context().current_actor)

    def job_info(self) -> dict:
        """What `plait jobs` shows (not a trainer's call: it does not keep the job alive)."""
        return {"job": self.job, "started": self.started, "clients": self.trainers.count,
                "idle_s": time.monotonic() - self.last_seen, "idle_timeout": self.idle_timeout,
                "step": self.planner.step, "metrics": self.metrics.address, **self.memory()}

    def memory(self) -> dict:
        """Resident memory of the job's actors (each measures itself), in bytes, and how many answered."""
        ray = ray_module()
        handles = list(self.loaders.handles) + [sh for group in self.loaders.shadows for sh in group]
        handles += self.standby.handles()
        for name in self.constructors:
            try:
                handles.append(ray.get_actor(name, namespace=NAMESPACE))
            except ValueError:
                pass
        total, actors = process_rss(), 1
        refs = [h.stats.remote() for h in handles]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10)
        for ref in ready:
            try:
                total += int(ray.get(ref).get("rss", 0))
                actors += 1
            except Exception:  # noqa: BLE001 - a dead actor adds nothing
                pass
        return {"rss": total, "actors": actors, "actors_asked": len(handles) + 1}

    # ----- reports, and what the loaders' recovery needs from the outside -------------------------
    def error_report(self) -> dict:
        """Records skipped, over the current loaders and those of retired layouts; a bad record that
        several loaders met (a block decoded again after a replacement or a rescale) counts once."""
        reports = self.loaders.each("error_report") + [
            rep for routing in self.routes.retired for rep in routing.fleet.final_errors]
        return merge_error_reports(reports)

    def loader_stats(self) -> list[dict]:
        return self.loaders.each("stats")

    def replace_loader(self, k: int, dead, version: int | None = None) -> dict:
        """Called by a Constructor whose gather found loader k (handle `dead`) of layout `version` dead;
        returns the current routing. A loader of an older layout was retired, not lost: nothing to replace."""
        if version is None or version == self.routes.version:
            self.loaders.replace_if_current(k, dead)
        return self.routing()

    def recovery_events(self) -> list[dict]:
        return list(self.loaders.events)

    # ----- metrics (plait.runtime.ray.job_metrics) --------------------------------------------------
    def metrics_address(self) -> str | None:
        """`host:port` of the job's /metrics endpoint; None when the spec sets no metrics port."""
        return self.metrics.address

    def record_recovery(self, role: str) -> None:
        """A trainer process recovered from a failure of `role` (planner, constructor): count it."""
        self.metrics.telemetry.observe_recovery(role)

    def _observe_event(self, event: dict) -> None:
        if event["role"] in ("loader", "shadow"):  # failures (not "shadow-start", a standby starting)
            self.metrics.telemetry.observe_recovery(event["role"])

    def get_shadows(self) -> list[list]:
        return self.loaders.shadows

    def shadow_stats(self) -> list[list[dict]]:
        return self.loaders.shadow_stats()


def merge_error_reports(reports: list[dict]) -> dict:
    """{source: {"skipped", "messages"}} of several loaders' reports: messages once each; skipped is the
    number of distinct bad records when the reports name them (else the sum)."""
    out: dict[str, dict] = {}
    where: dict[str, set] = {}
    for rep in reports:
        for name, r in rep.items():
            agg = out.setdefault(name, {"skipped": 0, "messages": []})
            agg["messages"].extend(m for m in r["messages"] if m not in agg["messages"])
            if "records" in r:
                where.setdefault(name, set()).update(tuple(w) for w in r["records"])
            else:
                agg["skipped"] += r["skipped"]
    for name, records in where.items():
        out[name]["skipped"] += len(records)
    return out


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

