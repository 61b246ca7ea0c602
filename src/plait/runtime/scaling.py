"""Auto-partitioning and scaling: how many SourceLoaders, and which partitions of which sources each owns.

Two parts, kept apart:

  * `probe_costs` measures each source's preprocessing cost, in seconds per token (read + decode +
    tokenize), by reading its first blocks through the same `plait.sources.Source` a loader uses.
  * `plan_layout` is a pure function: (demand per source, files per source, CPUs) -> (partitions per
    source, (source, partition) pairs per loader). A source's demand is the share of one core it needs
    to keep up with training: cost per token x its mixture share x tokens per step / step time.

Only the *layout* depends on the measurement (timings vary from run to run); the data stream never
does: which loader decodes a block is invisible in the batches (PartitionMap / file_order).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from collections.abc import Sequence

import numpy as np

from plait.spec import Spec

UTILISATION = 0.5  # a loader is sized to be busy at most this fraction of a core (headroom for bursts)


@dataclass
class Layout:
    """The decision: partitions per source and the (source, partition) pairs each loader owns."""

    num_partitions: dict[int, int]
    owned: list[list[tuple[int, int]]]
    demand: list[float] = field(default_factory=list)  # cores, per source ([] when not measured)
    cost: list[float] = field(default_factory=list)  # seconds per token, per source ([] when not measured)

    @property
    def loaders(self) -> int:
        return len(self.owned)

    def loader_demand(self, k: int) -> float:
        if not self.demand:
            return float("nan")
        return sum(self.demand[s] / self.num_partitions[s] for s, _ in self.owned[k])

    def to_dict(self) -> dict:
        return {"num_partitions": {int(s): int(n) for s, n in self.num_partitions.items()},
                "owned": [[(int(s), int(p)) for s, p in o] for o in self.owned],
                "demand": [float(d) for d in self.demand], "cost": [float(c) for c in self.cost]}

    @classmethod
    def from_dict(cls, d: dict) -> Layout:
        return cls({int(s): int(n) for s, n in d["num_partitions"].items()},
                   [[(int(s), int(p)) for s, p in o] for o in d["owned"]],
                   list(d.get("demand", [])), list(d.get("cost", [])))


def plan_layout(demand: Sequence[float], files: Sequence[int], cpus: int, *,
                partitions: dict[int, int] | None = None, utilisation: float = UTILISATION) -> Layout:
    """Loaders and partitions from measured demand (cores per source).

    Loaders: enough to serve the total demand at `utilisation` of a core each, at least 1, at most the
    cluster's CPUs and at most one per partition (a partition is at least one file). Partitions: a source whose demand exceeds a loader's
    fair share (total / loaders) is split into about demand / share partitions (at most one per file and
    one per loader), so an expensive source is spread over several loaders; cheap sources keep one
    partition and share loaders. `partitions` fixes some sources' counts. Pairs are dealt to loaders
    heaviest first to the least loaded (LPT). Deterministic: equal inputs give equal layouts.
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
    return Layout(num, [sorted(o) for o in owned], [float(x) for x in d])


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


def probe_costs(spec: Spec, sources: Sequence[int] | None = None, *, min_tokens: int = 16384,
                max_blocks: int = 4, budget_s: float = 2.0) -> tuple[list[float], list[int]]:
    """(seconds per token, number of files) per source, from reading its first blocks.

    Each source reads at least two blocks (the first one warms the reader and tokenizer up and is not
    timed unless it is the only one), then more until `min_tokens` tokens were timed, `max_blocks`
    blocks were read or its slice of `budget_s` is spent. A source that reads zero tokens costs its
    time per record instead (never zero). The probe reads through its own Source objects: the loaders'
    error counts and caches are untouched.
    """
    from plait.sources import Source

    idx = list(range(len(spec.sources))) if sources is None else list(sources)
    per_source = budget_s / max(1, len(idx))
    costs, files = [], []
    for i in idx:
        src = Source(spec.sources[i], i, spec.seed)
        try:
            files.append(len(src.files))
            key = src.first_key()
            timed_s, timed_tok, blocks = 0.0, 0, 0
            first_s, first_tok = 0.0, 0
            start = time.perf_counter()
            while blocks < max_blocks:
                t0 = time.perf_counter()
                block = src.read_block(key)
                dt = time.perf_counter() - t0
                tok = int(block.lengths.sum()) or max(1, int(block.num_positions))
                if blocks == 0:
                    first_s, first_tok = dt, tok
                else:
                    timed_s, timed_tok = timed_s + dt, timed_tok + tok
                blocks += 1
                spent = time.perf_counter() - start
                if blocks >= 2 and (timed_tok >= min_tokens or spent >= per_source):
                    break
                if blocks == 1 and spent >= per_source:
                    break
                key = src.next_key(key)
            costs.append(timed_s / timed_tok if timed_tok else first_s / max(1, first_tok))
        finally:
            src.close()
    # The probe's blocks are garbage now; hand their memory back (Arrow's allocator keeps freed pages
    # otherwise, and the Planner process that probes lives as long as the job).
    import gc

    import pyarrow as pa

    gc.collect()
    pa.default_memory_pool().release_unused()
    return costs, files


def describe(layout: Layout, names: Sequence[str], limit: int = 6) -> list[dict]:
    """One row per loader: its sources (`name[partitions/of]` when split, then the measured µs per 1k
    tokens when measured), the range of those costs, and the loader's demand in cores."""
    rows = []
    for k, owned in enumerate(layout.owned):
        parts: dict[int, list[int]] = {}
        for s, p in owned:
            parts.setdefault(s, []).append(p)
        items = []
        for s, ps in parts.items():
            n = layout.num_partitions[s]
            item = names[s] if n == 1 else f"{names[s]}[{','.join(map(str, ps))}/{n}]"
            items.append(f"{item} ({layout.cost[s] * 1e9:.0f})" if layout.cost else item)
        text = ", ".join(items[:limit]) + (f", … (+{len(items) - limit})" if len(items) > limit else "")
        cost = [layout.cost[s] * 1e9 for s in parts] if layout.cost else []
        us = (f"{min(cost):.1f}" if len(cost) == 1 or min(cost) == max(cost) else f"{min(cost):.1f}–{max(cost):.1f}"
              ) if cost else "-"
        rows.append({"loader": k, "sources": text, "pairs": len(owned), "us_per_1k_tokens": us,
                     "demand": layout.loader_demand(k)})
    return rows


def format_layout(layout: Layout, names: Sequence[str]) -> list[str]:
    """The decision as log lines, one per loader."""
    out = []
    for r in describe(layout, names):
        dem = "" if math.isnan(r["demand"]) else f" (µs per 1k tokens); demand {r['demand']:.3f} cores"
        out.append(f"loader-{r['loader']}: {r['sources']}{dem}")
    return out
