"""The plan window: the planned steps of a shared stream that some rank may still ask for.

Every step is planned once for all ranks, in order; the last `size` are kept, and none that a live consumer
(job.consumers) may still ask for. The window is bounded: a rank that would have it hold more than `size` steps ahead of the
slowest live consumer WAITS (backpressure) instead of the slow one failing. A wait is counted (`waits`,
`wait_seconds`) and, when it lasts `report_s` seconds, logged once naming the consumer it waits for. A
consumer that is really gone (left, its process died, silent too long) stops holding the window.

The caller's lock guards the window (`cond` is a Condition over it): planning is serialised, waiting
releases it.
"""

from __future__ import annotations

import logging
import threading
import time
import json
from collections import OrderedDict
from typing import Any, Callable, Protocol

from plait.errors import PlaitError
from plait.plan import StepPlan

log = logging.getLogger("plait.serving")


class Readers(Protocol):
    """Who reads a stream, the plan stream's swappable "who is slowest" policy: told of the trainer
    processes that join and leave, of every ask and every build, it names the window's low end (`slowest`) and the builds whose readers pin a planned
    step's blocks (`reading`; None: every rank). job.consumers.Consumers follows the readers' asks (a
    served or node-shared job), job.consumers.RankProgress the ranks' builds (the Ray Planner)."""

    def join(self, client: str, pid: int) -> None: ...
    def leave(self, client: str) -> None: ...
    def asked(self, ask: Any, gen: int, step: int) -> None: ...
    def built(self, gen: int, step: int, rank: int) -> None: ...
    def slowest(self, gen: int, base_step: int) -> tuple[int | None, str]: ...
    def reading(self, gen: int) -> set[int] | None: ...
WINDOW = 64  # planned steps kept at most (fastest rank minus slowest live one)
REPORT_S = 5.0  # a wait this long is logged, naming the rank it waits for
POLL_S = 0.25  # a waiting rank looks again this often (a slow rank may have died meanwhile)


class StaleGeneration(PlaitError):
    """The plan stream was reset (a client resumed from another data state) under this request."""


class PlanWindow:
    """Planned steps of the current generation. `plan_next()` plans the next step (the Planner's),
    `next_step()` is the step it would plan; `lock` is the caller's (an RLock is fine)."""

    def __init__(self, plan_next: Callable[[], StepPlan], next_step: Callable[[], int], consumers: Readers,
                 lock, *, size: int = WINDOW, report_s: float = REPORT_S):
        if size < 1:
            raise PlaitError(f"the plan window must hold at least 1 step (got {size})")
        self.plan_next, self.next_step = plan_next, next_step
        self.consumers = consumers
        self.cond = threading.Condition(lock)
        self.size, self.report_s = int(size), float(report_s)
        self.gen = 0
        self.base_step = next_step()
        self.steps: OrderedDict[int, StepPlan] = OrderedDict()
        self.waits = 0  # requests that waited for a slower rank
        self.wait_seconds = 0.0
        self.longest = 0  # most steps held at once
        self.lagging = ""  # who the last long wait waited for
        self.changed_by: tuple[int, Any, list[str]] | None = None  # (generation, state, changes) of change_once
        self.stopped: str | None = None  # why the stream serves no more (stop)

    def reset(self) -> int:
        """A new generation from the Planner's current state (after a seek): nothing planned kept."""
        self.steps.clear()
        self.gen += 1
        self.base_step = self.next_step()
        self.cond.notify_all()
        return self.gen

    def change_once(self, state: dict, apply: Callable[[], tuple[int, list[str]]]) -> tuple[int, list[str]]:
        """A resume under a changed spec, applied once for the whole job: every rank of a shared job loads
        the same checkpoint with allow_spec_change, and each call would otherwise start a generation of its
        own (the ranks that asked before then read a stream that was reset under them). The first call runs
        `apply` (the seek, returning (generation, changes)); an identical request while that generation is
        still the stream's joins it and gets the same changes."""
        key = plain_state(state)
        if self.changed_by is not None and self.changed_by[:2] == (self.gen, key):
            return self.gen, list(self.changed_by[2])
        gen, changes = apply()
        self.changed_by = (gen, key, list(changes))
        return gen, list(changes)

    def adopt(self, gen: int, changed_by: tuple | None = None) -> None:
        """Continue generation `gen` of a stream planned elsewhere (a successor of a dead Planner: requests
        in flight for `gen` stay valid); nothing planned kept. `changed_by`: the dead Planner's change_once
        record; while it made `gen`, a rank that asks the same change after the takeover joins `gen`
        instead of resetting the stream under the ranks that asked before."""
        self.steps.clear()
        self.gen = int(gen)
        self.base_step = self.next_step()
        made_gen = changed_by is not None and int(changed_by[0]) == self.gen
        self.changed_by = (self.gen, changed_by[1], list(changed_by[2])) if made_gen else None

    def forget_from(self, step: int) -> None:
        """Drop the planned steps from `step` on: the Planner was set back to plan them again (identically)."""
        for s in [s for s in self.steps if s >= step]:
            del self.steps[s]

    def stop(self, reason: str) -> None:
        """Serve no more: every request from now on, and every one waiting, fails with `reason` (a node's
        host whose trainer died: its ranks must hear why instead of waiting for it)."""
        self.stopped = reason
        self.cond.notify_all()

    def check(self, gen: int) -> None:
        if self.stopped is not None:
            raise PlaitError(self.stopped)
        if gen != self.gen:
            raise StaleGeneration(f"the plan stream was reset (generation {self.gen}, asked {gen}): another "
                                  "trainer loaded a different data state; resume every rank from the same state")

    # ----- backpressure -------------------------------------------------------------------------------
    def admits(self, step: int) -> bool:
        """Whether `step` may be planned now (planned already, or within `size` of the slowest consumer)."""
        if step < self.next_step():
            return True
        low, _ = self.consumers.slowest(self.gen, self.base_step)
        return low is None or step < low + self.size

    def edge(self) -> int | None:
        """The first step not admitted now (None: any is): a rank's build-ahead stops there."""
        low, _ = self.consumers.slowest(self.gen, self.base_step)
        return None if low is None else max(self.next_step(), low + self.size)

    def admit(self, gen: int, step: int) -> None:
        """Wait (the caller's lock released meanwhile) until `step` of `gen` may be planned."""
        self.check(gen)
        if self.admits(step):
            return
        self.waits += 1
        t0, reported = time.monotonic(), False
        while not self.admits(step):
            self.cond.wait(POLL_S)
            self.check(gen)
            waited = time.monotonic() - t0
            if not reported and waited >= self.report_s:
                reported = True
                _, who = self.consumers.slowest(self.gen, self.base_step)
                self.lagging = who
                log.warning("plait: step %d waits for %s (more than %d steps behind) for %.0f s; the shared stream "
                            "keeps at most %d planned steps", step, who, self.size, waited, self.size)
        self.wait_seconds += time.monotonic() - t0

    def moved(self) -> int:
        """A consumer moved on, left or died: waiting ranks look again, steps nobody needs go (how many)."""
        gone = self.evict()
        self.cond.notify_all()
        return gone

    # ----- planned steps ------------------------------------------------------------------------------
    def plan(self, gen: int, step: int) -> StepPlan:
        """The plan of `step` (planned now, with every step before it, when new). Never waits: `admit` did."""
        self.check(gen)
        if step in self.steps:
            return self.steps[step]
        if step < self.next_step():
            raise PlaitError(f"step {step} left the job's plan window (no live rank was reading it); resume "
                             "from a saved state")
        while self.next_step() <= step:
            plan = self.plan_next()
            self.steps[plan.step] = plan
        self.evict()
        self.longest = max(self.longest, len(self.steps))
        return self.steps[step]

    def evict(self) -> int:
        """Drop the oldest planned steps beyond `size`, never one a live consumer may still ask for (a
        reader that has not asked yet, e.g. a rank that starts late, finds the last `size` steps). Returns
        how many went."""
        low, _ = self.consumers.slowest(self.gen, self.base_step)
        gone = 0
        while len(self.steps) > self.size:
            first = next(iter(self.steps))
            if low is not None and first >= low:
                break
            self.steps.popitem(last=False)
            gone += 1
        return gone

    def stats(self) -> dict:
        return {"window": len(self.steps), "window_size": self.size, "longest": self.longest,
                "waits": self.waits, "wait_seconds": round(self.wait_seconds, 3), "lagging": self.lagging}


def plain_state(state: Any) -> Any:
    """A data state as a client sends it: through JSON (lists for tuples and arrays)."""
    return json.loads(json.dumps(state, default=_plain))


def _plain(x: Any) -> Any:
    return x.tolist() if hasattr(x, "tolist") else str(x)
