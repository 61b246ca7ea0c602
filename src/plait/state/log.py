"""The data state's per-step diffs and the log that rebuilds a lost Planner from them.

The data state is the Planner's state (per-source cursor and deficit, carried chunks, step); it fully
defines the rest of the stream. `diff_state` / `apply_state_diff` give the change from one step to the
next, so a dead Planner is rebuilt from the last full state plus the small diffs that followed
(`PlannerLog`). Everything is JSON-serialisable; `nbytes` is the size that would cross the wire.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Callable


def nbytes(obj) -> int:
    """Size of an object serialised as compact JSON: what a checkpoint or a delta costs to ship."""
    return len(json.dumps(obj, separators=(",", ":")).encode())


@dataclass
class StateRef:
    """The data state at the start of `step`, fetched from the job only when asked for (`resolve()`).

    A thin client's steps carry no state: the state of 1,000 sources is ~176 kB, and sending it to every
    rank with every step would cost more than the step's tokens at scale. A trainer needs it only for a
    checkpoint, so `plait.Loader.state_dict()` resolves the reference of the step in progress (the job
    keeps the states of its plan window, which always holds the steps trainers are consuming)."""

    step: int
    fetch: Callable[[], dict] = field(repr=False)

    def resolve(self) -> dict:
        return self.fetch()


def resolved(state: "dict | StateRef") -> dict:
    """A data state, fetching a `StateRef`'s."""
    return state.resolve() if isinstance(state, StateRef) else state


def diff_state(old: dict, new: dict) -> dict:
    """What changed from one data state to the next: step, moved cursors and deficits, and the carry as
    (indices of the old carry rows kept, rows added). Never larger than the new state itself."""
    d: dict = {"step": new["step"], "sources": {n: s for n, s in new["sources"].items() if old["sources"].get(n) != s}}
    # Any other top-level field (counters, ...) travels whole when it changed: the diff stays exact
    # whatever the state grows.
    others = {k: v for k, v in new.items() if k not in ("step", "sources", "carry") and old.get(k) != v}
    if others:
        d["set"] = copy.deepcopy(others)
    position = {tuple(r): i for i, r in enumerate(old["carry"])}
    new_rows = [tuple(r) for r in new["carry"]]
    keep = [position[r] for r in new_rows if r in position]
    added = [list(r) for r in new_rows if r not in position]
    if keep == sorted(keep) and [tuple(old["carry"][i]) for i in keep] + [tuple(r) for r in added] == new_rows:
        d["carry_keep"], d["carry_add"] = keep, added
    else:  # reordered: ship the carry itself
        d["carry"] = copy.deepcopy(new["carry"])
    if nbytes(d) >= nbytes(new):
        return {"full": copy.deepcopy(new)}
    return d


def apply_state_diff(state: dict, d: dict) -> dict:
    if "full" in d:
        return copy.deepcopy(d["full"])
    out = copy.deepcopy(state)
    out["step"] = d["step"]
    out.update(copy.deepcopy(d.get("set", {})))
    for name, s in d["sources"].items():
        out["sources"][name] = copy.deepcopy(s)
    if "carry" in d:
        out["carry"] = copy.deepcopy(d["carry"])
    else:
        out["carry"] = [out["carry"][i] for i in d["carry_keep"]] + copy.deepcopy(d["carry_add"])
    return out


class PlannerLog:
    """The last full data state plus the diffs of the steps planned since; rebuilds a lost Planner.

    `record(state)` after every planned step costs one diff (tens of bytes plus changed carry rows);
    every `full_every` steps the diffs are folded into a new base so the log stays bounded.
    """

    def __init__(self, state: dict, full_every: int = 64):
        self.base = copy.deepcopy(state)
        self.diffs: list[dict] = []
        self._last = copy.deepcopy(state)
        self.full_every = full_every

    def record(self, state: dict) -> dict:
        d = diff_state(self._last, state)
        self._last = copy.deepcopy(state)
        self.diffs.append(d)
        if len(self.diffs) >= self.full_every:
            self.base, self.diffs = copy.deepcopy(state), []
        return d

    def latest(self) -> dict:
        s = self.base
        for d in self.diffs:
            s = apply_state_diff(s, d)
        return s

    @property
    def nbytes(self) -> int:
        return nbytes(self.base) + sum(nbytes(d) for d in self.diffs)
