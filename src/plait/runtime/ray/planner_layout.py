"""The Planner actor's loader layouts: the first one, and changing it while the job runs.

`LayoutControl` decides the first layout (plait.runtime.placement; measured in a throw-away Ray task for
`loaders="auto"`: plait.runtime.ray.layout_probe), starts its loaders and their shadows (a `LoaderFleet`,
plait.runtime.ray.recovery) and holds the routing table (plait.runtime.ray.routing). A rescale (by hand, or
by the autoscaling loop of `RayOptions.autoscale`: plait.runtime.ray.autoscaler) starts a new layout's
loaders (`prepare`, off the Planner's call queue: it takes seconds) and switches to it between two planning
calls (`switch`). The Planner reads block metadata through `LoaderMetadata`, which always asks the current
layout's owner of a block. The stream never changes, only which loaders decode it.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Callable

from plait.runtime.placement import LoaderLayout, PartitionMap
from plait.runtime.ray.autoscaler import Autoscaler, ControlLoop, ScalingRecord, collect_figures
from plait.runtime.ray.common import dead_errors, get
from plait.runtime.ray.layout_probe import layout_for
from plait.runtime.ray.loader_actor import LoaderConfig
from plait.runtime.ray.planner_requests import LAYOUT, LOADERS, planner_call
from plait.runtime.ray.recovery import LoaderFleet, end_unused_loaders
from plait.runtime.ray.routing import Routing, RoutingTable, check_layout
from plait.spec import Spec


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


class LayoutControl:
    """The job's layouts. `now()` is the Planner's step, `on_replaced()` what the Planner does after a loader
    was replaced or the layout switched (tell the loaders which blocks are live)."""

    def __init__(self, spec: Spec, spec_dict: dict, job: str, options: dict, now: Callable[[], int],
                 on_replaced: Callable[[], None]):
        self.spec, self.options = spec, options
        self.now, self.on_replaced = now, on_replaced
        layout = layout_for(spec, options)
        # A successor (plait.runtime.ray.standby_planner) continues the dead Planner's layout version: its
        # loaders, found by their versioned names, and the routing version the Constructors hold.
        version = int(options.get("layout_version") or 0)
        fleet = self._fleet(replace(LoaderConfig.from_options(job, spec_dict, layout, options), version=version),
                            options)
        self.num_files: dict[int, int] = {}
        for counts in get([ld.num_files.remote() for ld in fleet.handles]):
            self.num_files.update({int(s): n for s, n in counts.items()})
        owner = layout.owner()
        pmap = PartitionMap(spec.seed, self.num_files, layout.num_partitions, owner)
        self.routes = RoutingTable(Routing(version, layout, pmap, fleet))
        self.prepared: dict[int, Routing] = {}  # layouts started, not yet switched to (prepare)
        self.version_lock, self.last_version = threading.Lock(), version
        by_loader: dict[int, list[int]] = {}
        for s in range(len(spec.sources)):
            by_loader.setdefault(owner[(s, 0)], []).append(s)
        first: dict[int, tuple] = {}
        for part in get([fleet.handles[k].first_keys.remote(srcs) for k, srcs in by_loader.items()]):
            first.update({int(s): tuple(v) for s, v in part.items()})
        self.metadata = LoaderMetadata(fleet, pmap, first)
        if "takeover" not in options:  # a successor's start later (plait.runtime.ray.standby_planner)
            fleet.start_shadows()
        if options.get("lifetime") == "detached":  # a successor's or a recreated Planner's: no loader of the
            end_unused_loaders(fleet)  # job it does not use runs on (a fresh job's name had none left)
        self.scaling: ScalingRecord | None = None
        self.autoscaler: Autoscaler | None = None
        self.control: ControlLoop | None = None

    @property
    def fleet(self) -> LoaderFleet:
        return self.routes.current.fleet

    @property
    def layout(self) -> LoaderLayout:
        return self.routes.current.layout

    def _fleet(self, config: LoaderConfig, options: dict | None = None, previous=None) -> LoaderFleet:
        """The loaders of `config`'s layout. Only the first fleet takes `loader_generations` and `loader_names`
        (a successor's view of the dead Planner's loaders); a new layout's loaders start at generation 0."""
        first_only = ("loader_generations", "loader_names")
        options = options if options is not None else {k: v for k, v in self.options.items() if k not in first_only}
        return LoaderFleet(config, self.spec, options, now=self.now, on_replaced=self.on_replaced, previous=previous)

    # ----- changing the layout ----------------------------------------------------------------------
    def prepare(self, layout_dict: dict) -> int:
        """Start the loaders (and shadows) of a new layout and wait until they answer; returns its version
        (`switch` makes it current). Runs beside planning (the autoscaling thread calls it directly)."""
        layout = LoaderLayout.from_dict(layout_dict)
        check_layout(layout, self.spec)
        with self.version_lock:
            self.last_version += 1
            version = self.last_version
        current = self.fleet
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

    def switch(self, version: int, reason: str, kind: str) -> int:
        """Make the prepared layout `version` current (between two planning calls); returns the current
        version (an older prepared one than the current is ended instead)."""
        new = self.prepared.pop(version)
        if new.version < self.routes.version:
            new.fleet.retire()
            return self.routes.version
        self.routes.switch(new)
        self.metadata.fleet, self.metadata.pmap = new.fleet, new.pmap
        self.on_replaced()
        self.scaling.event(kind, reason, self.now(), new.layout)
        return version

    # ----- the autoscaling loop ------------------------------------------------------------------------
    def record(self, registry) -> None:
        """Keep the layout's timeline (and its gauges in the job's metrics `registry`)."""
        self.scaling = ScalingRecord(self.spec.source_names, registry, self.options.get("autoscale"))
        self.scaling.start(self.layout)

    def start_autoscaling(self, ranks: int, constructors: Callable[[], list[str]], actor) -> None:
        """Follow the measured demand: every interval the control thread reads the loaders' and the
        `constructors()`' counters, asks `actor` (the Planner's handle: its call queue) for a decision
        (`tick`), starts the new layout here and has `actor` switch to it."""
        from plait.runtime.autoscale import AutoscaleOptions

        opts = AutoscaleOptions.from_option(self.options["autoscale"])
        files = [self.num_files[s] for s in range(len(self.spec.sources))]
        self.autoscaler = Autoscaler(opts, files, float(self.options.get("cpus") or 1), self.spec.source_names,
                                     ranks, self.scaling)

        def figures() -> dict:
            fleet = self.fleet
            return collect_figures(list(fleet.handles), list(fleet.names), constructors(),
                                   float(self.options.get("loader_cpus") or 0))

        def apply(change: tuple[dict, str, str]) -> None:  # on the control thread: start, then switch
            get(actor.switch_layout.remote(self.prepare(change[0]), change[1], change[2]))

        self.control = ControlLoop(opts.interval_s, figures, lambda f: get(actor.autoscale_tick.remote(f)), apply)
        self.control.start()

    def tick(self, figures: dict) -> tuple[dict, str, str] | None:
        """One control interval: the layout to change to (layout dict, reason, kind), or None."""
        return self.autoscaler.tick(figures, self.layout, self.now())

    def close(self) -> None:
        """The job ends: the control loop stops, every layout's loaders end."""
        if self.control is not None:
            self.control.stop()
        for routing in self.prepared.values():  # started for a switch that never came
            routing.fleet.retire()
        self.routes.close()


class LayoutRequests:
    """The Planner actor's requests about its loader layout (a part of plait.runtime.ray.planner_actor's
    PlannerActor, which holds `layouts`, `lock` and `observers`)."""

    layouts: LayoutControl

    @property
    def routes(self):
        return self.layouts.routes

    @property
    def loaders(self) -> LoaderFleet:
        return self.layouts.fleet

    @property
    def layout(self) -> LoaderLayout:
        return self.layouts.layout

    @property
    def pmap(self) -> PartitionMap:
        return self.routes.current.pmap

    @planner_call()
    def routing(self) -> dict:
        """The current routing (version, PartitionMap, loader handles), as a Constructor starts with it."""
        return self.routes.current.to_dict()

    @planner_call()
    def rescale(self, layout_dict: dict, reason: str = "manual", kind: str = "manual") -> int:
        """Re-partition the sources over new loaders (`layout_dict`: a LoaderLayout's to_dict); returns the new
        layout version. The new loaders (and their shadows) start under names of their own and answer the
        Planner's metadata from now on; Constructors get the new routing with their next build order; the
        old loaders end once no build handed out under them is unfinished. The stream does not change."""
        return self.switch_layout(self.prepare_layout(layout_dict), reason, kind)

    def prepare_layout(self, layout_dict: dict) -> int:
        """Start the loaders (and shadows) of a new layout and wait until they answer; returns its version
        (`switch_layout` makes it current). Not a locked request: planning goes on meanwhile."""
        return self.layouts.prepare(layout_dict)

    @planner_call(LAYOUT)  # the standby must know the layout in use before anyone can need a successor
    def switch_layout(self, version: int, reason: str = "manual", kind: str = "manual") -> int:
        """Make the prepared layout `version` current (between two planning calls)."""
        return self.layouts.switch(version, reason, kind)

    @planner_call()
    def scaling_report(self) -> dict:
        """Rescaling events and the timeline of the layout (plait.runtime.ray.autoscaler.ScalingRecord)."""
        return self.layouts.scaling.report()

    @planner_call()
    def autoscale_tick(self, figures: dict) -> tuple[dict, str, str] | None:
        """One control interval (called by the control thread through this actor's queue)."""
        return self.layouts.tick(figures)

    @planner_call(LOADERS)
    def replace_loader(self, k: int, dead, version: int | None = None) -> dict:
        """Called by a Constructor whose gather found loader k (handle `dead`) of layout `version` dead;
        returns the current routing. A loader of an older layout was retired, not lost: nothing to replace."""
        if version is None or version == self.routes.version:
            self.loaders.replace_if_current(k, dead)
        return self.routing()
