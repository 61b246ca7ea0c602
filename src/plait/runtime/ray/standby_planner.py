"""The standby Planner: the job's Planner is not a single point of failure.

In a shared job (a job name, detached actors: many trainer processes, as under torchrun) the active
Planner (plait.runtime.ray.planner_actor) starts a standby actor, `<job>/planner-standby`, and sends it its
per-step data state after every step it plans, as plait.state.log diffs (a few hundred bytes per step:
cursors, deficits, carried chunks; never plans), plus the few facts a successor needs (generation, the
oldest step a Constructor still needs, attached trainers, Constructors, loader generations). Changes that
do not come from planning (a seek, run-time weights, online-mixing reports) are acknowledged by the
standby before the caller's call returns, so a successor can never miss one.

When the active Planner dies, whoever notices first (a Constructor whose plan request failed, a trainer
process, its heartbeat) calls `successor(job, dead_handle)`, which asks the standby to `take_over`. Takeovers
are serialised in the standby and keyed by the dead actor: the first call confirms the death and starts
exactly one new active Planner under the job's Planner name (from the same PlannerRecipe, with the
standby's log as its `takeover` option); every later or concurrent call for the same dead actor gets that
same new handle. The new Planner keeps the generation, so requests in flight stay valid, and re-plans from
the oldest step any Constructor still needs; planning is a pure function of the data state, so it plans
the very same steps (`Replay`: before each step it re-plans it loads the logged state when they differ,
e.g. after a report, and it can rewind to any logged step someone still asks for). The standby then
follows the new active Planner: the job again has one active Planner and one standby. Should the standby
die, the active Planner notices from its failed follow calls and starts another from its current state.

Without a standby (a private job, `planner_standby=False`, or the standby died together with its Planner)
a trainer process recreates the Planner from the data state it last saw (plait.runtime.ray.recovery).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time

from plait.state.log import apply_state_diff, diff_state, nbytes
from plait.runtime.ray.common import NAMESPACE, actor_options, dead_errors, get, process_rss, ray_module
from plait.runtime.ray.recovery import wait_name_free

log = logging.getLogger("plait.recovery")
TAKEOVER_TIMEOUT_S = 300.0  # how long a caller of `successor` waits for the standby's answer
FOLLOWS_KEPT = 32  # follow calls the active Planner keeps an eye on (to find a dead standby without extra calls)


def standby_name(job: str) -> str:
    return f"{job}/planner-standby"


def successor(job: str, dead) -> tuple[object, dict] | None:
    """(the job's new active Planner, the takeover event) after Planner handle `dead` failed; None when the
    job has no standby to take over (the caller then recreates the Planner itself). Safe to call from any
    number of processes at once: one takeover happens, everyone gets its Planner."""
    ray = ray_module()
    try:
        standby = ray.get_actor(standby_name(job), namespace=NAMESPACE)
    except ValueError:
        return None
    try:
        answer = get(standby.take_over.remote(dead), timeout=TAKEOVER_TIMEOUT_S)
    except dead_errors():
        return None
    return None if answer is None else (answer["planner"], answer["event"])


def standby_stats(job: str) -> dict | None:
    """The job's standby's figures (bytes and steps followed, takeovers), None when it has none."""
    ray = ray_module()
    try:
        return get(ray.get_actor(standby_name(job), namespace=NAMESPACE).standby_stats.remote(), timeout=30)
    except (ValueError, *dead_errors()):
        return None


# ----- the standby actor ------------------------------------------------------------------------------
class StandbyPlannerActor:
    """Holds the active Planner's recent data states (kilobytes) and makes its successor.

    A plain (one-threaded) actor: the active Planner's messages are applied in the order it sent them
    (Ray keeps one caller's order), and takeovers, queued behind them, happen one at a time. A takeover
    only starts the new Planner (it does not wait for it), so nothing here waits on a Planner that might
    itself be waiting on a message to this standby."""

    def __init__(self, recipe):
        self.recipe = recipe  # plait.runtime.ray.planner_actor.PlannerRecipe, without a takeover
        self.active = None  # the Planner followed (its handle)
        self.gen = 0
        self.base: dict | None = None
        self.states: dict[int, dict] = {}  # step -> the data state before that step
        self.last: dict | None = None  # the state the next diff applies to
        self.low = 0
        self.meta: dict = {}
        self.window = 64
        self.bytes = {"full": 0, "diffs": 0}
        self.messages = {"full": 0, "diffs": 0}
        self.steps_followed = 0
        self.takeovers: list[dict] = []

    def follow(self, sender, message: dict) -> str:
        """Apply the active Planner's next message: "ok"; "reset" asks the sender for its full state."""
        if self.active is None and message.get("reset"):
            self.active = sender  # the first Planner of the job (or of a restarted standby)
        if sender != self.active:
            return "reset"  # a dead Planner's late message, or a stranger's: not followed
        kind = "full" if message.get("reset") else "diffs"
        self.messages[kind] += 1
        self.bytes[kind] += nbytes(message)
        if message.get("reset"):
            self.gen, self.base, self.window = message["gen"], message["base"], message["window"]
            self.states = {int(s): st for s, st in message["states"].items()}
            self.last = self.states[max(self.states)]
        elif self.base is None:
            return "reset"  # diffs without a full state to apply them to
        for diff in message.get("diffs", ()):
            state = apply_state_diff(self.last, diff)
            self.steps_followed += int(state["step"]) > int(self.last["step"])
            self.states[int(state["step"])] = self.last = state
        self.low = message.get("low", self.low)
        self.meta.update(message.get("meta", {}))
        top = max(self.states)
        for step in [s for s in self.states if s < min(self.low, top - self.window)]:
            del self.states[step]
        return "ok"

    def take_over(self, dead) -> dict | None:
        """Start the successor of Planner `dead` (a handle), once: {"planner", "event"}; None when this
        standby has no state to take over from."""
        if self.active is None:
            return None  # nothing followed yet
        if dead != self.active or _answers(self.active):  # already replaced (every later caller), or alive
            return {"planner": self.active, "event": self._event_of(dead)}
        if self.base is None:
            return None  # a new standby that has not heard from the Planner yet: nothing to take over from
            return {"planner": self.active, "event": self._event_of(dead)}
        at = time.time()
        package = {"gen": self.gen, "base": self.base, "states": dict(self.states), "low": self.low,
                   "meta": dict(self.meta), "window": self.window, "at": at}
        log.warning("failure: Planner %s is dead; the standby takes over from step %d (%d steps logged)",
                    self.recipe.name, self.low, len(self.states))
        wait_name_free(self.recipe.name)
        options = {**self.recipe.options, "takeover": package,
                   "loader_generations": self.meta.get("loader_generations"),
                   "loader_names": self.meta.get("loader_names")}
        if self.meta.get("layout") is not None:  # the layout in use (re-partitioned since the start or not)
            options.update(layout=self.meta["layout"], layout_version=self.meta.get("layout_version", 0))
        # The log stays until the successor's full state replaces it: should the successor die first, it
        # is still the state to take over from (the successor re-plans the very same steps).
        self.active = dataclasses.replace(self.recipe, options=options).start()
        event = {"role": "planner", "how": "standby", "step": max(package["states"]), "from_step": package["low"],
                 "at": at, "logged_steps": len(package["states"]), "started_s": time.time() - at}
        self.takeovers.append({**event, "dead": dead})
        return {"planner": self.active, "event": event}

    def _event_of(self, dead) -> dict:
        """The takeover that replaced `dead` (for a caller that noticed after it happened)."""
        for event in reversed(self.takeovers):
            if event["dead"] == dead:
                return {k: v for k, v in event.items() if k != "dead"}
        return {"role": "planner", "how": "standby", "step": None}

    def stats(self) -> dict:
        """What every actor of a job answers (`rss` for `plait jobs`), here the standby's figures."""
        return self.standby_stats()

    def standby_stats(self) -> dict:
        return {"messages": dict(self.messages), "steps_followed": self.steps_followed,
                "full_bytes": self.bytes["full"], "diff_bytes": self.bytes["diffs"],
                "diff_bytes_per_step": self.bytes["diffs"] / max(1, self.steps_followed),
                "logged_steps": len(self.states), "low": self.low, "gen": self.gen,
                "takeovers": [{k: v for k, v in e.items() if k != "dead"} for e in self.takeovers],
                "rss": process_rss()}


def _answers(planner) -> bool:
    try:
        get(planner.stats.remote(), timeout=30)
        return True
    except dead_errors():
        return False
    except ray_module().exceptions.GetTimeoutError:
        return True  # busy, not dead


# ----- the active Planner's side ---------------------------------------------------------------------
class StandbyLink:
    """What a PlannerActor does for its standby: start (or find) it, send it each step's state, and, when
    this Planner is a successor, adopt the dead one's log (`Replay`). A link without a standby (`off()`)
    does nothing."""

    def __init__(self, recipe, takeover: dict | None = None, window: int = 64):
        self.recipe = recipe
        self.window = window  # steps of states the standby keeps (the Planner's plan window)
        self.handle = start_standby(recipe) if recipe is not None else None
        self.sent: dict | None = None  # the last state sent (the next diff's base)
        self.sent_gen: int | None = None
        self.sent_meta: dict = {}
        self.sent_low: int | None = None
        self.follows: list = []
        self.replay = Replay(takeover) if takeover else None

    @classmethod
    def off(cls) -> "StandbyLink":
        return cls(None)

    @classmethod
    def for_planner(cls, recipe, window: int) -> "StandbyLink":
        """The link of a Planner started from `recipe`: a standby in a shared job (detached actors) unless
        `planner_standby` is off; a successor's `takeover` option holds the dead Planner's log."""
        options = recipe.options
        if not (options.get("planner_standby", True) and options.get("lifetime") == "detached"):
            return cls.off()
        clean = {k: v for k, v in options.items() if k not in ("takeover", "loader_generations", "loader_names")}
        return cls(dataclasses.replace(recipe, options=clean), options.get("takeover"), window)

    def handles(self) -> list:
        return [self.handle] if self.handle is not None else []

    # ----- adopting a dead Planner's log (a successor) ----------------------------------------------------
    def adopt(self, actor) -> None:
        """Continue the dead Planner's stream: its generation, base state, attached trainers and
        Constructors; the Planner at the oldest step a Constructor still needs."""
        if self.replay is None:
            return
        package = self.replay.package
        meta = package["meta"]
        actor.base_state = package["base"]
        actor.presence.restore(meta)
        actor.planned = int(meta.get("planned", 0))
        actor.planner.load_state_dict(self.replay.states[self.replay.start])
        actor.window.adopt(package["gen"], meta.get("changed_by"))
        actor.built = {s: set(range(actor.planner.ranks)) for s in self.replay.states if s < package["low"]}
        actor.loaders.start_shadows(after_step=max(self.replay.states))  # the loaders' shadows died with it
        actor.metrics.telemetry.observe_recovery("planner")
        took = time.time() - package["at"]
        actor.loaders.events.append({"role": "planner", "how": "standby", "step": max(self.replay.states),
                                     "from_step": package["low"], "at": package["at"], "recovery_s": took})
        log.warning("recovery: a new Planner took over from the standby's log in %.3f s; it re-plans from step %d",
                    took, self.replay.start)

    def align(self, actor) -> None:
        """Before planning a step the dead Planner logged: plan it from the logged state."""
        if self._replaying(actor):
            self.replay.align(actor.planner)

    def rewind(self, actor, step: int, state: dict | None = None) -> bool:
        """Serve an older logged step again (re-planned identically): True when done."""
        return self._replaying(actor) and self.replay.rewind(actor, step, state)

    def _replaying(self, actor) -> bool:
        """The dead Planner's log applies while the stream is its stream (a seek to another state ends it)."""
        if self.replay is not None and actor.gen != self.replay.package["gen"]:
            self.replay = None
        return self.replay is not None

    # ----- following --------------------------------------------------------------------------------------
    def sync(self, actor, wait: bool = False) -> None:
        """Send what changed since the last message: the states before the steps planned since, the
        current state, the oldest step still needed, changed facts. `wait`: until the standby has it (a
        change that planning cannot reproduce: a seek, run-time weights, a report)."""
        if self.handle is None:
            return
        current = actor.planner.state_dict()
        meta = {**actor.presence.facts(), "planned": actor.planned,
                "loader_generations": list(actor.loaders.generation), "loader_names": list(actor.loaders.names),
                "layout": actor.routes.current.layout.to_dict(), "layout_version": actor.routes.version,
                "changed_by": actor.window.changed_by}  # a resume under a changed spec, applied once (adopt)
        if self._check() or self.sent is None or self.sent_gen != actor.gen:
            states = {int(plan.state_before["step"]): plan.state_before for plan in actor.window.steps.values()}
            states[int(current["step"])] = current
            message = {"reset": True, "gen": actor.gen, "base": actor.base_state, "states": states,
                       "window": self.window, "meta": meta}
        else:
            chain = [p.state_before for s, p in actor.window.steps.items() if s > int(self.sent["step"])] + [current]
            diffs = []
            for state in chain:
                if state != self.sent:
                    diffs.append(diff_state(self.sent, state))
                    self.sent = state
            changed = {k: v for k, v in meta.items() if self.sent_meta.get(k) != v}
            if not diffs and not changed and not wait and oldest_needed(actor) == self.sent_low:
                return
            message = {"diffs": diffs, "meta": changed}
        message["low"] = self.sent_low = oldest_needed(actor)
        self.sent, self.sent_gen, self.sent_meta = copy.deepcopy(current), actor.gen, meta
        ref = self.handle.follow.remote(ray_module().get_runtime_context().current_actor, message)
        self.follows.append(ref)
        del self.follows[: max(0, len(self.follows) - FOLLOWS_KEPT)]
        if wait:
            try:
                if get(ref, timeout=60) != "ok":
                    self.sent = None
            except Exception:  # noqa: BLE001 - a dead standby: noticed and replaced at the next sync
                self.sent = None

    def low_moved(self, actor) -> bool:
        """Whether the oldest step a Constructor still needs is no longer the one the standby was told."""
        return self.handle is not None and oldest_needed(actor) != self.sent_low

    def _check(self) -> bool:
        """Look at the finished follow calls (no extra traffic): True when a full resend is due (the
        standby asked for one, or it died and a new one was started)."""
        ray = ray_module()
        if not self.follows:
            return False
        done, self.follows = ray.wait(self.follows, num_returns=len(self.follows), timeout=0)
        for ref in done:
            try:
                if ray.get(ref) != "ok":
                    return True
            except dead_errors():
                self._restart()
                return True
        return False

    def _restart(self) -> None:
        """The standby died: start another (it receives the full state next)."""
        log.warning("failure: the standby Planner of job %r is dead; a new one starts", self.recipe.job)
        self.follows = []
        wait_name_free(standby_name(self.recipe.job))
        self.handle = start_standby(self.recipe)

    def close(self) -> None:
        """End the standby (the job ends: nobody must take over)."""
        if self.handle is not None:
            try:
                ray_module().kill(self.handle)
            except Exception:  # noqa: BLE001 - gone already
                pass
            self.handle = None


class StandbySync:
    """The standby as a Planner observer (plait.runtime.ray.planner_requests): after planning, the states
    planned are sent; after a request that changed the data state in a way planning cannot reproduce, the
    standby has it before the request returns; after a change of the job's trainers or Constructors, or a
    build that moved the oldest step still needed, the news goes out without waiting."""

    def __init__(self, link: StandbyLink, actor):
        self.link = link
        self.actor = actor

    def on_planned(self, plans) -> None:
        self.link.sync(self.actor)

    def on_request(self, request) -> None:
        if request.state:
            self.link.sync(self.actor, wait=True)
        elif request.facts or (request.built and self.link.low_moved(self.actor)):
            self.link.sync(self.actor)


def start_standby(recipe):
    """Start (or find by name) the job's standby; detached like the job's other actors."""
    ray = ray_module()
    opts = actor_options(standby_name(recipe.job), "detached", num_cpus=0)
    return ray.remote(StandbyPlannerActor).options(**opts).remote(recipe)


def oldest_needed(actor) -> int:
    """The oldest step a Constructor may still ask for: the first planned step not built for every rank."""
    ranks = actor.planner.ranks
    unbuilt = [s for s in actor.window.steps if len(actor.built.get(s, ())) < ranks]
    return min(unbuilt, default=int(actor.planner.step))


class Replay:
    """A successor's copy of the dead Planner's log: which step to start from, and the logged states it
    plans from (so a step is planned from exactly the state the dead Planner planned it from)."""

    def __init__(self, package: dict):
        self.package = package
        self.states = {int(s): st for s, st in package["states"].items()}
        low = int(package["low"])
        below = [s for s in self.states if s <= low]
        self.start = max(below) if below else min(self.states)

    def align(self, planner) -> None:
        logged = self.states.get(int(planner.step))
        if logged is not None and planner.state_dict() != logged:
            planner.load_state_dict(logged)

    def rewind(self, actor, step: int, state: dict | None) -> bool:
        logged = self.states.get(int(step))
        if logged is None or (state is not None and state != logged):
            return False
        actor.planner.load_state_dict(logged)
        actor.window.forget_from(step)
        return True
