"""What happens when an actor of the ray runtime dies. Every failure is survived without losing or
repeating a sample, because everything an actor serves is a pure function of the data state:

  * a SourceLoader dies (found by whoever calls it: the Planner asking `block_meta`, a Constructor's
    `gather`, a report) -> `LoaderFleet.replace_if_current`: one of its shadows is promoted (it already
    holds what the primary buffered at its last delta), else a fresh loader restarts cold under the next
    generation's name; either answers the same keys with the same bytes. A new shadow starts a few steps
    later (`respawn_delay`), from a snapshot.
  * a shadow dies -> `LoaderFleet.after_planning` finds it from its failed follow calls and starts a
    replacement `respawn_delay` steps later.
  * a Constructor dies (found by the driver waiting for a build) -> `replace_dead_constructors`: a new one
    rebuilds the step (the Planner keeps a window of plans; loaders re-read what was released).
  * the Planner dies (found by the driver; its loaders and shadows die with it unless detached) -> in a
    shared job, its standby makes the successor (plait.runtime.ray.standby_planner: one for every process
    of the job, the same stream); without a standby, `recreate_planner`: a new Planner from the last data
    state this process saw, which plans the same steps again, exactly, and starts loaders that re-read
    what is needed.

`wait_name_free` is the one wait for a dead actor's name (released asynchronously by Ray). Every
recovery is logged on the `plait.recovery` logger ("failure: ..." then "recovery: ...") and recorded as
an event dict (`role`, `step`, `at`, `recovery_s`, ...), listed by `RayRuntime.recovery_events()`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from plait.errors import PlaitError
from plait.runtime.ray.common import NAMESPACE, dead_errors, get, ray_module
from plait.runtime.placement import LoaderLayout, unchanged_loaders
from plait.runtime.ray.loader_actor import LoaderConfig
from plait.runtime.ray.shadow_actor import start_shadow
from plait.spec import Spec

log = logging.getLogger("plait.recovery")
FOLLOWS_KEPT = 16  # follow calls remembered per shadow (to find a dead shadow without extra traffic)


def wait_name_free(name: str, timeout: float = 10.0) -> None:
    """A dead actor's name is released asynchronously; reusing it too early would find the corpse."""
    ray = ray_module()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.05)


# ----- Planner side: the loaders and their shadows ---------------------------------------------------
class LoaderFleet:
    """The Planner's SourceLoader actors and their shadows, and their replacement when one dies.

    `handles` is the list of current loader handles (index = loader k); it is replaced in place, so
    whoever holds the list (the Planner's metadata provider) sees the new owner. `now()` is the
    Planner's current step (for logs and for scheduling new shadows); `on_replaced()` runs after a loader
    was replaced (the Planner then tells the new owner which blocks are still live).

    `previous`: the fleet of the layout this one replaces (a rescale). A loader whose partitions are the
    same in both layouts is handed over, running, with its buffer and its shadows (`adopted`: new index ->
    old index); only loaders whose partitions change start. An actor several fleets share ends with the
    last of them (`owners`: loader name -> fleets holding it).
    """

    def __init__(self, config: LoaderConfig, spec: Spec, options: dict, now: Callable[[], int],
                 on_replaced: Callable[[], None], previous: LoaderFleet | None = None):
        self.config = config
        self.spec = spec
        self.now = now
        self.on_replaced = on_replaced
        n = config.layout.loaders
        # A successor Planner (plait.runtime.ray.standby_planner) finds its predecessor's loaders by name:
        # `loader_names` holds them (a loader handed over keeps the name of the layout that started it).
        self.generation = list(options.get("loader_generations") or [0] * n)
        found = list(options.get("loader_names") or [None] * n)
        self.owners: dict[str, int] = previous.owners if previous is not None else {}
        self.adopted = unchanged_loaders(previous.config.layout, config.layout) if previous is not None else {}
        self.handles, self.names = [], []
        self.shadows: list[list] = [[] for _ in range(n)]
        for k in range(n):
            if k in self.adopted:
                j = self.adopted[k]
                self.handles.append(previous.handles[j])
                self.names.append(previous.names[j])
                self.shadows[k] = list(previous.shadows[j])
            else:
                name = found[k] or config.name(k, self.generation[k])
                self.handles.append(config.start(k, self.generation[k], name))
                self.names.append(name)
            self.owners[self.names[k]] = self.owners.get(self.names[k], 0) + 1
        self.events: list[dict] = []
        self.on_event: Callable[[dict], None] | None = None  # told of each event (the job's metrics)
        self.checkpoint_interval = max(1, int(options.get("checkpoint_interval") or 1))
        self.respawn_delay = int(options.get("respawn_delay", 4))
        self.final_errors: list[dict] = []  # the loaders' error reports when the fleet was retired
        self._last_delta_step = -1
        self._respawn: list[tuple[int, int]] = []  # (loader index, step at which a new shadow starts)
        self._follows: dict[int, list] = {}  # loader index -> [(shadow, ref of one of its follow calls)]
        # Closed or retired: a loader found dead then is not replaced (the replacement would outlive the job).
        # `lock` orders the two: a replacement under way when the fleet ends is finished, then ended too.
        self.ended = False
        self.lock = threading.RLock()

    def start_shadows(self, after_step: int | None = None) -> None:
        """Each loader's standbys: as many as the most demanding of its sources asks for (`shadows`).
        `after_step`: the loaders run already (a successor Planner's): the shadows start `respawn_delay`
        steps after that step, from a snapshot, like replacements (not while the job recovers)."""
        if after_step is not None:
            self._respawn += [(k, after_step + self.respawn_delay) for k in range(len(self.handles))
                              for _ in range(self.shadow_count(k))]
            return
        self.shadows = [self.shadows[k] if k in self.adopted else
                        [start_shadow(self.config, k, self.names[k]) for _ in range(self.shadow_count(k))]
                        for k in range(len(self.handles))]

    def shadow_count(self, k: int) -> int:
        return max((self.spec.sources[s].shadows for s, _ in self.config.layout.owned[k]), default=0)

    def each(self, method: str, *args) -> list:
        """`method(*args)` of every loader, in order; a dead loader is replaced and asked again."""
        out = []
        for k in range(len(self.handles)):
            while True:
                handle = self.handles[k]
                try:
                    out.append(get(getattr(handle, method).remote(*args)))
                    break
                except dead_errors():
                    self.replace_if_current(k, handle)
        return out

    def replace_if_current(self, k: int, dead) -> None:
        """Loader k's handle `dead` failed: replace it, unless someone already did (handles compare equal
        exactly when they name the same actor)."""
        with self.lock:
            if self.ended:
                raise PlaitError(f"SourceLoader {self.names[k]} is gone: its layout was retired or the job ended")
            if self.handles[k] == dead:
                self._replace(k)

    def _replace(self, k: int) -> None:
        """Promote a shadow of loader k (or start a fresh loader) and give it loader k's partitions."""
        t0 = time.perf_counter()
        dead, step = self.names[k], self.now()
        sources = sorted({self.spec.sources[s].name for s, _ in self.config.layout.owned[k]})
        log.warning("failure: SourceLoader %s (sources %s) is dead; detected at step %d", dead, ",".join(sources), step)
        self.generation[k] += 1
        new, info = None, {}
        while self.shadows[k] and new is None:
            sh = self.shadows[k].pop(0)
            try:
                info = get(sh.promote.remote())
                new = sh
            except dead_errors():
                continue
        if new is not None:
            how = f"shadow promoted, re-read {info['reread_blocks']} of {info['held_blocks']} buffered blocks"
        else:
            new = self.config.start(k, self.generation[k])
            how = "restarted cold (no shadow left): blocks are re-read on demand"
        self.handles[k] = new  # in place: the metadata provider shares this list
        self.names[k] = self.config.name(k, self.generation[k])
        self.owners[self.names[k]] = self.owners.get(self.names[k], 0) + 1
        self.on_replaced()
        if self.shadow_count(k):
            # Keep the standby count, but not now: starting a worker process costs a second of CPU
            # that the failure step should not pay. It starts a few steps later, from a snapshot.
            self._respawn.append((k, step + self.respawn_delay))
        took = time.perf_counter() - t0
        log.warning("recovery: SourceLoader %s replaced by %s (%s) in %.3f s", dead, self.names[k], how, took)
        self.record({"role": "loader", "actor": dead, "replacement": self.names[k], "step": step,
                      "at": time.time(), "recovery_s": took, "how": how, "reread_blocks": info.get("reread_blocks")})

    def after_planning(self, step: int) -> None:
        """Right after the Planner planned up to `step`: notice dead shadows, start the shadows that are
        due, and every `checkpoint_interval` steps send each loader's delta to its shadows (object store,
        loader to shadow; only the reference passes here), so the shadows decode the blocks the new steps
        need while the Constructors fetch them."""
        if self.ended:  # a shadow started now would outlive the fleet
            return
        self._check_shadows()
        due = [(k, at) for k, at in self._respawn if step >= at]
        self._respawn = [r for r in self._respawn if r not in due]
        for k, _ in due:
            sh = start_shadow(self.config, k, self.names[k])
            sh.sync.remote(self.handles[k].checkpoint_snapshot.remote(step))
            self.shadows[k].append(sh)
            log.info("standby: a new shadow of %s starts at step %d", self.names[k], step)
            self.record({"role": "shadow-start", "actor": self.names[k], "step": step, "at": time.time()})
        if step - self._last_delta_step < self.checkpoint_interval:
            return
        self._last_delta_step = step
        for k, ld in enumerate(self.handles):
            if self.shadows[k]:
                ref = ld.checkpoint_delta.remote(step)
                follows = self._follows.setdefault(k, [])
                for sh in self.shadows[k]:
                    follows.append((sh, sh.follow.remote(ref)))
                del follows[: max(0, len(follows) - FOLLOWS_KEPT * len(self.shadows[k]))]

    def _check_shadows(self) -> None:
        """Find dead shadows from their finished follow calls (no extra traffic), replace them later."""
        ray = ray_module()
        step = self.now()
        for k, follows in self._follows.items():
            done = [(sh, ref) for sh, ref in follows if ray.wait([ref], timeout=0)[0]]
            for pair in done:
                follows.remove(pair)
            failed = []
            for sh, ref in done:
                try:
                    ray.get(ref)
                except Exception:  # noqa: BLE001 - a dead shadow, or a delta from a dead primary
                    failed.append(sh)
            for sh in dict.fromkeys(failed):  # once per shadow, in order
                if sh not in self.shadows[k]:
                    continue
                try:
                    get(sh.shadow_stats.remote(), timeout=30)
                    continue  # alive: the delta's primary died (handled where it is detected)
                except dead_errors():
                    pass
                self.shadows[k] = [x for x in self.shadows[k] if x != sh]
                log.warning("failure: a shadow of SourceLoader %s is dead; detected at step %d; a new one starts "
                            "in %d steps", self.names[k], step, self.respawn_delay)
                self.record({"role": "shadow", "actor": self.names[k], "step": step, "at": time.time(),
                              "recovery_s": 0.0})
                self._respawn.append((k, step + self.respawn_delay))

    def record(self, event: dict) -> None:
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    def shadow_stats(self) -> list[list[dict]]:
        return [get([sh.shadow_stats.remote() for sh in group]) for group in self.shadows]

    def end(self) -> None:
        """No loader is replaced from now on (after a replacement under way, if any)."""
        with self.lock:
            self.ended = True

    def close(self) -> None:
        """Close every loader (best effort), then end every loader and shadow actor."""
        ray = ray_module()
        self.end()
        try:
            get([ld.close.remote() for ld in self.handles], timeout=30)
        except Exception:  # noqa: BLE001 - closing is best effort
            pass
        for ld in self.handles + [sh for group in self.shadows for sh in group]:
            ray.kill(ld)

    def retire(self) -> None:
        """End every loader and shadow of a layout that was replaced (plait.runtime.ray.routing), without
        `close`: a gather still queued there must fail as "actor dead" (and be repeated on the new owner),
        not run on closed readers."""
        ray = ray_module()
        self.end()
        self._respawn = []
        # A loader handed over to a newer layout's fleet (or adopted from an older one still retiring) keeps
        # running: only those no other fleet holds end here.
        ending = []
        for k, name in enumerate(self.names):
            self.owners[name] = self.owners.get(name, 1) - 1
            if self.owners[name] <= 0:
                self.owners.pop(name)
                ending.append(k)
        # What they skipped stays in the job's error report (plait.runtime.ray.planner_actor.error_report)
        refs = [self.handles[k].error_report.remote() for k in ending]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=5.0) if refs else ([], [])
        for ref in ready:
            try:
                self.final_errors.append(ray.get(ref))
            except Exception:  # noqa: BLE001 - a dead loader: its replacement's report is lost with it
                pass
        for ld in [self.handles[k] for k in ending] + [sh for k in ending for sh in self.shadows[k]]:
            try:
                ray.kill(ld)
            except Exception:  # noqa: BLE001 - already gone
                pass


def end_unused_loaders(fleet: LoaderFleet) -> list[str]:
    """End every named loader actor of the job that `fleet` does not hold. A new Planner of a shared job (a
    successor, or one recreated without a standby) starts from the loader names it was told; a replacement
    the dead Planner started after its standby last heard, or the loaders of a layout it was retiring, would
    otherwise run on, decoding for nobody (detached: they outlive their Planner). Returns the names ended."""
    ray = ray_module()
    prefix = f"{fleet.config.job}/loader-"
    ended = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry.get("namespace") != NAMESPACE or not name.startswith(prefix) or name in fleet.names:
            continue
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except ValueError:  # gone meanwhile
            continue
        ended.append(name)
    if ended:
        log.warning("recovery: ended %d loader actor(s) of job %r that its new Planner does not use: %s",
                    len(ended), fleet.config.job, ", ".join(sorted(ended)))
        fleet.record({"role": "stray-loaders", "actors": sorted(ended), "step": None, "at": time.time(),
                      "recovery_s": 0.0})
    return ended


class ShadowUpkeep:
    """The loaders' recovery bookkeeping as a Planner observer (plait.runtime.ray.planner_requests): after
    each planning call, the current fleet (`fleet()`: it changes with a rescale) checkpoints its loaders to
    their shadows and starts the shadows that are due (`LoaderFleet.after_planning`)."""

    def __init__(self, fleet: Callable[[], LoaderFleet]):
        self.fleet = fleet

    def on_planned(self, plans) -> None:
        if plans:
            self.fleet().after_planning(int(plans[-1].step) + 1)

    def on_request(self, request) -> None:
        """Requests do not move the loaders' checkpoints."""


# ----- driver side: the Planner and the Constructors -----------------------------------------------
def planner_alive(planner) -> bool:
    try:
        get(planner.stats.remote(), timeout=60)
        return True
    except dead_errors():
        return False


def recreate_planner(recipe, state: dict, constructors, step: int) -> tuple[Any, int, dict]:
    """A new Planner (from `recipe`, a plait.runtime.ray.planner_actor.PlannerRecipe) seeked to the data
    state `state`, after the old one was found dead at `step`. Returns (handle, generation, event).

    The Planner's loaders and shadows die with it (Ray fate-shares actors with their creator; detached
    ones, in a shared job, survive and are found again by name), so the new Planner starts loaders that
    re-read what is needed. The Constructors (a plait.runtime.ray.constructor_actor.ConstructorPool) held
    the dead Planner's handle and are ended too; the caller's next request starts new ones. Planning is a
    pure function of the data state: the new Planner plans the same steps again, exactly."""
    t0 = time.perf_counter()
    log.warning("failure: Planner %s is dead; detected at step %d", recipe.name, step)
    names = [recipe.name] + constructors.names()
    constructors.kill_all()
    if not recipe.shared:
        names += recipe.loader_names()
    for n in names:
        wait_name_free(n)
    planner = recipe.start()
    get(planner.attach.remote(recipe.fingerprint))
    gen = get(planner.seek.remote(state))
    took = time.perf_counter() - t0
    log.warning("recovery: Planner recreated from the data state of step %d (re-plans to step %d; loaders "
                "restarted) in %.3f s", state["step"], step, took)
    return planner, gen, {"role": "planner", "step": step, "from_step": int(state["step"]), "at": time.time(),
                          "recovery_s": took}


def replace_dead_constructors(constructors, planner, step: int, dp_rank: int) -> dict | None:
    """After a build request failed while the Planner lives: end the dead Constructors of
    `constructors` (a ConstructorPool) and start new ones for every DP rank they served; they rebuild
    from `step`. Returns the event, or None when another rank's request already replaced them."""
    t0 = time.perf_counter()
    dead = [key for key, handle in constructors.items() if not _alive(handle)]
    for key in dead:
        log.warning("failure: Constructor %s is dead; detected at step %d (rank %d)",
                    constructors.name(key), step, dp_rank)
        constructors.drop(key)
        wait_name_free(constructors.name(key))
    if not dead:
        return None  # already replaced: just ask again
    ranks = constructors.restart_missing(planner)
    took = time.perf_counter() - t0
    log.warning("recovery: Constructor recreated in %.3f s; it rebuilds from step %d for ranks %s", took, step, ranks)
    return {"role": "constructor", "step": step, "at": time.time(), "recovery_s": took, "ranks": ranks}


def _alive(handle) -> bool:
    try:
        get(handle.stats.remote(), timeout=30)
        return True
    except dead_errors():
        return False
