"""Which loader actors serve which blocks, and how that changes while a job runs (re-partitioning).

A `Routing` is one version of the job's loader layout: the `LoaderLayout`, its `PartitionMap` and the
`LoaderFleet` (loaders and shadows) that serves it. Version 0 is decided at start; each
`PlannerActor.rescale` makes the next one. Which loader decodes a block is invisible in the data (a block
is a pure function of its key, decoded the same by any loader), so switching versions never changes a
step's samples or their order: blocks the old loaders buffered are simply decoded again by their new
owners.

`RoutingTable` is the Planner's side. It hands a Constructor the current routing next to the plan it
asks for anyway (`build_order`: no extra call per build), remembers which build orders went out under which
version, and ends (`retire`) an old version's loaders once no build handed out under it is still
unfinished, or at the latest `RETIRE_GRACE_S` after the switch. A gather that races a retirement finds a
dead actor, asks the Planner (`replace_loader`) and is repeated on the new owners: never lost.

`Route` is the Constructor's side: the version, map and handles it gathers with.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from plait.errors import PlaitError
from plait.runtime.placement import LoaderLayout, PartitionMap
from plait.runtime.ray.recovery import LoaderFleet
from plait.spec import Spec

log = logging.getLogger("plait.scaling")
RETIRE_GRACE_S = 30.0  # the latest an old layout's loaders end after a switch (unfinished builds retry)


@dataclass
class Routing:
    """One version of the loader layout and the fleet serving it."""

    version: int
    layout: LoaderLayout
    pmap: PartitionMap
    fleet: LoaderFleet

    def to_dict(self) -> dict:
        """What a Constructor gathers with (`Route.from_dict`)."""
        return {"version": self.version, "pmap": self.pmap.to_dict(), "handles": list(self.fleet.handles)}


class RoutingTable:
    """The current Routing, the versions being retired, and the build orders each version handed out."""

    def __init__(self, current: Routing):
        self.current = current
        self.retiring: list[tuple[Routing, float]] = []  # (old routing, time it ends at the latest)
        self.orders: dict[tuple[int, int, int], int] = {}  # (gen, step, dp rank) -> version it was built with
        self.retired: list[Routing] = []  # ended versions (their loaders' final error reports)

    @property
    def version(self) -> int:
        return self.current.version

    def order(self, gen: int, step: int, dp_rank: int, known: int | None) -> dict | None:
        """A Constructor is about to build (gen, step, dp_rank) with routing version `known`: record the
        order; the current routing when the Constructor's is another version (else None)."""
        self.orders[(gen, step, dp_rank)] = self.version
        return None if known == self.version else self.current.to_dict()

    def built(self, gen: int, step: int, dp_rank: int) -> None:
        self.orders.pop((gen, step, dp_rank), None)
        self.retire_due()

    def forget(self, keep) -> None:
        """Drop orders that `keep(gen, step)` says can no longer finish (another generation, a step out of
        the Planner's window): a build that never reports must not hold old loaders up."""
        self.orders = {key: v for key, v in self.orders.items() if keep(key[0], key[1])}

    def switch(self, new: Routing) -> Routing:
        """Make `new` current; the old one retires when its builds are done (`retire_due`)."""
        old, self.current = self.current, new
        self.retiring.append((old, time.monotonic() + RETIRE_GRACE_S))
        self.retire_due()
        return old

    def retire_due(self) -> None:
        """End every old version no unfinished order uses (or whose grace period is over)."""
        if not self.retiring:
            return
        now = time.monotonic()
        in_use = set(self.orders.values())
        keep = []
        for routing, deadline in self.retiring:
            if now < deadline and routing.version in in_use:
                keep.append((routing, deadline))
                continue
            why = "its builds are done" if now < deadline else f"grace period of {RETIRE_GRACE_S:.0f} s over"
            log.info("layout v%d retired: %d loader(s) end (%s)", routing.version, routing.layout.loaders, why)
            routing.fleet.retire()
            self.retired.append(routing)
        self.retiring = keep

    def close(self) -> None:
        """The job ends: close the current fleet, end the retiring ones."""
        for routing, _ in self.retiring:
            routing.fleet.retire()
        self.retiring = []
        self.current.fleet.close()


class RoutingUpkeep:
    """The routing table's upkeep, as a Planner observer (plait.runtime.ray.planner_requests): after planning,
    orders for steps out of the plan `window` (a job.window.PlanWindow) are forgotten and due versions end;
    after a new generation (a seek), orders of older generations are forgotten."""

    def __init__(self, routes: RoutingTable, window):
        self.routes = routes
        self.window = window

    def on_planned(self, plans) -> None:
        gen, held = self.window.gen, self.window.steps
        self.routes.forget(lambda g, step: g == gen and step in held)
        self.routes.retire_due()

    def on_request(self, request) -> None:
        if request.state:  # a seek may have started a new generation: builds of the old one never report
            gen = self.window.gen
            self.routes.forget(lambda g, _: g == gen)


class Route:
    """A Constructor's view of the routing: (version, PartitionMap, loader handles), swapped as a whole
    (each fetch reads it once, so concurrent builds never mix two versions)."""

    def __init__(self, routing: dict):
        self.lock = threading.Lock()
        self.now = (int(routing["version"]), PartitionMap(**routing["pmap"]), list(routing["handles"]))

    @property
    def version(self) -> int:
        return self.now[0]

    def update(self, routing: dict | None) -> None:
        """Take a routing the Planner sent, unless a newer one arrived first (replies may overtake)."""
        if routing is None:
            return
        with self.lock:
            if int(routing["version"]) >= self.now[0]:
                self.now = (int(routing["version"]), PartitionMap(**routing["pmap"]), list(routing["handles"]))


def check_layout(layout: LoaderLayout, spec: Spec) -> None:
    """A layout must give every (source, partition) pair exactly one loader; a PlaitError says which not."""
    if sorted(layout.num_partitions) != list(range(len(spec.sources))):
        raise PlaitError(f"layout.num_partitions must name every source index 0..{len(spec.sources) - 1}, "
                         f"not {sorted(layout.num_partitions)}")
    if not layout.owned or any(not pairs for pairs in layout.owned):
        raise PlaitError("layout.owned must give every loader at least one (source, partition) pair")
    want = sorted((s, p) for s, n in layout.num_partitions.items() for p in range(n))
    got = sorted(pair for pairs in layout.owned for pair in pairs)
    if got != want:
        missing = sorted(set(want) - set(got))
        extra = sorted({pair for pair in got if got.count(pair) > 1} | (set(got) - set(want)))
        raise PlaitError(f"layout.owned must hold each (source, partition) pair exactly once: missing {missing}, "
                         f"repeated or unknown {extra}")


def loaders_per_source(layout: LoaderLayout, names: list[str]) -> dict[str, float]:
    """Per source, the loaders it has: each loader counts by the fraction of its pairs of that source."""
    out = {name: 0.0 for name in names}
    for pairs in layout.owned:
        for s, _ in pairs:
            out[names[s]] += 1.0 / len(pairs)
    return {name: round(v, 3) for name, v in out.items()}
