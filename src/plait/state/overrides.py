"""The Planner's mixture weights while a job runs: the spec's schedule, run-time overrides, online policy.

Everything that changes the weights after the spec was written is recorded in the data state, so a
resume reproduces it exactly:
  - `overrides`: [{at_step, weights, by}] from `set_weights` (by "user") and from the online policy
    (by "online"), in force from their at_step on (mixture.apply_overrides says how they combine);
  - `online.reports`: losses reported for steps whose window has not been folded into an update yet.

Timing never matters: a change for a step already planned is refused, and the online update of the
window [wK, (w+1)K) is computed when step (w+1)K - 1 + delay is planned, from the reports of the window
(a report arriving after that step was planned is refused).
"""

from __future__ import annotations

import copy
import math

import numpy as np

from plait.errors import PlaitError
from plait.mixture import POLICIES, MixtureSchedule, apply_overrides, mask
from plait.spec import Spec


def update_step(online, window: int) -> int:
    """The step at which the online update of window `window` (steps [wK, (w+1)K)) takes effect: the one
    definition of the online policy's timing (`online`: the spec's mixture.online)."""
    return (window + 1) * online.every - 1 + online.delay


def report_effect_step(online, step: int) -> int:
    """The step at which a loss reported for `step` takes effect (its window's update)."""
    return update_step(online, step // online.every)


class RunWeights:
    def __init__(self, spec: Spec):
        self.names = spec.source_names
        self.schedule = MixtureSchedule(spec)
        self.online = spec.mixture.online
        self.overrides: list[dict] = []
        self.reports: dict[int, dict[str, float]] = {}

    # ----- the weights of a step ---------------------------------------------------------------
    def at(self, step: int, tokens: int) -> np.ndarray:
        """The normalised weights of `step` (`tokens`: delivered before it); folds the online update due
        at this step first."""
        if self.online is not None:
            self._online_update(step, tokens)
        return self._current(step, tokens)

    def _current(self, step: int, tokens: int) -> np.ndarray:
        w = self.schedule.weights(step, tokens)
        if not self.overrides:
            return w
        w = apply_overrides(w, self.names, self.overrides, step)
        return mask(w, self.schedule.active(step), f"step {step}") if self.schedule.windowed else w

    def _online_update(self, step: int, tokens: int) -> None:
        o = self.online
        end = step - o.delay + 1  # one past the window's last step
        if end < o.every or end % o.every or any(x["at_step"] == step and x["by"] == "online" for x in self.overrides):
            return
        window = range(end - o.every, end)
        reported = [self.reports.pop(s) for s in window if s in self.reports]
        if not reported:
            return
        excess = np.full(len(self.names), np.nan)
        for i, n in enumerate(self.names):
            values = [r[n] for r in reported if n in r]
            if values:
                excess[i] = sum(values) / len(values) - o.reference.get(n, 0.0)
        new = POLICIES[o.policy](self._current(step, tokens), excess, lr=o.lr, floor=o.floor)
        self.overrides.append({"at_step": step, "weights": dict(zip(self.names, map(float, new))), "by": "online"})
        self.overrides.sort(key=lambda x: x["at_step"])

    # ----- run-time changes --------------------------------------------------------------------
    def set(self, weights: dict[str, float], at_step: int, planned: int) -> None:
        """Pin the named sources' shares from `at_step` on; `planned`: the next step to be planned."""
        self._check_names(weights, "set_weights")
        bad = {n: v for n, v in weights.items() if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0)}
        if bad:
            raise PlaitError(f"set_weights: weights must be finite numbers >= 0 (got {bad})")
        if not weights:
            raise PlaitError("set_weights: name at least one source")
        entry = {"at_step": int(at_step), "weights": {n: float(v) for n, v in weights.items()}, "by": "user"}
        if entry in self.overrides:  # the same call again (every rank of a node-shared job makes it): one entry
            return
        if at_step < planned:
            raise PlaitError(
                f"set_weights(at_step={at_step}): step {at_step} is already planned (the loader has planned up to "
                f"step {planned - 1}); choose at_step >= {planned}, e.g. the current step + prefetch + 2"
            )
        if len(weights) == len(self.names) and sum(weights.values()) <= 0:
            raise PlaitError("set_weights: at least one weight must be positive")
        self.overrides.append(entry)
        self.overrides.sort(key=lambda x: x["at_step"])  # stable: same-step entries keep their order

    def report(self, step: int, losses: dict[str, float], planned: int) -> None:
        """Record per-source losses of a trained step for the online policy."""
        if self.online is None:
            raise PlaitError("report(): the spec has no online mixing (set mixture.online)")
        self._check_names(losses, "report")
        bad = {n: v for n, v in losses.items() if not (isinstance(v, (int, float)) and math.isfinite(v))}
        if bad:
            raise PlaitError(f"report(step={step}): losses must be finite numbers (got {bad})")
        effect = report_effect_step(self.online, step)
        if step < 0 or effect < planned:
            raise PlaitError(
                f"report(step={step}) came too late: its window's update takes effect at step {effect}, which is "
                f"already planned (the loader has planned up to step {planned - 1}); raise mixture.online.delay "
                "above the prefetch depth, or report sooner"
            )
        self.reports.setdefault(int(step), {}).update({n: float(v) for n, v in losses.items()})

    def _check_names(self, d: dict, what: str) -> None:
        if not isinstance(d, dict):
            raise PlaitError(f"{what}: expected a {{source: value}} mapping, got {type(d).__name__}")
        unknown = sorted(set(d) - set(self.names))
        if unknown:
            raise PlaitError(f"{what}: unknown source(s) {unknown} (sources: {self.names})")

    # ----- state -------------------------------------------------------------------------------
    def state_items(self) -> dict:
        """The data state's entries for the weights: absent when nothing changed them (states of jobs
        without run-time mixing keep their shape)."""
        out: dict = {}
        if self.overrides:
            out["overrides"] = copy.deepcopy(self.overrides)
        if self.online is not None:
            out["online"] = {"reports": {str(s): dict(r) for s, r in sorted(self.reports.items())}}
        return out

    def load(self, state: dict) -> None:
        self.overrides = sorted(copy.deepcopy(state.get("overrides") or []), key=lambda x: x["at_step"])
        reports = (state.get("online") or {}).get("reports") or {}
        self.reports = {int(s): dict(r) for s, r in reports.items()} if self.online is not None else {}


def merge_pending(state: dict, overrides: list[dict], reports: dict[int, dict], spec: Spec) -> dict:
    """A data state snapshot (taken when its step was planned) plus the run-time changes made after it:
    user overrides and reports it does not hold yet. What the snapshot already folded is left out, so
    the result is what a Planner would hold had the changes come before the snapshot."""
    step = int(state["step"])
    out = dict(state)
    have = state.get("overrides") or []
    extra = [o for o in overrides if o["at_step"] >= step and o not in have]
    if extra:
        out["overrides"] = sorted([*copy.deepcopy(have), *copy.deepcopy(extra)], key=lambda x: x["at_step"])
    online = spec.mixture.online
    if online is not None and reports:
        held = dict((state.get("online") or {}).get("reports") or {})
        for s, r in reports.items():
            if report_effect_step(online, s) >= step:
                held[str(s)] = {**held.get(str(s), {}), **r}
        out["online"] = {"reports": dict(sorted(held.items(), key=lambda kv: int(kv[0])))}
    return out
