"""Resume under a changed spec (`allow_spec_change`): carry a data state over to a new spec.

What may change, and what happens from the state's step on:
  - the mixture (weights, schedule, online policy, source windows): the new one applies;
  - an added source: it starts at its beginning;
  - a removed source: its cursor, deficit and carried chunks stay in the state (`parked`), so that it
    continues where it stopped if it comes back later;
  - a source that comes back: it continues from its parked cursor.
What may not: a source whose data or reading changed (files, fields, tokenizer, bos/eos, seed): its
cursor would not name the same samples. Each source's entry in the state holds a fingerprint of those
(Spec.source_fingerprint); a mismatch is refused with the source's name.
"""

from __future__ import annotations

import copy
import warnings
from typing import Callable

from plait.errors import PlaitError
from plait.spec import Spec


class SpecChangeWarning(UserWarning):
    """A data state saved under one spec was resumed under another (allow_spec_change)."""


def split_fingerprint(value: str) -> tuple[str, str | None]:
    """(data, mixture) parts of a state's fingerprint; mixture None for states written before it."""
    data, _, mix = value.partition(":")
    return data, mix or None


def carry_over(spec: Spec, state: dict, first_key: Callable[[int], tuple[int, int, int]]) -> tuple[dict, list[str]]:
    """`state` rewritten for `spec` and the changes found (one sentence each); a PlaitError where a
    source changed in a way that cannot continue exactly."""
    step = int(state.get("step", 0))
    old_sources: dict = state.get("sources") or {}
    parked: dict = copy.deepcopy(state.get("parked") or {})
    missing_fp = [n for n, s in old_sources.items() if isinstance(s, dict) and "fingerprint" not in s]
    if missing_fp:
        raise PlaitError(
            "this data state was written before plait recorded per-source fingerprints, so a changed spec "
            "cannot be checked against it; resume it with the spec it was saved with, save a new state, and "
            "change the spec then"
        )
    # Carried chunks name sources by their index in the saving spec: the state's source order.
    old_names = list(old_sources)
    carry_by_name: dict[str, list] = {}
    for row in state.get("carry") or []:
        if not 0 <= row[0] < len(old_names):
            raise PlaitError(f"a carried chunk of the data state names source {row[0]}, which it does not hold")
        carry_by_name.setdefault(old_names[row[0]], []).append(list(row))
    changes: list[str] = []
    sources: dict = {}
    returning: list = []  # carried chunks of sources that come back (parked with them)
    for i, s in enumerate(spec.sources):
        fp = spec.source_fingerprint(s.name)
        entry = old_sources.get(s.name)
        rows = []
        if entry is None and s.name in parked:
            entry = parked.pop(s.name)
            rows = entry.pop("carry", [])
            changes.append(f"source {s.name!r} comes back at step {step}: it continues where it stopped")
        if entry is None:
            sources[s.name] = {"cursor": [*map(int, first_key(i)), 0, 0], "deficit": 0.0, "drawn": 0, "fingerprint": fp}
            changes.append(f"source {s.name!r} added: it starts at its beginning at step {step}")
            continue
        if entry["fingerprint"] != fp:
            raise PlaitError(
                f"source {s.name!r} changed since the data state was saved (its files, fields, tokenizer, bos/eos "
                "or the seed): its cursor would not continue the same samples. Restore it, or give the changed "
                "source a new name to start it from its beginning"
            )
        sources[s.name] = entry
        returning.extend([i, *row[1:]] for row in rows)
    index = {s.name: i for i, s in enumerate(spec.sources)}
    carry = [[index[old_names[r[0]]], *r[1:]] for r in state.get("carry") or [] if old_names[r[0]] in index]
    carry += returning
    for name, entry in old_sources.items():
        if name not in sources:
            parked[name] = {**entry, "carry": carry_by_name.pop(name, [])}
            changes.append(f"source {name!r} removed at step {step}: its cursor stays in the state (as `parked`)")
    _, old_mix = split_fingerprint(state.get("fingerprint", ""))
    if old_mix != spec.mixture_fingerprint():
        changes.append(f"the mixture changed (weights, schedule, source windows or online policy): the new one "
                       f"applies from step {step}")
    out = {**state, "fingerprint": f"{spec.data_fingerprint()}:{spec.mixture_fingerprint()}", "sources": sources,
           "carry": carry}
    if parked:
        out["parked"] = parked
    else:
        out.pop("parked", None)
    if spec.mixture.online is None:
        out.pop("online", None)
    return out, changes


def warn_changes(changes: list[str]) -> None:
    if changes:
        warnings.warn("resuming under a changed spec: " + "; ".join(changes), SpecChangeWarning, stacklevel=4)
