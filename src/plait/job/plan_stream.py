"""The plan stream, one half of a job's service: every global step planned once for all ranks, in a bounded
window (job.window), in generations (a `seek` to another data state starts one), with the data state at and
after each step, and the one waiting rule: a rank too far ahead of the slowest reader waits. Who is slowest
is a policy object (job.window.Readers): the readers' asks in process (job.consumers.Consumers), the ranks'
builds on Ray (job.consumers.RankProgress).

The other half builds each rank's micro-batches (job.rank_builds); it asks this one through `PlanSource`:
`order` (a step's plan and the state before it), `admit` (the waiting rule: returns once the step may be
planned), `built` and `state_at`. A `PlanStream` is a PlanSource in process (plait.job.service.JobService);
the Ray Planner actor composes one and answers the same calls for its Constructors.

Blocks: a planned step keeps its blocks in the loaders while a build that some reader still reads has not
been made (`Readers.reading`); a rank nobody reads pins nothing, and steps leave with the window's low end.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Protocol

from plait.job.consumers import Ask
from plait.job.cp_builds import build_ranks
from plait.job.window import REPORT_S, WINDOW, PlanWindow, Readers, plain_state
from plait.plan import StepPlan

AFTER_KEPT = 8  # states after a planned step kept for `state_after` (a trainer checkpoints the step it read)


class StreamRoles(Protocol):
    """What the plan stream drives: the Planner (`planner.step`, `planner.ranks`), its state and the
    loaders' blocks (`release`: keep those of these plans, the Planner's own, drop the rest)."""

    planner: Any
    spec: Any

    def plan(self) -> StepPlan: ...
    def release(self, *in_flight: StepPlan) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict, *, allow_spec_change: bool = False) -> list[str]: ...
    def set_weights(self, weights: dict, at_step: int) -> None: ...
    def report(self, step: int, losses: dict) -> None: ...


class PlanSource(Protocol):
    """What a rank's builds ask of the plan stream (in process: a PlanStream; on Ray: the Planner actor,
    through plait.runtime.ray.constructor_actor.PlannerPlans)."""

    def order(self, gen: int, step: int, rank: int, with_state: bool) -> tuple[Any, dict | None]:
        """(what the build of `rank` at `step` is made from, the state before the step or None)."""

    def admit(self, gen: int, step: int, ask: Ask | None) -> int | None:
        """Wait until `step` may be planned; the first step not admitted then (None: any)."""

    def built(self, gen: int, step: int, rank: int) -> None: ...
    def state_at(self, gen: int, step: int) -> dict: ...


def kept_blocks(planner, in_flight) -> tuple[set, set]:
    """(blocks the Planner still needs, blocks the next steps draw from: those of the carried chunks and of
    the `in_flight` plans, the shared buffer budget's window): what a loader's `retain` is told."""
    drawn = set(planner.carry.block_keys()[0])
    for plan in in_flight:
        drawn.update(plan.items.block_keys()[0])
    return planner.live_blocks(), drawn


def same_state(a: dict, b: dict) -> bool:
    """Equal as a client sees them (a state that went through JSON has lists for tuples)."""
    return plain_state(a) == plain_state(b)


class PlanStream:
    """A job's shared, windowed plan stream over `roles`, its waiting rule's low end set by `readers`.
    `lock`: the caller's (an RLock; waits release it). `rewind(step, state)`: a successor Planner set back
    to a step its predecessor planned (True when it served `state`); `planned(plans)`: told of new steps."""

    def __init__(self, roles: StreamRoles, readers: Readers, *, lock=None, size: int = WINDOW,
                 report_s: float = REPORT_S):
        self.roles, self.readers = roles, readers
        self.lock = lock if lock is not None else threading.RLock()
        self.builds_per_step = build_ranks(roles.spec, roles.planner.ranks)  # with dynamic CP one per pool rank
        self.window = PlanWindow(self._plan_next, lambda: roles.planner.step, readers, self.lock,
                                 size=size, report_s=report_s)
        self.base_state = roles.state_dict()
        self.made: dict[int, set[int]] = {}  # planned step -> builds made (its blocks go once no reader needs it)
        self.after: dict[int, dict] = {}  # step -> the Planner's state right after planning it (the last few)
        self.rewind: Callable[..., bool] = lambda step, state=None: False
        self.planned: Callable[[list[StepPlan]], None] = lambda plans: None
        self.on_reset: Callable[[], None] = lambda: None  # a new generation: the builds of the old one go

    @property
    def gen(self) -> int:
        return self.window.gen

    def _plan_next(self) -> StepPlan:
        plan = self.roles.plan()
        self.after[plan.step] = self.roles.state_dict()
        self.after.pop(plan.step - AFTER_KEPT, None)
        return plan

    # ----- generations --------------------------------------------------------------------------------
    def base(self) -> tuple[int, dict]:
        with self.lock:
            return self.gen, self.base_state

    def seek(self, state: dict) -> int:
        """Make step state['step'] start from `state`; a no-op when the stream already does."""
        with self.lock:
            step = state.get("step") if isinstance(state, dict) else None
            if isinstance(step, int):  # else not a state: the roles' check below names what is wrong
                plan = self.window.steps.get(step)
                if plan is not None and same_state(plan.state_before, state):
                    return self.gen
                if plan is None and self.roles.planner.step == step and same_state(self.roles.state_dict(), state):
                    return self.gen
                if self.rewind(step, state):
                    return self.gen
            self.roles.load_state_dict(state)  # validates version, fields and fingerprint
            return self.new_generation()

    def seek_with_changes(self, state: dict) -> tuple[int, list[str]]:
        """`seek` to a state saved under another spec: (generation, the changes found). Every rank asks it
        with the same state; the first starts the new generation, the others join it (PlanWindow.change_once)."""
        def apply() -> tuple[int, list[str]]:
            changes = self.roles.load_state_dict(state, allow_spec_change=True) or []
            return self.new_generation(), list(changes)

        with self.lock:
            return self.window.change_once(state, apply)

    def new_generation(self) -> int:
        self.made.clear()
        self.after.clear()
        self.on_reset()
        self.base_state = self.roles.state_dict()
        return self.window.reset()

    # ----- states -------------------------------------------------------------------------------------
    def state_at(self, gen: int, step: int, wait: bool = True) -> dict:
        """The data state at the start of `step` of `gen`; planning it waits in the window unless `wait`
        is off (a caller that may not block: the Ray Planner's one thread)."""
        with self.lock:
            if gen == self.gen and step == self.base_state["step"]:
                return self.base_state
            if gen == self.gen and step == self.roles.planner.step:
                return self.roles.state_dict()
            if wait:
                self.window.admit(gen, step)
            return self.plan(gen, step).state_before

    def state_after(self, gen: int, step: int) -> dict | None:
        """The Planner's state right after it planned `step` of `gen` (None when no longer known): the
        data state a step-boundary checkpoint carries as `next`."""
        with self.lock:
            return self.after.get(step) if gen == self.gen else None

    def replan_after(self, state: dict, layout: dict) -> dict:
        """The data state after the step starting at `state`, re-planned on the saved `layout` (elastic
        resume, job.elastic: metadata only, on a loader of its own; the stream is untouched)."""
        from plait.job.elastic import replan_after

        return replan_after(self.roles.spec, state, layout)

    def set_weights(self, weights: dict, at_step: int) -> None:
        self.roles.set_weights(weights, at_step)  # the Planner refuses a step already planned

    def report(self, step: int, losses: dict) -> None:
        self.roles.report(step, losses)

    # ----- planned steps ------------------------------------------------------------------------------
    def plan(self, gen: int, step: int) -> StepPlan:
        """The plan of `step` of `gen` (planned now, with the steps before it, when new)."""
        with self.lock:
            self.window.check(gen)
            if step in self.window.steps:
                return self.window.steps[step]
            if step < self.roles.planner.step:  # a successor re-plans a step its predecessor planned
                self.rewind(step)
            first, held = self.roles.planner.step, set(self.window.steps)
            plan = self.window.plan(gen, step)
            for gone in held.union(range(first, self.roles.planner.step)).difference(self.window.steps):
                self.made.pop(gone, None)
            self.release()
            self.planned([self.window.steps[s] for s in range(first, self.roles.planner.step) if s in self.window.steps])
            return plan

    def order(self, gen: int, step: int, rank: int, with_state: bool = True) -> tuple[StepPlan, dict]:
        """PlanSource.order in process: the step's plan (a build takes its rank's part) and the state."""
        plan = self.plan(gen, step)
        return plan, plan.state_before

    def built(self, gen: int, step: int, rank: int) -> None:
        """Build `rank` of `step` was made: the readers hear it, and the step's blocks go when no reader
        needs them any more."""
        with self.lock:
            self.readers.built(gen, step, rank)
            self.window.moved()
            if gen != self.gen or step not in self.window.steps:
                return
            self.made.setdefault(step, set()).add(rank)
            if not self._needed(step):
                self.release()

    def _needed(self, step: int) -> bool:
        done = self.made.get(step, set())
        reading = self.readers.reading(self.gen)
        return len(done) < self.builds_per_step if reading is None else not done >= reading

    def release(self) -> None:
        """The loaders keep the Planner's live blocks and those of planned steps some reader still needs."""
        with self.lock:
            self.roles.release(*(plan for s, plan in self.window.steps.items() if self._needed(s)))

    # ----- the waiting rule ---------------------------------------------------------------------------
    def admit(self, gen: int, step: int, ask: Ask | None = None) -> int | None:
        """`ask` asked for `step` of `gen`: wait while it is more than the window ahead of the slowest
        reader; returns the first step not admitted then (None: any), where a build-ahead stops."""
        with self.lock:
            if ask is not None:
                self.readers.asked(ask, gen, step)
            if self.window.moved():
                self.release()
            self.window.admit(gen, step)
            return self.window.edge()

    def join(self, client: str, pid: int) -> None:
        """A trainer process `pid` reads the stream as `client` (it holds the window until it leaves or dies)."""
        self.readers.join(client, pid)

    def leave(self, client: str) -> None:
        """`client` reads no more: waiting ranks look again, steps and blocks nobody needs go."""
        self.readers.leave(client)
        with self.lock:
            self.window.moved()
            self.release()

    def stop(self, reason: str) -> None:
        """Refuse every request from now on with `reason`; requests waiting in the window fail with it too."""
        with self.lock:
            self.window.stop(reason)
