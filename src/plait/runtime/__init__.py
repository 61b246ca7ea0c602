"""Runtimes decide where the roles run: `local` (one process), `node` (one per node), `ray` (actors) or
`flight` (a thin client of a served job).

Two contracts, two Protocols. `RankStream` is the trainer's: one rank's micro-batches, its data state and
the run-time mixing calls; every runtime is one (plait.Loader reads it). `JobDriver` is a whole job's:
plan a step, build a rank's share of it, release what is no longer needed (`plait run`, the benchmarks,
plait.job.service.JobService); only runtimes whose roles this process drives are one (`local`, `ray`),
a thin client (`flight`, `node`) is a stream only. `make_runtime` is the one way to get a stream,
`make_driver` a driver: each names any option the chosen runtime does not take instead of silently
dropping it.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Iterator, Protocol, runtime_checkable

from plait.errors import PlaitError

if TYPE_CHECKING:  # types only: importing them at run time would load every role for a name
    from plait.batch import MicroBatch
    from plait.plan import StepPlan
    from plait.spec import Spec

RUNTIMES = ("local", "node", "ray", "flight")
DRIVERS = ("local", "ray")  # the runtimes that drive a job's roles from this process


@runtime_checkable
class RankStream(Protocol):
    """The trainer's contract. States are the Planner's data state (JSON-serialisable dicts)."""

    def iter_rank(
        self, dp_rank: int, start_state: dict, start_micro: int, max_steps: int | None, cp_rank: int = 0
    ) -> Iterator[tuple[dict, MicroBatch]]:
        """One DP rank's micro-batches from a data state on: (state at the step's start, batch); with
        context parallelism, the shard of CP rank `cp_rank` (cut in exactly one place per runtime)."""
        ...

    def state_dict(self) -> dict: ...

    def state_after(self, step: int) -> dict | None:
        """The data state after a recently iterated `step` (None when no longer known): a Loader's
        step-boundary checkpoint carries it (`next`), so a spec or layout change resumes from there."""
        ...

    def replan_after(self, state: dict, layout: dict) -> dict:
        """The data state after the step that starts at `state`, re-planned on the `layout` it ran on
        (plait.job.elastic), on the job's side: an elastic resume never plans in a thin trainer."""
        ...

    def load_state_dict(self, state: dict, *, allow_spec_change: bool = False) -> list[str] | None:
        """Continue from a data state. With `allow_spec_change`, a state of another mixture or set of
        sources continues under this spec (state/spec_change.py); returns the changes found."""
        ...

    def set_weights(self, weights: dict[str, float], at_step: int) -> None:
        """Pin sources' token shares from global step `at_step` on (the Planner's `set_weights`): recorded
        in the data state; a step already planned is refused."""
        ...

    def report(self, step: int, losses: dict[str, float]) -> None:
        """Per-source losses of a trained step for the online mixing policy (the Planner's `report`)."""
        ...

    def error_report(self) -> dict:
        """{source: {"skipped": n, "messages": [...]}} for records skipped under `on_error: skip`."""
        ...

    def scaling_report(self) -> dict:
        """How the loader layout changed while the job ran: {"events": [...], "timeline": [...], "options":
        the autoscale options or None} (ray: plait.runtime.ray.autoscaler; a runtime that never rescales
        returns no events, no timeline and no options)."""
        ...

    def close(self) -> None:
        """Release what this runtime started (never starts anything)."""
        ...


@runtime_checkable
class JobDriver(Protocol):
    """A whole job's contract: the roles driven step by step."""

    def plan(self) -> StepPlan:
        """Plan the next global step (advances the Planner)."""
        ...

    def build(self, plan: StepPlan, dp_rank: int, only: set[int] | None = None) -> list[MicroBatch]:
        """Build one DP rank's micro-batches of a planned step (`only`: those micro-batch indices)."""
        ...

    def release(self, *in_flight: StepPlan) -> None:
        """Let loaders drop blocks that neither the Planner nor the given plans still need."""
        ...


Runtime = RankStream  # the name of plait <= 0.x's one Protocol: the trainer's side


def runtime_class(name: str) -> type:
    if name == "local":
        from plait.runtime.local import LocalRuntime

        return LocalRuntime
    if name == "node":  # the local runtime's roles, one set per node (plait.runtime.node_share)
        from plait.runtime.node_share import NodeRuntime

        return NodeRuntime
    if name == "ray":
        try:
            from plait.runtime.ray import RayRuntime
        except ImportError as e:  # ray is an extra
            raise PlaitError(f"the ray runtime needs `pip install plait[ray]` ({e})") from None
        return RayRuntime
    if name == "flight":  # the thin trainer client: batches over Arrow Flight, no Ray in this process
        try:
            from plait.runtime.flight import FlightRuntime
        except ImportError as e:  # pyarrow's Flight is part of the ray extra
            raise PlaitError(f"the flight runtime needs pyarrow with Flight (`pip install pyarrow`; {e})") from None
        return FlightRuntime
    raise PlaitError(f"unknown runtime {name!r} (choose one of: {', '.join(RUNTIMES)})")


def accepted_options(cls: type) -> list[str]:
    """The keyword options a runtime's constructor takes (besides the spec): its `option_names()`, or
    else its keyword-only parameters."""
    if hasattr(cls, "option_names"):
        return list(cls.option_names())
    params = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


def make_driver(spec: Spec, name: str = "local", **options) -> JobDriver:
    """The driver of a whole job of `spec` on runtime `name` (`local` or `ray`): plan, build, release."""
    if name not in DRIVERS:
        raise PlaitError(f"the {name} runtime reads a served job's stream and drives no job: drive one with "
                         f"{' or '.join(DRIVERS)}")
    return make_runtime(spec, name, **options)


def make_runtime(spec: Spec, name: str = "local", **options) -> RankStream:
    """The runtime `name` for `spec`; an option it does not take is an error naming it."""
    cls = runtime_class(name)
    allowed = accepted_options(cls)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise PlaitError(
            f"the {name} runtime does not take the option(s) {', '.join(unknown)}"
            f" (it takes: {', '.join(allowed) or 'none'})"
        )
    return cls(spec, **options)
