"""Schemas of the states a user hands back: the data state (the Planner's) and the Client's state.

A state comes from a file a user names, so it is validated before anything reads it: its shape (a
schema), then its ranges against the spec (every source present, cursors non-negative, deficits in the
range a Planner leaves them, carried chunks that name a source of the spec), then, for a Loader state,
its checksum: `state_dict()` seals the state (`seal`) with a SHA-256 of its canonical JSON, so an edit
that keeps every range (a step number moved, a cursor moved back) is still refused. What is wrong is
said in one sentence, as a PlaitError; the Planner checks the rest (a cursor beyond a source's files or
blocks) when it loads the state. docs/states-and-errors.md lists every check.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from plait.errors import PlaitError
from plait.plan import ALL_COLUMNS, ITEM_IMAGE_COLUMNS, ITEM_INT_COLUMNS
from plait.state.log import apply_state_diff
from plait.spec import Spec

STATE_VERSION = 1
CLIENT_STATE_VERSION = 2  # 2: sealed with a checksum (version 1 states, written before it, are range-checked only)
# A Planner leaves every deficit at or below 0 after a step (it draws until the deficit is used up); the
# float sums that build it stay far inside this tolerance.
DEFICIT_TOLERANCE = 1e-6


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, defer_build=True)  # built at the first validation


class SourceState(_Strict):
    cursor: list[int] = Field(min_length=4, max_length=5)  # epoch, file, block, document, offset in it
    deficit: float
    drawn: int = Field(ge=0)
    fingerprint: str | None = None  # Spec.source_fingerprint (absent in states written before it)

    @field_validator("cursor")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(x < 0 for x in v):
            raise ValueError(f"cursor {v} has a negative entry")
        return v

    @field_validator("deficit")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("deficit is not a finite number")
        return v


class Delivered(_Strict):
    tokens: int = Field(ge=0)
    samples: int = Field(ge=0)


class ParkedSource(SourceState):
    carry: list[list[int]] = Field(default_factory=list)


class Override(_Strict):
    at_step: int = Field(ge=0)
    weights: dict[str, float]
    by: Literal["user", "online"] = "user"

    @field_validator("weights")
    @classmethod
    def _valid(cls, v: dict[str, float]) -> dict[str, float]:
        if any(not math.isfinite(x) or x < 0 for x in v.values()):
            raise ValueError("override weights must be finite and >= 0")
        return v


class OnlineState(_Strict):
    reports: dict[str, dict[str, float]] = Field(default_factory=dict)  # step -> {source: loss}


class DataState(_Strict):
    version: int
    fingerprint: str
    step: int = Field(ge=0)
    sources: dict[str, SourceState]
    carry: list[list[int]]
    delivered: Delivered | None = None  # absent in states written before it existed
    overrides: list[Override] | None = None  # run-time weight changes (set_weights, online policy)
    online: OnlineState | None = None
    parked: dict[str, ParkedSource] | None = None  # sources removed by a spec change, kept to come back


class StepShape(_Strict):
    dp: int = Field(ge=1)
    microbatches: int = Field(ge=1)
    seq_len: int = Field(ge=1)


class ClientState(_Strict):
    version: int
    data: dict[str, Any]
    next_microbatch: int = Field(ge=0)
    layout: StepShape | None = None
    at_step_boundary: bool | None = None  # informative: recomputed from next_microbatch
    tokens_seen: int | None = Field(None, ge=0)
    samples_seen: int | None = Field(None, ge=0)
    next: dict[str, Any] | None = None  # at a step's end: the data state after it, as a diff (state_log)
    checksum: str | None = None  # seal(): "sha256:<hex>" of the rest (required from version 2 on)


def _first_problem(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "the state"
    return f"{where}: {err['msg'].removeprefix('Value error, ')}"


def _parse(model: type[BaseModel], state: Any, what: str) -> BaseModel:
    if not isinstance(state, dict):
        raise PlaitError(f"this is not a {what}: expected a JSON object, got {type(state).__name__}")
    try:
        # JSON brings ints as ints and floats as floats, except that a deficit may be written as 0
        return model.model_validate(state, strict=False)
    except ValidationError as e:
        raise PlaitError(f"this is not a valid {what} ({_first_problem(e)})") from None


def parse_data_state(state: Any) -> DataState:
    """The data state's shape and version (not yet checked against a spec)."""
    parsed = _parse(DataState, state, "plait data state")
    if parsed.version != STATE_VERSION:
        raise PlaitError(f"data state version {parsed.version!r} is not supported (expected {STATE_VERSION})")
    return parsed


def check_data_state(state: Any, spec: Spec, fingerprint: str) -> DataState:
    """The data state, validated against the spec; a PlaitError saying what is wrong otherwise."""
    parsed = parse_data_state(state)
    if parsed.fingerprint != fingerprint:
        raise PlaitError(
            "the data state was saved with a different spec (sources, mixture or seed changed); "
            "resuming would not continue the same data stream. To continue anyway (changed weights or "
            "schedule, added or removed sources), pass allow_spec_change=True (plait run --allow-spec-change)"
        )
    for i, o in enumerate(parsed.overrides or []):
        if o.weights and sum(o.weights.values()) <= 0 and set(o.weights) >= set(spec.source_names):
            raise PlaitError(f"weight override {i} of the data state leaves no source a positive weight")
    missing = [n for n in spec.source_names if n not in parsed.sources]
    if missing:
        raise PlaitError(f"the data state has no cursor for source(s) {', '.join(missing)}")
    check_deficits(parsed)
    # 11 integers per row, 13 with the image columns, 16 with the audio ones too (plan.ALL_COLUMNS), the same for every row
    widths = (len(ITEM_INT_COLUMNS), len(ITEM_INT_COLUMNS) + len(ITEM_IMAGE_COLUMNS), len(ALL_COLUMNS))
    width = len(parsed.carry[0]) if parsed.carry and len(parsed.carry[0]) in widths else len(ITEM_INT_COLUMNS)
    for i, row in enumerate(parsed.carry):
        if len(row) != width or min(row, default=0) < 0:
            raise PlaitError(f"carried chunk {i} of the data state is malformed ({width} non-negative integers expected)")
        if row[0] >= len(spec.sources):
            raise PlaitError(f"carried chunk {i} names source {row[0]}, but the spec has {len(spec.sources)}")
    return parsed


def check_client_state(state: Any, max_microbatches: int, spec: Spec | None = None) -> ClientState:
    """A Loader state's shape, ranges and checksum; `max_microbatches`: the most micro-batches a step can
    have; `spec` (when given): the deficits are also checked against its longest chunk."""
    parsed = _parse(ClientState, state, "plait Loader state")
    if parsed.version not in (1, CLIENT_STATE_VERSION):
        raise PlaitError(f"Loader state version {parsed.version!r} is not supported (expected {CLIENT_STATE_VERSION})")
    limit = parsed.layout.microbatches if parsed.layout is not None else max_microbatches
    limit = max(limit, max_microbatches)
    if parsed.next_microbatch > limit:
        raise PlaitError(
            f"next_microbatch {parsed.next_microbatch} is beyond the step's micro-batches (at most {limit}); "
            "the state was edited or belongs to another job"
        )
    data = parse_data_state(parsed.data)
    longest = None
    if spec is not None:  # a chunk is at most seq_len tokens: no deficit is below minus the longest one
        longest = max(spec.packing.seq_len, parsed.layout.seq_len if parsed.layout is not None else 0)
    check_deficits(data, longest)
    after = (parsed.next or {}).get("step", (parsed.next or {}).get("full", {}).get("step"))
    if after is not None and after != data.step + 1:
        raise PlaitError(f"next.step {after} does not follow data.step {data.step}; the state was edited or corrupted")
    if parsed.version >= 2:
        verify_checksum(state)
    return parsed


def check_deficits(data: DataState, longest: int | None = None) -> None:
    """Every deficit (of a source, or a parked one) in the range a Planner leaves it: at most 0 after a
    step (it draws until the deficit is used up), and not below minus the longest chunk (the last chunk
    drawn overshoots by less than itself). An edited deficit would stall a source or flood a step."""
    entries = [(f"sources.{n}", s) for n, s in data.sources.items()]
    entries += [(f"parked.{n}", s) for n, s in (data.parked or {}).items()]
    for where, src in entries:
        too_low = longest is not None and src.deficit < -longest - DEFICIT_TOLERANCE
        if src.deficit > DEFICIT_TOLERANCE or too_low:
            raise PlaitError(
                f"the data state's {where}.deficit is {src.deficit:g}, outside the range a Planner leaves it "
                f"([{-(longest or 0)}, 0]: a source's quota never runs ahead, and overshoots by less than "
                "one chunk); the state was edited or corrupted"
            )


def canonical_checksum(state: dict) -> str:
    """SHA-256 of the state without its checksum, as canonical JSON: the same after a JSON round trip
    (tuples become lists, integer keys strings, key order lost)."""
    body = json.loads(json.dumps({k: v for k, v in state.items() if k != "checksum"}))
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def seal(state: dict) -> dict:
    """`state` with its checksum (`checksum`), which `check_client_state` verifies."""
    return {**state, "checksum": canonical_checksum(state)}


def verify_checksum(state: dict) -> None:
    got = state.get("checksum")
    if got is None:
        raise PlaitError(
            f"this Loader state (version {CLIENT_STATE_VERSION}) has no checksum; the state was edited or "
            "corrupted (a state is saved with its checksum by Loader.state_dict() and `plait run --save-state`)"
        )
    if got != canonical_checksum(state):
        raise PlaitError(
            "the Loader state's checksum does not match its content: the state was edited or corrupted. "
            "Resume from the state as saved (a JSON round trip is fine; changing any value is not)"
        )


def after_consumed_step(state: dict, at_boundary: bool | None) -> dict:
    """A Loader state saved after its step's last micro-batch, moved to the start of the next step when
    it holds the data state after that step (`next`, written by every runtime): a spec or layout change
    applies from there, and the consumed step is never re-planned under the new spec or layout."""
    if not state["next_microbatch"] or not at_boundary or state.get("next") is None:
        return state
    return {**state, "data": apply_state_diff(state["data"], state["next"]), "next_microbatch": 0, "next": None}


def boundary_state(data: dict, spec: Spec) -> dict:
    """The sealed Loader state at the start of `data`'s step, on `spec`'s layout (what `plait run
    --save-state` writes, so that `Loader.load_state_dict` and `plait run --resume` both take it)."""
    delivered = data.get("delivered") or {"tokens": 0, "samples": 0}
    return seal({
        "version": CLIENT_STATE_VERSION, "data": data, "next_microbatch": 0,
        "layout": {"dp": spec.topology.dp, "microbatches": spec.packing.num_microbatches,
                   "seq_len": spec.packing.seq_len},
        "at_step_boundary": True, "tokens_seen": int(delivered["tokens"]), "samples_seen": int(delivered["samples"]),
    })
