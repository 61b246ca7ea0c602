"""Schemas of the states a user hands back: the data state (the Planner's) and the Client's state.

A state comes from a file a user names, so it is validated before anything reads it: its shape (a
schema), then its ranges against the spec (every source present, cursors non-negative, carried chunks
that name a source of the spec). What is wrong is said in one sentence, as a PlaitError; the Planner
checks the rest (a cursor beyond a source's files or blocks) when it loads the state.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from plait.errors import PlaitError
from plait.plan import ALL_COLUMNS, ITEM_INT_COLUMNS
from plait.spec import Spec

STATE_VERSION = 1
CLIENT_STATE_VERSION = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


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


class Layout(_Strict):
    dp: int = Field(ge=1)
    microbatches: int = Field(ge=1)
    seq_len: int = Field(ge=1)


class ClientState(_Strict):
    version: int
    data: dict[str, Any]
    next_microbatch: int = Field(ge=0)
    layout: Layout | None = None
    at_step_boundary: bool | None = None  # informative: recomputed from next_microbatch
    tokens_seen: int | None = None
    samples_seen: int | None = None
    next: dict[str, Any] | None = None  # at a step's end: the data state after it, as a diff (state_log)


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
    # 11 integers per row, or 13 with the image columns (plan.ALL_COLUMNS), the same for every row
    width = len(parsed.carry[0]) if parsed.carry and len(parsed.carry[0]) == len(ALL_COLUMNS) else len(ITEM_INT_COLUMNS)
    for i, row in enumerate(parsed.carry):
        if len(row) != width or min(row, default=0) < 0:
            raise PlaitError(f"carried chunk {i} of the data state is malformed ({width} non-negative integers expected)")
        if row[0] >= len(spec.sources):
            raise PlaitError(f"carried chunk {i} names source {row[0]}, but the spec has {len(spec.sources)}")
    return parsed


def check_client_state(state: Any, max_microbatches: int) -> ClientState:
    """A Loader state's shape and ranges; `max_microbatches`: the most micro-batches a step can have."""
    parsed = _parse(ClientState, state, "plait Loader state")
    if parsed.version != CLIENT_STATE_VERSION:
        raise PlaitError(f"Loader state version {parsed.version!r} is not supported (expected {CLIENT_STATE_VERSION})")
    limit = parsed.layout.microbatches if parsed.layout is not None else max_microbatches
    limit = max(limit, max_microbatches)
    if parsed.next_microbatch > limit:
        raise PlaitError(
            f"next_microbatch {parsed.next_microbatch} is beyond the step's micro-batches (at most {limit}); "
            "the state was edited or belongs to another job"
        )
    return parsed
