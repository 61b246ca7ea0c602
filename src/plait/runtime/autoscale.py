"""Run-time auto-scaling: the controller that keeps each source's loaders in step with its demand.

Pure decision logic (no Ray, no clock of its own): the ray runtime measures one `Observation` per control
interval and calls `Controller.observe`; the controller answers with a `Decision` (a new `LoaderLayout`, or
"demand cannot be met") or None (hold the layout).

How demand is estimated, per source s:

  * seconds per token  c_s = busy_s / tokens of the interval, smoothed (EWMA); an interval in which s
    delivered no tokens keeps the previous estimate;
  * tokens per step    t_s = tokens / steps of the interval, smoothed;
  * demanded step rate r = steps / (elapsed - wait): the rate the trainer would run at if it never waited
    for data (waiting is the symptom, not the demand); steps and working seconds are smoothed apart and
    divided after, and the working seconds count at least MIN_WORKING of the interval: an interval whose
    ranks waited all along (the start, a stall) would otherwise divide by ~0 and demand millions of cores;
  * demand (cores)     d_s = c_s x t_s x r.

The target layout is `plait.runtime.placement.plan_layout(d, files, cap, utilisation=target_utilisation)`:
the same sizing and dealing rule as the start-time auto layout, so there is one rule. A loader's
projected busy fraction is the demand of the pairs it owns (d_s / partitions of s, summed). The
controller scales up when a loader would be busier than `scale_up_at` (or ranks waited while the loaders
of a source were measured saturated), scales down only after `patience` intervals in a row in which every
loader would be less busy than `scale_down_at`, and never changes the layout within `cooldown_s` of its
last change. Between the two thresholds the layout holds (hysteresis); since every proposal is the plan
for the current demand, a steady demand has one target and nothing to oscillate between.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields

from plait.errors import PlaitError
from plait.runtime.placement import LoaderLayout, plan_layout, unchanged_loaders

WAITED = 0.02  # ranks "waited" in an interval when they waited more than this fraction of it
EPS_S = 1e-6
# The least share of an interval counted as the trainers' working time: the demanded step rate is at most
# 1 / MIN_WORKING times the measured one (a job that waits more than that is data-bound: every loader the
# budget allows is wanted anyway)
MIN_WORKING = 0.05
UP_SEARCH = 8  # a scale-up looks at most this many loaders beyond the plan for a layout that settles


@dataclass(frozen=True)
class AutoscaleOptions:
    """The controller's knobs (`RayOptions(autoscale=...)`: True, a dict of these fields, or an instance)."""

    interval_s: float = 2.0  # control interval: one Observation per interval
    cooldown_s: float = 6.0  # no layout change within this long after the last one
    scale_up_at: float = 0.85  # a loader projected busier than this at the measured demand is short
    scale_down_at: float = 0.40  # every loader below this for `patience` intervals in a row -> shrink
    patience: int = 3
    target_utilisation: float = 0.6  # loaders are sized to be this busy at the measured demand
    max_loader_cpus: float | None = None  # budget (loaders, 1 CPU each); None: the cluster's CPUs
    min_loaders: int = 1
    smoothing: float = 0.5  # EWMA weight of the newest interval in the estimates (1: no smoothing)
    # A change restarts the loaders whose partitions change (the others are handed over running). It is
    # taken only when the busiest loader's projected busy fraction falls by at least restart_gain x the
    # share of the new layout's loaders that restart: re-dealing every loader for a few percent (a noisy
    # estimate, a budget-bound re-split) costs more in restarts and refilled buffers than it gains.
    restart_gain: float = 0.3

    def __post_init__(self):
        def bad(name: str, reason: str):
            raise PlaitError(f"autoscale.{name}: {reason} (got {getattr(self, name)!r})")

        for name in ("interval_s", "cooldown_s", "scale_up_at", "scale_down_at", "target_utilisation",
                     "smoothing", "restart_gain"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(name, "must be a finite number")
        for name in ("patience", "min_loaders"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                bad(name, "must be an integer >= 1")
        if self.interval_s <= 0:
            bad("interval_s", "must be > 0")
        if self.cooldown_s < 0:
            bad("cooldown_s", "must be >= 0")
        if not 0 < self.scale_up_at <= 1:
            bad("scale_up_at", "must be in (0, 1]")
        if not 0 <= self.scale_down_at < self.scale_up_at:
            bad("scale_down_at", f"must be >= 0 and below scale_up_at ({self.scale_up_at})")
        if not self.scale_down_at < self.target_utilisation < self.scale_up_at:
            bad("target_utilisation", f"must lie strictly between scale_down_at ({self.scale_down_at}) and "
                                      f"scale_up_at ({self.scale_up_at}), or every change would undo itself")
        if not 0 < self.smoothing <= 1:
            bad("smoothing", "must be in (0, 1]")
        if self.restart_gain < 0:
            bad("restart_gain", "must be >= 0")
        cap = self.max_loader_cpus
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap >= 1:
                bad("max_loader_cpus", "must be a number >= 1 or None")
            if self.min_loaders > cap:
                bad("min_loaders", f"must be <= max_loader_cpus ({cap})")

    @classmethod
    def from_option(cls, value) -> AutoscaleOptions | None:
        """None / False: off (None). True: the defaults. A dict: these fields. An instance: itself."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(str(k) for k in value if k not in known)
            if unknown:
                raise PlaitError(f"autoscale: unknown option(s) {unknown}; known: {sorted(known)}")
            return cls(**value)
        raise PlaitError(f"autoscale: expected true/false, a dict of options or AutoscaleOptions, "
                         f"got {type(value).__name__} {value!r}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Observation:
    """What the runtime measured over one control interval."""

    elapsed_s: float  # wall seconds the observation covers
    steps: int  # global steps consumed (requested by trainers) in the interval
    wait_s: float  # seconds trainers waited for data in the interval (mean over ranks)
    source_tokens: list[float]  # tokens of each source delivered in the interval
    source_busy_s: list[float]  # loader busy seconds spent on each source (sum over loaders)
    loader_busy: list[float]  # busy fraction of each current loader over the interval
    free_cpus: float | None = None  # CPUs the cluster could still give loaders (None: unknown)


@dataclass
class Decision:
    kind: str  # "up" | "down" | "unmet" (demand cannot be met within the budget: no layout change)
    layout: LoaderLayout | None  # the new layout; None for "unmet"
    reason: str  # one readable line
    demand_cores: list[float] = field(default_factory=list)  # per source, the estimate the decision used


def same_layout(a: LoaderLayout, b: LoaderLayout) -> bool:
    """Equal partitions per source and equal groups of pairs per loader (the loaders' order aside)."""
    return (dict(a.num_partitions) == dict(b.num_partitions)
            and sorted(sorted(o) for o in a.owned) == sorted(sorted(o) for o in b.owned))


def projected_busy(layout: LoaderLayout, demand: Sequence[float]) -> list[float]:
    """Each loader's busy fraction if every source ran at `demand` cores, spread evenly over its partitions."""
    return [sum(demand[s] / layout.num_partitions[s] for s, _ in owned) for owned in layout.owned]


class Controller:
    """Decides, once per control interval, whether the loader layout should change (see the module doc)."""

    def __init__(self, options: AutoscaleOptions, num_files: list[int], cpus: float,
                 names: Sequence[str] | None = None):
        if not num_files:
            raise ValueError("num_files needs one entry per source")
        self.options = options
        self.num_files = [max(1, int(f)) for f in num_files]
        self.cpus = max(1.0, float(cpus))
        self.names = list(names) if names is not None else [f"source {i}" for i in range(len(num_files))]
        n = len(self.num_files)
        self.cost: list[float | None] = [None] * n  # seconds per token
        self.tokens_per_step: list[float | None] = [None] * n
        self.step_rate: float | None = None  # demanded steps per second (smoothed steps / smoothed working s)
        self.steps_seen: float | None = None  # smoothed steps per interval
        self.working_s: float | None = None  # smoothed seconds per interval the trainers did not wait
        self.last_change: float | None = None
        self.last_unmet: float | None = None
        self.low_streak = 0

    # ----- estimates --------------------------------------------------------------------------------
    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else self.options.smoothing * new + (1 - self.options.smoothing) * old

    def _update(self, obs: Observation) -> bool:
        """Fold one observation into the estimates; False when it says nothing about demand (no steps)."""
        n = len(self.num_files)
        if len(obs.source_tokens) != n or len(obs.source_busy_s) != n:
            raise ValueError(f"observation has {len(obs.source_tokens)} token / {len(obs.source_busy_s)} busy "
                             f"entries for {n} sources")
        for s in range(n):
            if obs.source_tokens[s] > 0 and obs.source_busy_s[s] > 0:
                self.cost[s] = self._smooth(self.cost[s], obs.source_busy_s[s] / obs.source_tokens[s])
        if obs.steps <= 0 or obs.elapsed_s <= 0:
            return False
        for s in range(n):
            self.tokens_per_step[s] = self._smooth(self.tokens_per_step[s], obs.source_tokens[s] / obs.steps)
        working = max(obs.elapsed_s - max(0.0, obs.wait_s), MIN_WORKING * obs.elapsed_s, EPS_S)
        self.steps_seen = self._smooth(self.steps_seen, float(obs.steps))
        self.working_s = self._smooth(self.working_s, working)
        self.step_rate = self.steps_seen / self.working_s
        return True

    def demand(self) -> list[float]:
        """Cores per source at the demanded step rate (0 for a source with no measured cost or no tokens)."""
        rate = self.step_rate or 0.0
        return [(c or 0.0) * (t or 0.0) * rate for c, t in zip(self.cost, self.tokens_per_step)]

    # ----- deciding ---------------------------------------------------------------------------------
    def budget(self, layout: LoaderLayout, free_cpus: float | None) -> int:
        """The most loaders the layout may have: the budget (or the cluster), the free CPUs plus the
        loaders already running, never below min_loaders."""
        cap = self.options.max_loader_cpus if self.options.max_loader_cpus is not None else self.cpus
        if free_cpus is not None:
            cap = min(cap, max(0.0, float(free_cpus)) + layout.loaders)
        return max(self.options.min_loaders, math.floor(cap + 1e-9))

    def target(self, demand: Sequence[float], cap: int, loaders: int | None = None,
               partitions: dict[int, int] | None = None) -> LoaderLayout:
        """plan_layout at target_utilisation within `cap` loaders (at least min_loaders where files allow);
        `loaders`: size for that many loaders instead; `partitions`: fix some sources' partitions."""
        util = self.options.target_utilisation
        total = sum(max(d, 1e-12) for d in demand)
        want = loaders if loaders is not None else self.options.min_loaders if total / util < self.options.min_loaders else None
        if want is not None:
            util = total / want  # plan_layout sizes loaders as ceil(total / utilisation)
        layout = plan_layout(demand, self.num_files, cap, utilisation=util, partitions=partitions)
        layout.cost = [c or 0.0 for c in self.cost]
        return layout

    def _up_target(self, demand: list[float], cap: int, layout: LoaderLayout, busy: list[float]) -> LoaderLayout | None:
        """The plan at target_utilisation, or, where its dealing leaves a loader busier than halfway to
        scale_up_at, the plan for the fewest more loaders (at most UP_SEARCH more, within the budget) that
        does not: the next noisy interval must not find it short again. With n loaders plan_layout splits
        the heaviest source n ways and a cheap source then shares its busiest loader; the same plan with
        the heaviest source held to n - 1 partitions gives the cheap ones a loader of their own, and is
        tried too. Else the least busy of those plans. Only a layout whose busiest loader is less busy
        than the current one's at this demand (never a flip back to a worse plan); None when none is."""
        first = self.target(demand, cap)
        heaviest = max(range(len(demand)), key=lambda s: demand[s])
        plans = [first]
        for n in range(first.loaders, min(cap, first.loaders + UP_SEARCH) + 1):
            if n > first.loaders:
                plans.append(self.target(demand, cap, loaders=n))
            if len(demand) > 1 and 2 <= n <= self.num_files[heaviest] + 1:
                plans.append(self.target(demand, cap, loaders=n, partitions={heaviest: n - 1}))
        peak = [max(projected_busy(p, demand)) for p in plans]
        better = [i for i, p in enumerate(plans) if not same_layout(p, layout) and peak[i] < max(busy) - 1e-9]
        if not better:
            return None
        settled = [i for i in better if peak[i] <= self._settled()]
        return plans[settled[0] if settled else min(better, key=lambda i: (peak[i], i))]

    def observe(self, obs: Observation, layout: LoaderLayout, now: float) -> Decision | None:
        """One control interval: update the estimates, then hold (None), rescale or report unmet demand.

        The first observation only starts the clock: it holds the job's start-up (buffers and the
        Constructors' prefetch filling ahead of the trainer, loader processes warming up), so it is
        left out of the estimates, and the start counts as a change (no decision within cooldown_s)."""
        if self.last_change is None:
            self.last_change = now
            return None
        if not self._update(obs):
            return None
        opts = self.options
        demand = self.demand()
        busy = projected_busy(layout, demand)
        short = self._short_sources(obs, layout, busy)
        low = bool(busy) and max(busy) < opts.scale_down_at
        if self.last_change is not None and now - self.last_change < opts.cooldown_s:
            self.low_streak = 0  # the interval straddles a change: its measurements are mixed
            return None
        self.low_streak = self.low_streak + 1 if low and not short else 0
        cap = self.budget(layout, obs.free_cpus)
        if short:
            target = self._up_target(demand, cap, layout, busy)
            if target is not None and not self.pays_for_restarts(layout, target, demand):
                target = None  # its gain does not pay for the loaders it would restart: as if none were better
            if target is None:  # nothing better within the budget
                still_short = self._short_in(layout, demand)
                bound = layout.loaders >= cap or any(layout.num_partitions[s] >= self.num_files[s] for s in still_short)
                return self._unmet(still_short, layout, demand, cap, now) if bound else None
            projected = max(busy) > opts.scale_up_at
            if not projected and not any(target.num_partitions[s] > layout.num_partitions[s] for s in short):
                return None  # measured saturation the estimate does not confirm, and no split would help
            still_short = self._short_in(target, demand)
            reason = self._up_reason(short, layout, target, demand, busy)
            if still_short:
                self.last_unmet = now
                reason += "; still unmet: " + self._unmet_detail(still_short, target, demand, cap)
            return self._change("up", target, demand, now, reason)
        if self.low_streak >= opts.patience:
            target = self.target(demand, cap)
            # a merge whose result would sit near scale_up_at would be undone by the next noisy interval
            if same_layout(target, layout) or max(projected_busy(target, demand)) > self._settled():
                return None
            reason = (f"every loader below {opts.scale_down_at:.0%} busy for {self.low_streak} intervals "
                      f"(max {max(busy):.0%}): {self._layout_text(layout)} -> {self._layout_text(target)} "
                      f"for demand {self._demand_text(demand)}")
            return self._change("down", target, demand, now, reason)
        return None

    def pays_for_restarts(self, layout: LoaderLayout, target: LoaderLayout, demand: Sequence[float]) -> bool:
        """Whether `target` gains enough over `layout` for the loaders it restarts (restart_gain): the
        relative fall of the busiest loader's projected busy fraction against restart_gain x the share of
        target's loaders that are not handed over running (plait.runtime.placement.unchanged_loaders)."""
        restarts = target.loaders - len(unchanged_loaders(layout, target))
        if restarts <= 0:
            return True
        before, after = max(projected_busy(layout, demand)), max(projected_busy(target, demand))
        gain = before / max(after, EPS_S) - 1.0
        return gain >= self.options.restart_gain * restarts / target.loaders

    def _settled(self) -> float:
        """The busiest a loader may be projected after a merge: halfway from target_utilisation to scale_up_at."""
        return (self.options.target_utilisation + self.options.scale_up_at) / 2

    def _short_sources(self, obs: Observation, layout: LoaderLayout, busy: list[float]) -> list[int]:
        """The sources that overload a loader: projected busier than scale_up_at, or measured saturated
        while ranks waited."""
        waited = obs.elapsed_s > 0 and obs.wait_s / obs.elapsed_s > WAITED
        limit = self.options.scale_up_at
        over = [k for k in range(layout.loaders)
                if busy[k] > limit or (waited and k < len(obs.loader_busy) and obs.loader_busy[k] > limit)]
        return self._heaviest_on(layout, self.demand(), over)

    def _short_in(self, layout: LoaderLayout, demand: Sequence[float]) -> list[int]:
        busy = projected_busy(layout, demand)
        return self._heaviest_on(layout, demand, [k for k in range(layout.loaders) if busy[k] > self.options.scale_up_at])

    @staticmethod
    def _heaviest_on(layout: LoaderLayout, demand: Sequence[float], loaders: list[int]) -> list[int]:
        """Per loader, the source whose partitions load it the most: a cheap source that merely shares
        an overloaded loader is not the one short."""
        return sorted({max((s for s, _ in layout.owned[k]), key=lambda s: demand[s] / layout.num_partitions[s])
                       for k in loaders if layout.owned[k]})

    def _change(self, kind: str, layout: LoaderLayout, demand: list[float], now: float, reason: str) -> Decision:
        self.last_change = now
        self.low_streak = 0
        return Decision(kind, layout, reason, list(demand))

    def _unmet(self, short: list[int], target: LoaderLayout, demand: list[float], cap: int, now: float
               ) -> Decision | None:
        """The best layout within the budget is the current one and still too slow: say so, once per
        cooldown. (Short only by a measured saturation the estimate does not confirm: hold quietly.)"""
        if not short:
            return None
        if self.last_unmet is not None and now - self.last_unmet < self.options.cooldown_s:
            return None
        self.last_unmet = now
        return Decision("unmet", None, "demand cannot be met: " + self._unmet_detail(short, target, demand, cap),
                        list(demand))

    def _unmet_detail(self, short: list[int], target: LoaderLayout, demand: list[float], cap: int) -> str:
        why = []
        for s in short:
            bound = ("one partition per file" if target.num_partitions[s] >= self.num_files[s]
                     else f"budget {cap} loader CPUs" if target.loaders >= cap else "uneven split")
            why.append(f"{self.names[s]} needs {demand[s]:.2f} cores, has {target.num_partitions[s]} "
                       f"partition(s) of {self.num_files[s]} file(s) ({bound})")
        return f"{'; '.join(why)}; total demand {sum(demand):.2f} cores, budget {cap} loader CPUs"

    def _up_reason(self, short: list[int], layout: LoaderLayout, target: LoaderLayout, demand: list[float],
                   busy: list[float]) -> str:
        names = ", ".join(self.names[s] for s in short)
        return (f"{names} short (loaders projected up to {max(busy):.0%} busy, limit {self.options.scale_up_at:.0%}): "
                f"{self._layout_text(layout)} -> {self._layout_text(target)} for demand {self._demand_text(demand)}")

    def _layout_text(self, layout: LoaderLayout) -> str:
        parts = ", ".join(f"{self.names[s]}×{n}" for s, n in sorted(layout.num_partitions.items()))
        return f"{layout.loaders} loader(s) [{parts}]"

    def _demand_text(self, demand: Sequence[float]) -> str:
        return ", ".join(f"{self.names[s]} {d:.2f}" for s, d in enumerate(demand)) + " cores"
