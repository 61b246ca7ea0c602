"""Run-time autoscaling of a ray job's SourceLoaders: measure, ask the controller, record.

The Planner actor runs the loop (`RayOptions.autoscale`). Every `interval_s` a daemon thread of the
Planner reads, without holding up planning, the loaders' production counters (per source: busy seconds,
tokens, samples, images; plait.roles.source_loader `count_production`) and the Constructors' consumption
(per DP rank: steps requested by its trainer, seconds it waited for a build), plus the cluster's free CPUs
(`collect_figures`). The Planner turns them into one `plait.runtime.autoscale.Observation` of the interval
(`ProductionMeter`), asks the `Controller` and applies its Decision through `PlannerActor.rescale`
(plait.runtime.ray.routing): the data stream does not change, only which loaders decode it.

`ScalingRecord` keeps what `scaling_report()` returns (the last events, the recent timeline of the layout, waits and
busy fractions) and the job's Prometheus series: `plait_rescale_events_total{kind}`,
`plait_source_loaders{source}`, `plait_loader_demand_unmet`. Every event is logged on `plait.scaling`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

import numpy as np
from prometheus_client import Counter, Gauge

from plait.runtime.placement import LoaderLayout
from plait.runtime.ray.common import NAMESPACE, ray_module
from plait.runtime.ray.job_metrics import ask
from plait.runtime.ray.routing import loaders_per_source

log = logging.getLogger("plait.scaling")


TIMELINE_KEPT = 1800  # control intervals kept in the timeline: the last hour at the default 2 s
EVENTS_KEPT = 1000  # rescales and unmet-demand reports kept (the counter counts them all)


class ScalingRecord:
    """A job's scaling events and timeline, and their Prometheus series (on the job's registry).

    A job may run for weeks: the timeline keeps its last TIMELINE_KEPT intervals and the events their
    last EVENTS_KEPT (an interval's row names every source, a few KiB with many sources)."""

    def __init__(self, names: list[str], registry, options: dict | None):
        self.names = names
        self.options = options
        self.started = time.monotonic()
        self.events: deque[dict] = deque(maxlen=EVENTS_KEPT)
        self.timeline: deque[dict] = deque(maxlen=TIMELINE_KEPT)
        self.initial: dict | None = None
        self.rescales = Counter("plait_rescale_events", "Loader layout changes (up, down, manual) and reports of "
                                "demand the loaders cannot meet (unmet), by kind", ["kind"], registry=registry)
        self.per_source = Gauge("plait_source_loaders", "SourceLoaders serving each source (a loader shared by "
                                "several sources counts by its share of their partitions)", ["source"],
                                registry=registry)
        self.unmet = Gauge("plait_loader_demand_unmet", "1 while the measured demand cannot be met within the "
                           "loader CPU budget", registry=registry)

    def now(self) -> float:
        return round(time.monotonic() - self.started, 3)

    def layout_figures(self, layout: LoaderLayout) -> dict:
        return {"loaders": layout.loaders,
                "partitions": {self.names[s]: int(n) for s, n in sorted(layout.num_partitions.items())},
                "loaders_per_source": loaders_per_source(layout, self.names)}

    def start(self, layout: LoaderLayout) -> None:
        self.initial = {"t": 0.0, "step": 0, **self.layout_figures(layout)}
        self._gauges(layout)

    def event(self, kind: str, reason: str, step: int, layout: LoaderLayout) -> dict:
        """A rescale (`layout` is the new one) or an unmet report (the current one); logged and counted."""
        ev = {"t": self.now(), "step": int(step), "kind": kind, "reason": reason, **self.layout_figures(layout)}
        self.events.append(ev)
        self.rescales.labels(kind).inc()
        if kind == "unmet":
            self.unmet.set(1)
            log.warning("step %d: loader demand unmet: %s", step, reason)
        else:
            self.unmet.set(0)
            self._gauges(layout)
            parts = ", ".join(f"{n}: {p}" for n, p in ev["partitions"].items())
            log.warning("step %d: rescale (%s) to %d loader(s) [partitions %s]: %s", step, kind, layout.loaders,
                        parts, reason)
        return ev

    def sample(self, step: int, layout: LoaderLayout, obs: dict) -> dict:
        row = {"t": self.now(), "step": int(step), "loaders": layout.loaders,
               "loaders_per_source": loaders_per_source(layout, self.names), "wait_s": round(obs["wait_s"], 4),
               "steps": int(obs["steps"]), "busy": [round(b, 3) for b in obs["loader_busy"]]}
        self.timeline.append(row)
        return row

    def report(self) -> dict:
        return {"events": list(self.events), "timeline": list(self.timeline), "options": self.options,
                "initial": self.initial}

    def _gauges(self, layout: LoaderLayout) -> None:
        for name, n in loaders_per_source(layout, self.names).items():
            self.per_source.labels(name).set(n)


def collect_figures(handles: list, names: list[str], constructor_names: list[str], loader_cpus: float) -> dict:
    """What one control interval reads (from the autoscaling thread, not the Planner's call queue): each
    loader's telemetry, each Constructor's stats (None where an actor did not answer) and the CPUs the
    cluster could still give loaders (`ray.available_resources`; a loader that reserves less than a CPU
    still uses one)."""
    ray = ray_module()
    cons = []
    for name in constructor_names:
        try:
            cons.append(ray.get_actor(name, namespace=NAMESPACE))
        except ValueError:  # gone (being replaced)
            pass
    telemetry = ask([h.telemetry.remote() for h in handles])
    stats = ask([c.stats.remote() for c in cons])
    free = float(ray.available_resources().get("CPU", 0.0)) - len(handles) * max(0.0, 1.0 - float(loader_cpus))
    return {"t": time.monotonic(), "loaders": list(zip(names, telemetry)), "constructors": stats,
            "free_cpus": max(0.0, free)}


class ProductionMeter:
    """Cumulative counters (loaders by actor name, Constructors' per-rank figures) -> one interval's
    figures: the fields of plait.runtime.autoscale.Observation."""

    def __init__(self, num_sources: int, ranks: int):
        self.num_sources = num_sources
        self.ranks = max(1, ranks)
        self.last_t = time.monotonic()
        self.loaders: dict[str, np.ndarray] = {}  # loader name -> [source, (busy_s, tokens, samples, images)]
        self.consumed = 0  # global steps every rank has asked for
        self.waited: dict[tuple[int, int], float] = {}  # (Constructor pid, rank) -> seconds waited

    def observe(self, figures: dict) -> dict:
        elapsed = max(1e-9, figures["t"] - self.last_t)
        self.last_t = figures["t"]
        tokens = np.zeros(self.num_sources)
        busy_s = np.zeros(self.num_sources)
        loader_busy = []
        for name, tel in figures["loaders"]:
            if tel is None:  # did not answer in time: idle for this interval, counted at the next
                loader_busy.append(0.0)
                continue
            now = np.zeros((self.num_sources, 4))
            for s, row in tel.get("produced", {}).items():
                now[int(s)] = row
            delta = np.maximum(now - self.loaders.get(name, 0.0), 0.0)
            self.loaders[name] = now
            tokens += delta[:, 1]
            busy_s += delta[:, 0]
            loader_busy.append(float(min(1.0, delta[:, 0].sum() / elapsed)))
        steps, wait = self._consumption([c for c in figures["constructors"] if c is not None])
        return {"elapsed_s": float(elapsed), "steps": int(steps), "wait_s": float(wait),
                "source_tokens": tokens.tolist(), "source_busy_s": busy_s.tolist(), "loader_busy": loader_busy,
                "free_cpus": figures.get("free_cpus")}

    def _consumption(self, stats: list[dict]) -> tuple[int, float]:
        """(global steps consumed in the interval: those every rank has asked for; seconds waited: mean
        over ranks). A rank whose Constructor did not answer holds the count until it does."""
        consumed: dict[int, int] = {}
        waited = 0.0
        for st in stats:
            for rank, n in st.get("consumed", {}).items():
                consumed[int(rank)] = max(consumed.get(int(rank), 0), int(n))
            for rank, w in st.get("wait_s", {}).items():
                key = (int(st.get("pid", 0)), int(rank))
                waited += max(0.0, float(w) - self.waited.get(key, 0.0))
                self.waited[key] = float(w)
        steps = 0
        if len(consumed) >= self.ranks:
            now = min(consumed.values())
            steps, self.consumed = max(0, now - self.consumed), max(now, self.consumed)
        return steps, waited / self.ranks


class Autoscaler:
    """The Planner's controller loop state: the Controller, the meter, and what to do with a Decision."""

    def __init__(self, options, num_files: list[int], cpus: float, names: list[str], ranks: int,
                 record: ScalingRecord):
        from plait.runtime.autoscale import Controller

        self.options = options
        self.controller = Controller(options, num_files, cpus, names)
        self.meter = ProductionMeter(len(names), ranks)
        self.record = record

    def tick(self, figures: dict, layout: LoaderLayout, step: int) -> tuple[dict, str, str] | None:
        """One interval: measure and decide. Returns the change to make (layout dict, reason, kind) or
        None; unmet demand is recorded here (no change)."""
        from plait.runtime.autoscale import Observation

        obs = self.meter.observe(figures)
        self.record.sample(step, layout, obs)
        decision = self.controller.observe(Observation(**obs), layout, time.monotonic())
        if decision is None:
            return None
        if decision.kind == "unmet" or decision.layout is None:
            self.record.event("unmet", decision.reason, step, layout)
            return None
        return decision.layout.to_dict(), decision.reason, decision.kind


class ControlLoop(threading.Thread):
    """A daemon thread of the Planner actor: every `interval_s`, `collect()` (remote reads), `tick()` (the
    Planner's own method, through its call queue, so it never runs beside planning) and, when that returns
    a change, `apply(change)` (new loaders start here, off the queue; only the switch goes through it)."""

    def __init__(self, interval_s: float, collect: Callable[[], dict], tick: Callable[[dict], tuple | None],
                 apply: Callable[[tuple], None]):
        super().__init__(name="plait-autoscale", daemon=True)
        self.interval_s = float(interval_s)
        self.collect = collect
        self.tick = tick
        self.apply = apply
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                change = self.tick(self.collect())
                if change is not None and not self.stopped.is_set():
                    self.apply(change)
            except Exception as e:  # noqa: BLE001 - a failed interval is skipped, the loop goes on
                if self.stopped.is_set():
                    return
                log.warning("autoscaling interval skipped: %s", e)

    def stop(self) -> None:
        self.stopped.set()
