"""How the Planner actor serves a call, and who is told about it.

The Planner actor (plait.runtime.ray.planner_actor) plans; what has to follow planning or a request is done
by its observers, each told at one place: `on_planned(plans)` once per planning call that planned steps,
`on_request(request)` once per served request. The observers: the standby (plait.runtime.ray.standby_planner:
sends the states planned, and waits for the standby after a change planning cannot reproduce), the routing
(plait.runtime.ray.routing: forgets build orders that can no longer finish, retires old layouts), the
loaders' recovery (plait.runtime.ray.recovery: checkpoints for the shadows as the Planner advances) and the
job's presence (plait.runtime.ray.planner_jobs: a trainer's request keeps the job alive).

`planner_call(request)` marks a Planner method as one request: it runs under the actor's lock (the
planner-hosted Constructor, plait.runtime.ray.planner_host, calls the Planner from its own threads, and the
autoscaling thread switches layouts through the actor) and then tells the observers what kind of request it
was (`Request`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Protocol, TypeVar

from plait.plan import StepPlan


@dataclass(frozen=True)
class Request:
    """What a served request means to the observers.

      trainer   a trainer's call (or a Constructor's on its behalf): the job is in use
      state     changed the data state in a way planning cannot reproduce (a seek, run-time weights, an
                online-mixing report, a layout switch): the standby must have it before the call returns
      facts     changed who uses the job (trainers, Constructors): the standby keeps it for a successor
      built     a build finished: the oldest step still needed may have moved
    """

    trainer: bool = False
    state: bool = False
    facts: bool = False
    built: bool = False


WINDOW_GROUP = "window"  # the Planner's concurrency group for `admit`: a Constructor's request waits there
WINDOW_THREADS = 64  # requests that may wait at once (a node's Constructor serves up to 64 ranks' requests)

INTERNAL = Request()  # a Constructor's or an operator's question: nothing to tell
READ = Request(trainer=True)
STATE = Request(trainer=True, state=True)
MEMBERS = Request(trainer=True, facts=True)
CONSTRUCTOR = Request(facts=True)
LAYOUT = Request(state=True)
# A loader replaced on a Constructor's word: a successor must start from the new loader's name (else it
# starts the dead one's again beside it), and nothing is planned until that Constructor's build goes on.
LOADERS = Request(state=True)
BUILT = Request(built=True)


class StepObserver(Protocol):
    """Told what the Planner actor did (at one place each: `Observers`)."""

    def on_planned(self, plans: list[StepPlan]) -> None:
        """Steps were planned (once per planning call; `plans` the new steps the window still holds)."""

    def on_request(self, request: Request) -> None:
        """A request was served (after it returned without an error)."""


class Observers:
    """The Planner's observers, told in the order they were added."""

    def __init__(self, *observers: StepObserver):
        self.observers = list(observers)

    def add(self, observer: StepObserver) -> None:
        self.observers.append(observer)

    def planned(self, plans: list[StepPlan]) -> None:
        for observer in self.observers:
            observer.on_planned(plans)

    def served(self, request: Request) -> None:
        for observer in self.observers:
            observer.on_request(request)


Method = TypeVar("Method", bound=Callable)


def planner_call(request: Request = INTERNAL) -> Callable[[Method], Method]:
    """A Planner actor method served as one `request`: under the actor's `lock`, then its `observers` told.
    Nested calls (a build order asks for the state too) are requests of their own (the lock is an RLock)."""

    def wrap(method: Method) -> Method:
        @functools.wraps(method)
        def call(actor, *args, **kwargs):
            with actor.lock:
                out = method(actor, *args, **kwargs)
                actor.observers.served(request)
            return out

        return call  # type: ignore[return-value]

    return wrap
