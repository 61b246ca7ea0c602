"""Mixture: token-share weights over steps, and the exact per-step quota of each source.

Quotas use error diffusion: each source carries a deficit = (tokens it should have had so far) -
(tokens drawn from it so far). A step adds weight * budget to every deficit and takes chunks (a document
of at most seq_len tokens is one chunk; a longer one is cut into chunks of seq_len) from a source while
the next chunk *starts* before the deficit is used up. The cumulative share therefore never drifts: at
any step each source is within one chunk (seq_len tokens) of its exact target, however long its
documents. No random draws.

The weights of a step come from, in order:
  1. the spec's schedule (`mixture.schedule`, keyed by step or by tokens delivered, interpolated
     `step` (held), `linear` or `cosine`), or the sources' own weights;
  2. run-time overrides (`set_weights`, or an online policy's updates), each from its `at_step` on;
  3. each source's window (`start_step` <= step < `stop_step`): weight 0 outside.
Every piece is a pure function of the step, the tokens delivered before it and the recorded overrides,
so a data state that records the overrides reproduces the weights exactly.
"""

from __future__ import annotations

import math

import numpy as np

from plait.errors import PlaitError
from plait.spec import Spec


class MixtureSchedule:
    """The spec's weights by step (or by tokens delivered): schedule, interpolation, source windows."""

    def __init__(self, spec: Spec):
        self.names = spec.source_names
        self.interpolation = spec.mixture.interpolation
        self.by_tokens = spec.mixture.schedule_by == "tokens"
        if spec.mixture.schedule:
            key = "tokens" if self.by_tokens else "step"
            self.steps = np.array([getattr(p, key) for p in spec.mixture.schedule], dtype=np.int64)
            self.table = np.array(
                [[p.weights.get(n, 0.0) for n in self.names] for p in spec.mixture.schedule], dtype=np.float64
            )
        else:
            self.steps = np.array([0], dtype=np.int64)
            self.table = np.array([[s.weight for s in spec.sources]], dtype=np.float64)
        self.start = np.array([s.start_step or 0 for s in spec.sources], dtype=np.int64)
        self.stop = np.array([s.stop_step if s.stop_step is not None else -1 for s in spec.sources], dtype=np.int64)
        self.windowed = bool((self.start > 0).any() or (self.stop >= 0).any())

    def active(self, step: int) -> np.ndarray:
        """Which sources may be drawn at a step (their start_step <= step < stop_step)."""
        return (self.start <= step) & ((self.stop < 0) | (step < self.stop))

    def weights(self, step: int, tokens: int = 0) -> np.ndarray:
        """Normalised weights at a step; `tokens`: tokens delivered before it (schedule_by: tokens)."""
        x = tokens if self.by_tokens else step
        i = int(np.searchsorted(self.steps, x, side="right")) - 1
        w = self.table[i]
        if self.interpolation != "step" and i + 1 < len(self.steps):
            t = (x - self.steps[i]) / (self.steps[i + 1] - self.steps[i])
            if self.interpolation == "cosine":
                t = (1 - math.cos(math.pi * t)) / 2
            w = (1 - t) * w + t * self.table[i + 1]
        w = w / w.sum()
        if self.windowed:
            w = mask(w, self.active(step), f"step {step}")
        return w


def mask(w: np.ndarray, active: np.ndarray, where: str) -> np.ndarray:
    """Weights with inactive sources at 0, renormalised; a PlaitError when none is left."""
    if active.all():
        return w
    w = np.where(active, w, 0.0)
    if w.sum() <= 0:
        raise PlaitError(f"no source with a positive weight is active at {where} (start_step/stop_step)")
    return w / w.sum()


def apply_overrides(base: np.ndarray, names: list[str], overrides: list[dict], step: int) -> np.ndarray:
    """The weights at `step` after the run-time overrides whose at_step <= step, in order.

    An override names some sources: those get exactly the given share (after normalising the named
    ones if they sum past 1); the sources it does not name keep their current weights' proportions and
    share what is left. Later overrides act on the result of earlier ones; a source named once stays
    pinned until another override names it again. Names not in the spec are ignored (a removed source).
    """
    pinned: dict[int, float] = {}
    index = {n: i for i, n in enumerate(names)}
    for o in overrides:
        if o["at_step"] > step:
            break
        for n, v in o["weights"].items():
            if n in index:
                pinned[index[n]] = float(v)
    if not pinned:
        return base
    w = base.copy()
    fixed = np.zeros(len(w), dtype=bool)
    fixed[list(pinned)] = True
    given = np.zeros(len(w))
    given[list(pinned)] = list(pinned.values())
    total = given.sum()
    free = w[~fixed].sum()
    if total >= 1 or free <= 0:
        if total <= 0:
            raise PlaitError(f"the weight overrides in force at step {step} leave no source a positive weight")
        return given / total
    out = given.copy()
    out[~fixed] = w[~fixed] / free * (1 - total)
    return out


def exp_gradient(weights: np.ndarray, excess: np.ndarray, *, lr: float, floor: float) -> np.ndarray:
    """One exponentiated-gradient step of domain reweighting (DoReMi, online data mixing):

        w_i <- w_i * exp(lr * excess_i), normalised, then smoothed with the uniform distribution:
        w <- (1 - floor) * w + floor / n, so that no source's weight falls below floor / n.

    `excess` is NaN for sources without a reported loss: they keep their weight's proportion. The
    exponent is shifted by its maximum (same result, no overflow).
    """
    e = np.where(np.isfinite(excess), excess, 0.0) * lr
    logw = np.log(np.maximum(weights, 1e-300)) + e
    w = np.exp(logw - logw.max()) * (weights > 0)
    w = w / w.sum()
    n = int((weights > 0).sum()) or 1
    return np.where(weights > 0, (1 - floor) * w + floor / n, 0.0)


POLICIES = {"exp_gradient": exp_gradient}


def take_count(lengths: np.ndarray, deficit: float) -> int:
    """How many of the next documents (or chunks) to take: those that start before the deficit is used up.

    The Planner applies it to whole documents, then takes of the last one only its chunks that start
    before the deficit is used up."""
    if deficit <= 0 or len(lengths) == 0:
        return 0
    starts = np.cumsum(lengths) - lengths
    return int(np.searchsorted(starts, deficit, side="left"))


def share_windows(drawn: np.ndarray, weights: np.ndarray, window: int = 100) -> list[dict]:
    """Achieved token share per source over consecutive windows of steps, against the target.

    `drawn[t, i]`: tokens drawn from source i at step t; `weights[t, i]`: the weights step t was drawn
    with. A window's target is the weights averaged over its steps, each weighted by the tokens drawn
    then (what error diffusion tracks). Error: achieved - target."""
    out = []
    for a in range(0, len(drawn), window):
        d, w = drawn[a:a + window].astype(np.float64), weights[a:a + window]
        per_step = d.sum(axis=1)
        total = per_step.sum()
        if total <= 0:
            continue
        achieved = d.sum(axis=0) / total
        target = (w * per_step[:, None]).sum(axis=0) / total
        out.append({"start": a, "end": a + len(d), "achieved": achieved.tolist(), "target": target.tolist(),
                    "worst_error": float(np.abs(achieved - target).max())})
    return out
