"""The Ray Planner's request machinery without Ray: a request runs under the actor's lock and tells the
observers once, after it succeeded; the routing's upkeep forgets what can no longer finish; the plan window
the Planner shares with the job service (job.window) rewinds and continues a generation."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from plait.job.window import PlanWindow
from plait.runtime.ray.planner_requests import BUILT, READ, STATE, Observers, Request, planner_call
from plait.runtime.ray.routing import Routing, RoutingTable, RoutingUpkeep


class Recorder:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def on_planned(self, plans) -> None:
        self.log.append((self.name, "planned", [p.step for p in plans]))

    def on_request(self, request: Request) -> None:
        self.log.append((self.name, request))


class FakeActor:
    def __init__(self, log: list):
        self.lock = threading.RLock()
        self.observers = Observers(Recorder("a", log), Recorder("b", log))
        self.free_meanwhile: bool | None = None

    @planner_call(STATE)
    def change(self, fail: bool = False) -> int:
        other = threading.Thread(target=self._try_lock)
        other.start()
        other.join()
        if fail:
            raise ValueError("refused")
        return 7

    @planner_call(READ)
    def outer(self) -> int:
        return self.change() + 1

    def _try_lock(self) -> None:
        got = self.lock.acquire(blocking=False)
        if got:
            self.lock.release()
        self.free_meanwhile = got


def test_a_request_runs_under_the_lock_and_tells_every_observer_once():
    log: list = []
    actor = FakeActor(log)
    assert actor.change() == 7
    assert actor.free_meanwhile is False  # another thread could not take the lock while it ran
    assert log == [("a", STATE), ("b", STATE)]


def test_a_failed_request_tells_nobody():
    log: list = []
    actor = FakeActor(log)
    with pytest.raises(ValueError):
        actor.change(fail=True)
    assert log == []


def test_a_nested_request_is_a_request_of_its_own():
    log: list = []
    assert FakeActor(log).outer() == 8
    assert log == [("a", STATE), ("b", STATE), ("a", READ), ("b", READ)]


@dataclass
class Plan:
    step: int


class Counter:
    """A planner whose next step can be set back (as a successor's rewind does)."""

    def __init__(self):
        self.step = 0

    def plan(self) -> Plan:
        self.step += 1
        return Plan(self.step - 1)


class NoReaders:
    def slowest(self, gen: int, base_step: int):
        return None, ""


def window(counter: Counter, size: int = 4) -> PlanWindow:
    return PlanWindow(counter.plan, lambda: counter.step, NoReaders(), threading.RLock(), size=size)


def test_the_window_replans_from_a_rewound_step():
    counter = Counter()
    w = window(counter)
    w.plan(0, 5)
    assert list(w.steps) == [2, 3, 4, 5]  # the oldest beyond the size went
    counter.step = 3  # the Planner was set back to plan step 3 again
    w.forget_from(3)
    assert list(w.steps) == [2]
    assert w.plan(0, 4).step == 4 and list(w.steps) == [2, 3, 4]


def test_a_successor_continues_the_generation():
    counter = Counter()
    w = window(counter)
    counter.step = 10
    w.adopt(3)
    assert w.gen == 3 and w.base_step == 10 and not w.steps
    assert w.plan(3, 10).step == 10
    with pytest.raises(Exception, match="reset"):
        w.plan(2, 11)


class NoFleet:
    def retire(self) -> None:
        raise AssertionError("no layout is retired here")


def test_routing_upkeep_forgets_orders_that_cannot_finish():
    counter = Counter()
    w = window(counter)
    routes = RoutingTable(Routing(0, None, None, NoFleet()))
    upkeep = RoutingUpkeep(routes, w)
    w.plan(0, 5)
    for step in range(6):
        routes.order(0, step, 0, 0)
    upkeep.on_planned([w.steps[5]])
    assert sorted(step for _, step, _ in routes.orders) == [2, 3, 4, 5]  # steps 0, 1 left the window
    upkeep.on_request(BUILT)
    assert len(routes.orders) == 4  # a build report changes no generation
    counter.step = 0
    with w.cond:  # the Planner's lock: a seek is a request
        w.reset()  # generation 1
    upkeep.on_request(STATE)
    assert routes.orders == {}


class FleetConfig:
    """A LoaderConfig stand-in: one loader, handles are strings (LoaderFleet compares them by equality)."""

    layout = type("Layout", (), {"loaders": 1, "owned": [[(0, 0)]]})()

    def __init__(self):
        self.started: list[str] = []

    def name(self, k: int, generation: int = 0) -> str:
        return f"job/loader-{k}" + (f"~{generation}" if generation else "")

    def start(self, k: int, generation: int = 0, name: str | None = None) -> str:
        self.started.append(name or self.name(k, generation))
        return self.started[-1]


def test_an_ended_fleet_replaces_no_loader():
    """A loader found dead after its fleet was closed or retired is not replaced: the replacement would be
    a new actor that outlives the job (it once did, started while the job closed)."""
    from plait.errors import PlaitError
    from plait.runtime.ray.recovery import LoaderFleet

    config = FleetConfig()
    fleet = LoaderFleet(config, spec=None, options={}, now=lambda: 0, on_replaced=lambda: None)
    assert config.started == ["job/loader-0"]
    fleet.end()
    with pytest.raises(PlaitError, match="job/loader-0 is gone: its layout was retired or the job ended"):
        fleet.replace_if_current(0, "job/loader-0")
    fleet.after_planning(5)  # no shadow is started either
    assert config.started == ["job/loader-0"] and fleet.handles == ["job/loader-0"]
