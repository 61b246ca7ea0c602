"""Placement: which SourceLoader owns which partition of which source, and so which loader holds a block.

Everything about dealing sources out to loaders lives here, for both ways a layout is decided:

  * measured (`loaders="auto"`): `demand_of` turns each source's measured cost (plait.runtime.scaling
    `probe_costs`) into cores, `plan_layout` sizes the loaders and partitions from that demand;
  * by number (`loaders=N`): `assign_partitions` splits the heaviest sources by mixture weight until every
    loader has work.

Both deal (source, partition) pairs with the same LPT rule (`deal`) and give a `LoaderLayout`. `decide_layout`
picks between them (or keeps a layout decided before). At run time `PartitionMap` answers "which loader
owns block (source, epoch, file_pos)": a partition is a group of a source's files (`partition_of`: file
index mod partitions), and file_pos is a position in the source's seeded file order
(`plait.sources.base.file_order`), so the map needs no file contents. `loader_name` is the one formula for
a loader actor's name.

Only the layout depends on measurements (timings vary from run to run); the data stream never does:
which loader decodes a block is invisible in the batches.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from plait.errors import PlaitError
from plait.spec import Spec

UTILISATION = 0.5  # a loader is sized to be busy at most this fraction of a core (headroom for bursts)

# (spec) -> (seconds per token, number of files) per source; plait.runtime.scaling.probe_costs or a
# wrapper running it elsewhere.
Probe = Callable[[Spec], tuple[list[float], list[int]]]


@dataclass
class LoaderLayout:
    """The decision: partitions per source and the (source, partition) pairs each loader owns."""

    num_partitions: dict[int, int]
    owned: list[list[tuple[int, int]]]
    demand: list[float] = field(default_factory=list)  # cores, per source ([] when not measured)
    cost: list[float] = field(default_factory=list)  # seconds per token, per source ([] when not measured)

    @property
    def loaders(self) -> int:
        return len(self.owned)

    def owner(self) -> dict[tuple[int, int], int]:
        """(source, partition) -> loader index."""
        return {pair: k for k, pairs in enumerate(self.owned) for pair in pairs}

    def loader_demand(self, k: int) -> float:
        if not self.demand:
            return float("nan")
        return sum(self.demand[s] / self.num_partitions[s] for s, _ in self.owned[k])

    def to_dict(self) -> dict:
        return {"num_partitions": {int(s): int(n) for s, n in self.num_partitions.items()},
                "owned": [[(int(s), int(p)) for s, p in o] for o in self.owned],
                "demand": [float(d) for d in self.demand], "cost": [float(c) for c in self.cost]}

    @classmethod
    def from_dict(cls, d: dict) -> LoaderLayout:
        return cls({int(s): int(n) for s, n in d["num_partitions"].items()},
                   [[(int(s), int(p)) for s, p in o] for o in d["owned"]],
                   list(d.get("demand", [])), list(d.get("cost", [])))


# ----- deciding a layout ---------------------------------------------------------------------------
def decide_layout(spec: Spec, options: dict, probe: Probe) -> LoaderLayout:
    """The job's loader layout: a layout decided before (`options["layout"]`: a recreated Planner keeps
    it), the measured auto layout (`loaders="auto"`: `probe` each source's cost, then `plan_layout`), or an
    explicit number of loaders dealt by mixture weight (`assign_partitions`; no probe)."""
    if options.get("layout"):
        return LoaderLayout.from_dict(options["layout"])
    loaders, partitions = options["loaders"], options.get("partitions")
    if loaders != "auto":
        return LoaderLayout(*assign_partitions(spec, int(loaders), partitions))
    fixed = fixed_partitions(spec, partitions)
    cost, files = probe(spec)
    demand = demand_of(spec, cost, float(options.get("step_time") or 1.0), options.get("dp"))
    layout = plan_layout(demand, files, int(options.get("cpus") or 1), partitions=fixed)
    layout.cost = cost
    return layout


def plan_layout(demand: Sequence[float], files: Sequence[int], cpus: int, *,
                partitions: dict[int, int] | None = None, utilisation: float = UTILISATION) -> LoaderLayout:
    """Loaders and partitions from measured demand (cores per source).

    Loaders: enough to serve the total demand at `utilisation` of a core each, at least 1, at most the
    cluster's CPUs and at most one per partition (a partition is at least one file). Partitions: a source
    whose demand exceeds a loader's fair share (total / loaders) is split into about demand / share
    partitions (at most one per file and one per loader), so an expensive source is spread over several
    loaders; cheap sources keep one partition and share loaders. `partitions` fixes some sources' counts.
    Pairs are dealt to loaders heaviest first to the least loaded (LPT). Deterministic: equal inputs give
    equal layouts.
    """
    n = len(demand)
    if n == 0 or len(files) != n:
        raise ValueError("demand and files must have one entry per source (at least one)")
    d = np.asarray(demand, dtype=np.float64)
    if not np.isfinite(d).all() or not utilisation > 0:
        raise ValueError(f"demand must be finite and utilisation > 0 (demand {list(demand)}, utilisation {utilisation})")
    d = np.maximum(d, 1e-12)
    nfiles = [max(1, int(f)) for f in files]
    fixed = {int(s): max(1, int(p)) for s, p in (partitions or {}).items()}
    max_parts = sum(fixed.get(i, nfiles[i]) for i in range(n))
    total = float(d.sum())
    loaders = max(1, min(int(cpus), max_parts, math.ceil(total / utilisation - 1e-9)))
    share = total / loaders
    num = {i: fixed.get(i, max(1, min(nfiles[i], loaders, math.ceil(d[i] / share - 1e-9)))) for i in range(n)}
    # At most one loader per partition. Fewer partitions than loaders means the sources that need more
    # cannot be split further (one file each): more loaders would idle, and splitting a cheap source
    # would not lower the busiest loader.
    loaders = min(loaders, sum(num.values()))
    owned = deal(num, d, loaders)
    return LoaderLayout(num, [sorted(o) for o in owned], [float(x) for x in d])


def assign_partitions(spec: Spec, loaders: int, partitions: int | dict[str, int] | None
                      ) -> tuple[dict[int, int], list[list[tuple[int, int]]]]:
    """How many partitions each source gets, and which (source, partition) pairs each loader owns.

    Without `partitions`, a source has one partition, except that when there are more loaders than
    sources the heaviest sources (by mixture weight per partition) are split until every loader has
    work. Pairs are dealt to loaders in order, balancing the summed weight per loader.
    """
    weight = np.array([max(s.weight, 1e-9) for s in spec.sources], dtype=np.float64)
    fixed = fixed_partitions(spec, partitions)
    num = {i: fixed.get(i, 1) for i in range(len(spec.sources))}
    free = [i for i in num if i not in fixed]
    while free and sum(num.values()) < loaders:
        i = max(free, key=lambda j: weight[j] / num[j])
        num[i] += 1
    return num, deal(num, weight, loaders)


def fixed_partitions(spec: Spec, partitions: int | dict[str, int] | None) -> dict[int, int]:
    """The `partitions` option as {source index: partitions (>= 1)}: an int fixes every source."""
    if isinstance(partitions, int):
        return {i: max(1, partitions) for i in range(len(spec.sources))}
    unknown = sorted(set(partitions or {}) - set(spec.source_names))
    if unknown:
        raise PlaitError(f"partitions names unknown sources {unknown}")
    return {spec.source_names.index(name): max(1, int(n)) for name, n in (partitions or {}).items()}


def deal(num: dict[int, int], weight, loaders: int) -> list[list[tuple[int, int]]]:
    """(source, partition) pairs to loaders, heaviest piece (weight / partitions) first to the least
    loaded loader (LPT; ties by pair): a cheap source shares a loader, an expensive one is spread."""
    pairs = [(i, p) for i in sorted(num) for p in range(num[i])]
    load = np.zeros(loaders)
    owned: list[list[tuple[int, int]]] = [[] for _ in range(loaders)]
    for i, p in sorted(pairs, key=lambda ip: (-weight[ip[0]] / num[ip[0]], ip)):
        k = int(np.argmin(load))
        owned[k].append((i, p))
        load[k] += weight[i] / num[i]
    return owned


def demand_of(spec: Spec, cost: Sequence[float], step_time: float, dp: int | None = None) -> list[float]:
    """Cores each source needs: seconds per token x its share of a step's tokens / step time (step 0's
    mixture: the spec's weights or the schedule's first point)."""
    from plait.mixture import MixtureSchedule

    share = MixtureSchedule(spec).weights(0)
    tokens = (dp or spec.topology.dp) * spec.packing.num_microbatches * spec.packing.seq_len
    return [float(c) * float(w) * tokens / max(step_time, 1e-9) for c, w in zip(cost, share)]


# ----- using a layout ------------------------------------------------------------------------------
def unchanged_loaders(old: LoaderLayout, new: LoaderLayout) -> dict[int, int]:
    """{new loader index: old loader index} for the loaders of `new` that own exactly the partitions of a
    loader of `old`, their sources cut into as many partitions in both (the same blocks, the same buffer):
    a rescale hands those over instead of starting them again."""
    def key(layout: LoaderLayout, k: int) -> tuple:
        pairs = tuple(sorted((int(s), int(p)) for s, p in layout.owned[k]))
        return pairs, tuple(sorted({(s, int(layout.num_partitions[s])) for s, _ in pairs}))

    old_of = {key(old, j): j for j in range(old.loaders)}
    return {k: old_of[key(new, k)] for k in range(new.loaders) if key(new, k) in old_of}


def loader_name(job: str, k: int, generation: int = 0) -> str:
    """Loader k's actor name; a replacement (generation >= 1) gets a new name, the dead one's may linger."""
    return f"{job}/loader-{k}" + (f"~{generation}" if generation else "")


class PartitionMap:
    """Which loader owns which block: source -> partitions -> loader index.

    Small: per source its file count and partition count, plus a cache of recent file orders.
    """

    def __init__(self, seed: int, num_files: dict[int, int], num_partitions: dict[int, int],
                 owner: dict[tuple[int, int], int]):
        # Imported here: trainer processes import this module for `LoaderLayout` and never need the readers
        # (pyarrow) that plait.sources brings; only the Planner and Constructor processes map blocks.
        from plait.roles.source_loader import partition_of
        from plait.sources.base import file_order

        self.seed = seed
        self.num_files = dict(num_files)
        self.num_partitions = dict(num_partitions)
        self.owner = dict(owner)  # (source, partition) -> loader index
        self._partition_of = partition_of
        self._file_order = file_order
        self._orders: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def to_dict(self) -> dict:
        """What a Constructor needs to rebuild this map (`PartitionMap(**d)`)."""
        return {"seed": self.seed, "num_files": self.num_files, "num_partitions": self.num_partitions,
                "owner": self.owner}

    def loader_of(self, source: int, epoch: int, fpos: int) -> int:
        order = self._orders.get((source, epoch))
        if order is None:
            order = self._file_order(self.seed, source, epoch, self.num_files[source])
            self._orders[(source, epoch)] = order
            while len(self._orders) > 4 * max(1, len(self.num_files)):
                self._orders.popitem(last=False)
        part = self._partition_of(int(order[fpos]), self.num_partitions[source])
        return self.owner[(source, part)]
