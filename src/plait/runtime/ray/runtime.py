"""The driver side of the ray runtime: `RayRuntime`, what a trainer process (or `plait run`) holds.

It joins (or starts) Ray, finds or starts the job's Planner actor by name (`<job>/planner` in the `plait`
namespace, so trainer processes started by torchrun attach by job name) and its Constructor actors, and
asks them for plans and builds. Detecting a dead Planner or Constructor happens here, where a request
fails; what is then done about it is plait.runtime.ray.recovery.

The stream is the local runtime's, bit for bit: the Planner is the same class fed the same metadata
(`block_meta` is a pure function of the data), and payload gathers are pure functions of block keys.
"""

from __future__ import annotations

import functools
import math
import os
import uuid
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterator

from plait.batch import MicroBatch
from plait.job.stream import read_rank, state_after
from plait.errors import PlaitError
from plait.plan import StepPlan
from plait.state.log import PlannerLog
from plait.runtime.options import renamed
from plait.runtime.placement import LoaderLayout
from plait.runtime.ray import jobs, recovery, standby_planner
from plait.runtime.ray.common import NAMESPACE, dead_errors, get, ray_module
from plait.runtime.ray.constructor_actor import ConstructorPool
from plait.runtime.ray.pixel_rows import lost_errors, resolve_built
from plait.runtime.ray.instance import (  # noqa: F401 - check_reachable, explain_join_failure: this module's API too
    RayUse,
    check_reachable,
    explain_join_failure,
)
from plait.runtime.ray.liveness import HEARTBEAT_INTERVAL_S, JobNameTaken
from plait.runtime.ray.planner_actor import PlannerRecipe
from plait.runtime.ray.planner_host import PlannerHostActor
from plait.runtime.scaling import describe
from plait.spec import Spec, load_spec
from plait.telemetry import Telemetry


def loaders_option(loaders) -> int | str:
    """The `loaders` option: "auto" (also for None) or a positive integer."""
    if loaders is None or loaders == "auto":
        return "auto"
    try:
        n = int(loaders)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or (isinstance(loaders, float) and loaders != n):
        raise PlaitError(f"loaders must be 'auto' or a positive integer, not {loaders!r}")
    return n


@dataclass(frozen=True)
class RayOptions:
    """RayRuntime's options, checked before anything starts.

      job           name shared by all trainer processes of one job; default: a private job of this process
      attach        False (default): create job `job`; a live job of that name is an error (names are not
                    reused silently: `plait jobs stop NAME` ends the old one). True: join job `job`, which
                    another trainer process creates; waits up to 120 s for it to appear (ranks start
                    unevenly), then fails; without `address`, it joins the local instance the job's creator
                    started on this machine. `Loader.from_torchrun` sets it on ranks > 0 by itself.
      heartbeat_interval  seconds between a trainer process's heartbeats (default 5); one not heard from for
                    two intervals is gone, and a job whose trainers are all gone ends by itself. The job's
                    creator decides it. A restart under a job's name (after a crash) waits that long for the
                    old job to end, then starts it again: load the saved state to resume
      dashboard     start Ray's dashboard with the local instance plait starts (default False; a local
                    instance is set up for a long job: plait.runtime.ray.common.long_run_settings)
      job_idle_timeout  seconds without any trainer of the job seen (each attached process sends a
                    heartbeat while open) after which the job's Planner ends the job and every actor of it:
                    a trainer killed without `close()` does not leave its actors behind (default 600; None:
                    never). The job's creator decides it. A job otherwise ends when every trainer that
                    attached has closed (`Loader.close()`, the `with` block, or interpreter exit).
      joins_after   with attach: join only a job started after this time (epoch seconds, its creator's clock),
                    waiting for it meanwhile; `Loader.from_torchrun` sets it on the ranks it attaches to when
                    their process started, so a relaunch after a crash does not join (and keep alive) the
                    crashed launch's job, which ends by itself
      address       Ray address (`auto`, `ray://host:10001`); default: RAY_ADDRESS, else the cluster `ray
                    start` recorded on this machine, else a local instance plait starts
      loaders       "auto" (default) or a number of SourceLoader actors. auto: each source's cost per token
                    is measured (plait.runtime.scaling.probe_costs); loaders follow the total demand (cost x
                    mixture share x tokens per step / step_time), at most one per CPU of the cluster and
                    one per partition; an expensive source is split over several loaders, cheap ones share
                    one; pairs are dealt by measured demand (plait.runtime.placement). A number: dealt by
                    mixture weight, no probe.
      partitions    int (every source) or {source: n}: partitions per source (default: from the measured
                    demand with auto; else 1, more when there are more loaders than sources)
      step_time     seconds per training step the loaders must keep up with (auto only; default 1.0):
                    each loader is sized to be busy at most half of it
      on_layout     called with the layout, one row per loader (plait.runtime.scaling.describe), once
      build_ahead   steps each Constructor builds ahead (default 2; `prefetch` is its deprecated name)
      constructors  where batches are built: "planner" (the Planner's process builds every rank's batches:
                    one process fewer and no hop for plans; plait.runtime.ray.planner_host), "node" (a
                    Constructor actor per node, beside its trainers) or "replica" (one per DP replica).
                    "auto" (default): "planner" on a cluster of one node when the job starts, else "node"
      dp            override the topology's DP size
      loader_cpus   CPUs each loader actor reserves (default 0: placement by spreading only)
      max_cached_blocks  decoded blocks a loader keeps (LRU; plus what plans still need)
      init_options  extra keyword arguments of `ray.init` (when this runtime starts Ray)
      checkpoint_interval  steps between loader deltas to their shadows (`shadows` per source in the spec)
      respawn_delay  steps after a takeover before a new shadow starts (a worker process start-up costs
                    about a second of CPU; it should not land on the failure step)
      planner_standby  a named job's Planner has a standby that follows its per-step state and makes its
                    successor when it dies, so every trainer process continues the same stream (default
                    True; plait.runtime.ray.standby_planner). Off, or in a private job, a trainer process
                    recreates a dead Planner from the data state it last saw
      metrics_port  serve this process's own Prometheus metrics there (0: any free port; the time its ranks
                    waited for data), on the spec's `metrics.address`; off by default. The job's endpoint
                    (planning, loaders, delivered tokens, recoveries) is the Planner's, from the spec's
                    `metrics.port` (plait.runtime.ray.job_metrics)
      pixels_apart  bytes of a loader call's image pixels above which they go to the trainer as Ray objects
                    the Constructor places but never reads (default 512 KiB, what Ray would put in its object
                    store anyway; 0: always; plait.runtime.ray.pixel_rows)
      autoscale     re-partition the sources over more or fewer SourceLoaders while the job runs, following the
                    measured demand (None / False: off, the default; True: plait.runtime.autoscale's default
                    knobs; a dict of AutoscaleOptions fields: interval_s, cooldown_s, max_loader_cpus, ...). The
                    layout `loaders` gives is the starting one. The data stream never changes, only which
                    loaders decode it; `scaling_report()` lists the events (plait.runtime.ray.autoscaler)
    """

    job: str | None = None
    attach: bool = False
    joins_after: float | None = None
    job_idle_timeout: float | None = 600.0
    heartbeat_interval: float = HEARTBEAT_INTERVAL_S
    dashboard: bool = False
    address: str | None = None
    loaders: int | str | None = "auto"
    partitions: int | dict[str, int] | None = None
    step_time: float = 1.0
    on_layout: Callable[[list[dict]], None] | None = None
    build_ahead: int | None = None
    prefetch: int | None = None  # the deprecated name of build_ahead
    constructors: str = "auto"
    dp: int | None = None
    loader_cpus: float = 0
    max_cached_blocks: int = 256
    init_options: dict | None = None
    checkpoint_interval: int = 1
    respawn_delay: int = 4
    planner_standby: bool = True
    metrics_port: int | None = None
    autoscale: bool | dict | None = None
    pixels_apart: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "loaders", loaders_option(self.loaders))
        ahead = renamed("prefetch", self.prefetch, "build_ahead", self.build_ahead)
        object.__setattr__(self, "build_ahead", 2 if ahead is None else int(ahead))
        object.__setattr__(self, "prefetch", None)
        if self.autoscale is not None and self.autoscale is not False:
            from plait.runtime.autoscale import AutoscaleOptions

            object.__setattr__(self, "autoscale", AutoscaleOptions.from_option(self.autoscale).to_dict())
        step_time = self.step_time
        if not (isinstance(step_time, (int, float)) and step_time > 0 and math.isfinite(step_time)):
            raise PlaitError(f"step_time must be a positive number of seconds, not {step_time!r}")
        apart = self.pixels_apart
        if apart is not None and not (isinstance(apart, int) and not isinstance(apart, bool) and apart >= 0):
            raise PlaitError(f"pixels_apart must be a number of bytes (0 or more) or None, not {apart!r}")
        if self.constructors not in CONSTRUCTOR_MODES:
            raise PlaitError(f"constructors must be one of {', '.join(map(repr, CONSTRUCTOR_MODES))}, "
                             f"not {self.constructors!r}")
        if self.attach and not self.job:
            raise PlaitError("attach=True joins a job by name: pass job=NAME too")
        beat = self.heartbeat_interval
        if not (isinstance(beat, (int, float)) and beat > 0 and math.isfinite(beat)):
            raise PlaitError(f"heartbeat_interval must be a positive number of seconds, not {beat!r}")
        idle = self.job_idle_timeout
        if idle is not None and not (isinstance(idle, (int, float)) and idle > 0 and math.isfinite(idle)):
            raise PlaitError(f"job_idle_timeout must be a positive number of seconds or None, not {idle!r}")

    def planner_options(self, dp: int, cpus: int) -> dict:
        """What the Planner actor is told (JSON-able: it is also how a dead Planner is made again)."""
        return {"loaders": self.loaders, "partitions": self.partitions, "dp": dp, "loader_cpus": self.loader_cpus,
                "max_cached_blocks": self.max_cached_blocks, "lifetime": "detached" if self.job else None,
                "checkpoint_interval": self.checkpoint_interval, "respawn_delay": self.respawn_delay,
                "cpus": cpus, "step_time": self.step_time, "job_idle_timeout": self.job_idle_timeout,
                "heartbeat_interval": self.heartbeat_interval, "run": restart_count(),
                "autoscale": self.autoscale or None, "planner_standby": self.planner_standby,
                "constructors": self.constructors, "prefetch": self.build_ahead, "pixels_apart": self.pixels_apart}


CONSTRUCTOR_MODES = ("auto", "planner", "node", "replica")


def resolve_constructors(mode: str) -> str:
    """RayOptions.constructors with "auto" decided: the Planner builds on a cluster of one node (~1.9 CPU ms
    less per delivered image than with a Constructor actor: benchmarks/reports/2026-12-06-ray-constructors.md);
    on several nodes a Constructor per node keeps each node's batches on it."""
    if mode != "auto":
        return mode
    nodes = [n for n in ray_module().nodes() if n.get("Alive")]
    return "planner" if len(nodes) <= 1 else "node"


def restart_count() -> int:
    """Which torchrun restart this process belongs to (0 outside torchrun or before any restart)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


class RayRuntime:
    """The runtime interface (see plait.runtime) over Ray actors; options: `RayOptions`."""

    @staticmethod
    def option_names() -> list[str]:
        """The options this runtime takes (plait.runtime.make_runtime names any other)."""
        return [f.name for f in fields(RayOptions)]

    def __init__(self, spec: Spec, **options: Any):
        opts = RayOptions(**options)
        self.spec = load_spec(spec)
        # This trainer process's figures (Loader waits); served only when asked (metrics_port), before
        # anything starts (a port in use fails here, leaving nothing behind).
        self.telemetry = Telemetry(self.spec.source_names)
        port = opts.metrics_port
        self.metrics_port = None if port is None else self.telemetry.serve(port, self.spec.metrics.address)
        self._ray = RayUse(opts.address, opts.attach, opts.job, opts.init_options, opts.dashboard)
        ray = ray_module()  # imported by RayUse, after the authentication mode of the instance it joins is set
        self.shared = opts.job is not None
        self.job = opts.job or f"job-{uuid.uuid4().hex[:12]}"
        self.prefetch = opts.build_ahead
        self.dp = opts.dp or self.spec.topology.dp
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        planner_options = opts.planner_options(self.dp, cpus)
        planner_options["constructors"] = wanted = resolve_constructors(opts.constructors)
        planner_options["creator"] = uuid.uuid4().hex  # tells this client's start from another's
        host = PlannerHostActor if wanted == "planner" else None
        recipe = PlannerRecipe(self.spec.model_dump(mode="json"), self.job, planner_options,
                               self.spec.data_fingerprint(), host)
        self.membership = jobs.Membership(self.job, planner_options["creator"])
        # Refused (nothing attached) for another spec or layout, or for a live job's name without attach.
        try:
            planner = jobs.join(recipe, self.dp, planner_options["creator"], opts.attach, self.membership,
                                planner_options["run"], opts.joins_after if opts.attach else None)
        except JobNameTaken as e:  # in a Loader's terms
            raise JobNameTaken(f"{e.plain}; pass attach=True to join it, or `plait jobs stop {self.job}`",
                               plain=e.plain) from None
        self._closed = False
        self.info = get(planner.info.remote())
        self.membership.start_heartbeat(planner, jobs.heartbeat_period(self.info, opts.heartbeat_interval))
        jobs.leave_when_dropped(self, self.membership)  # a Loader garbage-collected without close() leaves
        # A recreated Planner keeps this layout (no second probe, same loaders).
        planner_options["layout"] = self.info["layout"]
        self.layout = LoaderLayout.from_dict(self.info["layout"])
        if opts.on_layout is not None:
            opts.on_layout(describe(self.layout, self.spec.source_names))
        # Where the job builds is the job's choice (its creator's): a Planner that builds is everyone's Constructor.
        hosted = self.info.get("constructors") == "planner"
        self.constructors_mode = "planner" if hosted else ("node" if wanted == "planner" else wanted)
        self._constructors = ConstructorPool(self.job, self.constructors_mode, self.prefetch, self.dp,
                                             planner_options["lifetime"])
        self._gen, base = get(self.planner.base.remote())
        self._next_step = int(base["step"])
        self._plan_refs: dict[int, Any] = {}
        self._build_refs: dict[int, Any] = {}
        self._build_step: int | None = None
        # To rebuild a dead Planner: the data state of the steps this process is at.
        self._planner_log = PlannerLog(base)
        self._failover = PlannerFailover(recipe, self.shared, self.membership, self._constructors, self._planner_log)
        jobs.close_at_exit(self)  # a trainer that exits without close() still detaches

    @property
    def planner(self):
        """The job's Planner actor (a successor's once the standby made one)."""
        return self.membership.planner

    @property
    def heartbeat(self):
        return self.membership.heartbeat

    @property
    def recovery_log(self) -> list[dict]:
        """This process's recoveries (Planner, Constructors); the loaders' are the Planner's."""
        return self._failover.recovery_log

    def _constructor_for(self, dp_rank: int):
        return self._constructors.for_rank(dp_rank, self.planner)

    # ----- driver interface ------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        step = self._next_step
        for k in range(self.prefetch + 1):
            if step + k not in self._plan_refs:
                self._plan_refs[step + k] = self.planner.step_plan.remote(self._gen, step + k)
        while True:
            try:
                plan = get(self._plan_refs.pop(step))
                break
            except dead_errors():
                self._planner_died(step)
                self._plan_refs[step] = self.planner.step_plan.remote(self._gen, step)
        self._planner_log.record(plan.state_before)
        self._next_step = step + 1
        # Ask for every rank's build now (the Constructors also start the next `prefetch` steps):
        # build() then only waits.
        self._build_refs = {r: self._constructor_for(r).get.remote(self._gen, step, r) for r in range(plan.ranks)}
        self._build_step = step
        return plan

    def build(self, plan: StepPlan, dp_rank: int, only: set[int] | None = None) -> list[MicroBatch]:
        ref = self._build_refs.pop(dp_rank, None) if self._build_step == plan.step else None
        if ref is None:
            ref = self._constructor_for(dp_rank).get.remote(self._gen, plan.step, dp_rank)
        _, batches = self._get_build(ref, plan.step, dp_rank)
        return [mb for mb in batches if only is None or mb.microbatch in only]

    def release(self, *in_flight: StepPlan) -> None:
        """Nothing to do: the Planner tells loaders what is live as Constructors finish steps."""

    def iter_rank(self, dp_rank: int, start_state: dict, start_micro: int, max_steps: int | None,
                  cp_rank: int = 0) -> Iterator[tuple[dict, MicroBatch]]:
        """One rank's micro-batches from a data state on, each cut to CP rank `cp_rank`'s shard by the
        Constructor. Every rank of the job reads the same, once-planned stream; the DP replica's
        Constructor builds each step once for all its ranks."""
        self._seek(start_state)
        cp = (self.spec.topology.cp, cp_rank)

        def request(step: int):  # sent before the previous step's batches are handed out: built meanwhile
            return self._constructor_for(dp_rank).get.remote(self._gen, step, dp_rank, max_steps, cp)

        def receive(ref, step: int) -> tuple[dict, list[MicroBatch]]:
            state, batches = self._get_build(ref, step, dp_rank, (max_steps, cp))
            self._planner_log.record(state)
            return state, batches

        return read_rank(request, receive, int(start_state["step"]), start_micro, max_steps)

    def _get_build(self, ref, step: int, dp_rank: int, extra: tuple = ()):
        """A build's result; if its Constructor died, a new one rebuilds the step (asked again with the
        same `extra` arguments: limit, CP rank); if the Planner died, it is recreated first."""
        while True:
            try:
                return resolve_built(get(ref))
            except lost_errors():  # its pixels' owner (the Constructor) or their node died after it answered
                self._failover.constructor_died(dp_rank, step)  # a dead one is replaced: the new one builds
                # a live one (their node died) would answer its cached build, the same lost pixels: forgotten
                get(self._constructor_for(dp_rank).forget_build.remote(self._gen, step, dp_rank, *extra[1:]))
                ref = self._constructor_for(dp_rank).get.remote(self._gen, step, dp_rank, *extra)
            except dead_errors():
                if recovery.planner_alive(self.planner):
                    self._failover.constructor_died(dp_rank, step)
                else:  # the Constructor failed because the Planner (and its loaders) are gone
                    self._planner_died(step)
                ref = self._constructor_for(dp_rank).get.remote(self._gen, step, dp_rank, *extra)

    def _planner_died(self, step: int) -> None:
        """Continue with the successor the standby made (same generation: the builds asked for stand) or
        with a Planner recreated from this process's data state (a new generation)."""
        gen = self._failover.replace(step)
        stale = list(self._plan_refs.values()) + (list(self._build_refs.values()) if gen is not None else [])
        collect_errors(stale)
        self._plan_refs.clear()
        if gen is not None:
            self._build_refs = {}
            self._gen = gen
        self.info = self._failover.info

    def ask_planner(self, method: str, *args, timeout: float | None = None):
        """`method(*args)` of the job's Planner; if it died, of the successor its standby made (without
        a standby the error stands)."""
        try:
            return get(getattr(self.planner, method).remote(*args), timeout=timeout)
        except dead_errors():
            if not self._failover.take_over():
                raise
            collect_errors(list(self._plan_refs.values()))
            self._plan_refs.clear()
            self.info = self._failover.info
        return get(getattr(self.planner, method).remote(*args), timeout=timeout)

    def _seek(self, state: dict) -> None:
        gen = self.ask_planner("seek", state)
        if gen != self._gen:
            self._plan_refs.clear()
        self._gen = gen
        self._next_step = int(state["step"])

    def state_dict(self) -> dict:
        return self.ask_planner("state_at", self._gen, self._next_step)

    def state_after(self, step: int) -> dict | None:
        """The data state after `step`: the start of the next one (the Planner's window holds it)."""
        return state_after(functools.partial(self.ask_planner, "state_at"), self._gen, step)

    def load_state_dict(self, state: dict, *, allow_spec_change: bool = False) -> list[str]:
        if not allow_spec_change:
            self._seek(state)
            return []
        gen, changes = get(self.planner.seek_with_changes.remote(state))
        self._plan_refs.clear()
        self._gen = gen
        self._next_step = int(state["step"])
        return changes

    def replan_after(self, state: dict, layout: dict) -> dict:
        """An elastic resume's re-planning, done by the job's Planner actor (not in the trainer)."""
        return self.ask_planner("replan_after", state, layout)

    def set_weights(self, weights: dict[str, float], at_step: int) -> None:
        """Ray: the job's one Planner applies it, so call it from one rank (any); a planned step is refused."""
        self.ask_planner("set_weights", weights, at_step)

    def report(self, step: int, losses: dict[str, float]) -> None:
        self.ask_planner("report", step, losses)

    def error_report(self) -> dict:
        return get(self.planner.error_report.remote())

    # ----- introspection (tests, benchmarks, chaos drills) ---------------------------------------------
    def metrics_address(self) -> str | None:
        """`host:port` of the job's /metrics endpoint (served by its Planner), None without metrics.port."""
        return get(self.planner.metrics_address.remote())

    def recovery_events(self) -> list[dict]:
        """Every failure survived so far: SourceLoaders (replaced by the Planner) and Constructors."""
        return get(self.planner.recovery_events.remote()) + list(self.recovery_log)

    def scaling_report(self) -> dict:
        """The loader layout's changes while the job ran: {"events", "timeline", "options", "initial"}
        (plait.runtime.ray.autoscaler.ScalingRecord; events also come from `rescale`)."""
        return get(self.planner.scaling_report.remote())

    def rescale(self, layout: LoaderLayout | dict, reason: str = "manual") -> int:
        """Re-partition the job's sources over a new loader layout now (what the autoscaler does, by hand:
        benchmarks and tests); returns the layout version. The data stream does not change."""
        return get(self.planner.rescale.remote(layout.to_dict() if isinstance(layout, LoaderLayout) else layout, reason))

    def builders(self) -> dict[str, Any]:
        """The actors building this process's batches (ConstructorPool.builders; to kill in a chaos test)."""
        return self._constructors.builders(self.planner)

    def stats(self) -> dict:
        out = get(self.planner.stats.remote())
        out["loaders"] = get(self.planner.loader_stats.remote())
        out["constructors"] = {k: get(c.stats.remote()) for k, c in self.builders().items()}
        return out

    def close(self) -> None:
        """Release what this runtime started (its job's actors when it is the job's last client, the local
        Ray instance when it is its last user); never starts anything."""
        if self._closed:
            return
        self._closed = True
        jobs.closed(self)
        left = self.membership.leave()  # the last trainer out ends the job's actors
        if left is not None and left <= 0:
            for _, c in self._constructors.items():
                ray_module().kill(c)
        self._ray.release()


class PlannerFailover:
    """What a trainer process does when the job's Planner or one of its Constructors died (found where a
    request failed): a shared job's standby makes the successor (once for all processes; same generation,
    same stream: plait.runtime.ray.standby_planner), else the Planner is recreated from the data state this
    process last saw (plait.runtime.ray.recovery.recreate_planner); a dead Constructor is replaced. Every
    recovery is kept (`recovery_log`) and counted once on the job's endpoint."""

    def __init__(self, recipe: PlannerRecipe, shared: bool, membership: jobs.Membership,
                 constructors: ConstructorPool, planner_log: PlannerLog):
        self.recipe = recipe  # how to make the Planner again, should it die
        self.shared = shared
        self.membership = membership  # holds the Planner's handle (its heartbeat follows it)
        self.constructors = constructors
        self.planner_log = planner_log
        self.info: dict = {}  # the current Planner's info, after a replacement
        self.recovery_log: list[dict] = []

    def take_over(self) -> bool:
        """The successor the standby made, if the job has one: True when there is one now."""
        successor = standby_planner.successor(self.recipe.job, self.membership.planner) if self.shared else None
        if successor is None:
            return False
        self.membership.planner, event = successor
        self.info = get(self.membership.planner.info.remote())
        self.recovery_log.append(event)  # counted once on the job's endpoint, by the successor
        self.membership.news.tell(event)
        return True

    def replace(self, step: int) -> int | None:
        """A new Planner for the dead one: None when a successor continues the generation, else the new
        generation of a recreated Planner (seeked to this process's data state at `step`)."""
        if self.take_over():
            return None
        planner, gen, event = recovery.recreate_planner(self.recipe, self.planner_log.latest(), self.constructors,
                                                        step)
        self.membership.planner = planner
        self.info = get(planner.info.remote())
        self.recovered(event)
        return gen

    def constructor_died(self, dp_rank: int, step: int) -> None:
        event = recovery.replace_dead_constructors(self.constructors, self.membership.planner, step, dp_rank)
        if event is not None:
            self.recovered(event)

    def recovered(self, event: dict) -> None:
        """Keep a recovery of this process's (Planner, Constructor) and count it on the job's endpoint."""
        self.recovery_log.append(event)
        self.membership.planner.record_recovery.remote(event["role"])


def collect_errors(refs: list) -> None:
    """Collect the errors of requests to dead actors (else Ray reports them as unhandled)."""
    for ref in refs:
        try:
            get(ref, timeout=0.5)
        except Exception:  # noqa: BLE001
            pass

