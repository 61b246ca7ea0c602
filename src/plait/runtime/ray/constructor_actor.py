"""The Constructor actor: builds (step, dp_rank) once for every TP/PP/CP rank of the replica.

One per node (serving the DP replicas of that node; default) or one per DP replica
(`constructors="replica"`). For (step, dp_rank) it fetches the rank's plan from the Planner, pulls the
payloads straight from the owning loaders (`RayPayloads`: Ray's object store, never through the Planner),
packs the micro-batches (plait.roles.constructor.Constructor) and keeps `prefetch` steps built ahead. A
CP rank is served its shard of the shared build: the cut happens here, so only the shard travels.

`ConstructorPool` is a driver process's set of handles to its Constructors (found or started by name).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from plait.batch import MicroBatch
from plait.job.builds import BuildCache
from plait.job.cp_builds import GroupBuilds, served_rank
from plait.job.window import POLL_S, REPORT_S
from plait.roles.constructor import Constructor
from plait.runtime.ray import standby_planner
from plait.runtime.ray.payloads import RayPayloads
from plait.runtime.ray.routing import Route
from plait.runtime.ray.common import (
    NAMESPACE,
    actor_options,
    constructor_name,
    dead_errors,
    get,
    planner_name,
    process_rss,
    ray_module,
    use_numpy_kernels,
)
from plait.telemetry import Stopwatch, Telemetry


log = logging.getLogger("plait.serving")


MAX_BUILD_THREADS = 16
GROUPS_KEPT = 4  # steps behind a build whose dynamic-CP groups a Constructor still keeps for their members


def build_threads(ranks: int) -> int:
    """Build threads of a Constructor serving `ranks` DP ranks: one per rank (at least 2: a rank's next step
    builds beside its current one; at most MAX_BUILD_THREADS). A build mostly waits for its loaders'
    gathers (remote calls, no GIL held), so with fewer threads than ranks a node's 8 ranks would keep only
    a few gathers in flight and leave most loaders idle: the pipeline is then bound by latency, not CPU."""
    return max(2, min(int(ranks), MAX_BUILD_THREADS))


class ConstructorActor:
    """Builds (step, dp_rank) once for all ranks of the replica, `prefetch` steps ahead, on `threads`
    build threads (build_threads of the ranks it serves)."""

    def __init__(self, job: str, prefetch: int, threads: int = 2, planner=None):
        use_numpy_kernels()
        ray = ray_module()
        self.job = job
        # `planner`: the Planner's own process hosts this Constructor (plait.runtime.ray.planner_host)
        self.planner = planner if planner is not None else ray.get_actor(planner_name(job), namespace=NAMESPACE)
        info = get(self.planner.info.remote())
        self.route = Route(get(self.planner.routing.remote()))
        self.payloads = RayPayloads(self.route, planner=self.planner)
        self.constructor = Constructor(self.payloads)
        # dynamic CP: a group's micro-batch is built once here for the members this Constructor serves (the
        # members served by another Constructor build it there: once per Constructor holding a member)
        self.dynamic = bool(info.get("dynamic_cp"))
        self.groups = GroupBuilds()
        self.counts = Telemetry(info["sources"])  # what it built, summed by the job's /metrics (never served)
        self.prefetch = max(0, int(prefetch))
        self.cache = BuildCache(self._build, prefetch, threads=max(1, threads))
        self.lock = threading.Lock()
        self.waits = 0  # requests that found their build not finished yet
        self.requests = 0
        self.consumed: dict[int, int] = {}  # DP rank -> steps its trainer asked for (last step + 1)
        self.wait_seconds: dict[int, float] = {}  # DP rank -> seconds its requests waited for a build
        self.edge: tuple[int, int] = (-1, 0)  # (generation, first step not known to be within the plan window)
        self.window_waits = 0  # requests that waited for a slower rank (the Planner's window was full)
        self.lagging = ""  # the rank the last wait was for

    def _ask_planner(self, method: str, *args):
        """A call to the job's Planner; when it died, to its successor (the job's standby makes it once,
        whoever asks first)."""
        while True:
            planner = self.planner
            try:
                return get(getattr(planner, method).remote(*args))
            except dead_errors():
                successor = standby_planner.successor(self.job, planner)
                if successor is None:
                    raise
                self.planner = self.payloads.planner = successor[0]

    def _build(self, gen: int, step: int, dp_rank: int, with_state: bool) -> tuple[dict | None, list[MicroBatch]]:
        plan, state, routing = self._ask_planner("build_order", gen, step, dp_rank, self.route.version, with_state)
        self.route.update(routing)
        with Stopwatch() as t:
            if plan.cp is None:
                batches = self.constructor.build(plan)
            else:  # groups more than a few steps behind this build belong to members served elsewhere
                self.groups.drop(lambda scope: scope[0] == gen and scope[1] >= step - self.prefetch - GROUPS_KEPT)
                batches = self.groups.rank_batches((gen, step), plan, lambda waves: self.constructor.build(plan, only=waves))
        self.counts.observe_build(batches, t.seconds)
        self.planner.mark_built.remote(gen, step, dp_rank)
        return state, batches

    def _within(self, gen: int, step: int, ask: bool = True) -> bool:
        """Whether `step` is within the Planner's window (`horizon`); asks the Planner when `ask` and the
        edge known here is not past it."""
        if self.edge[0] == gen and step < self.edge[1]:
            return True
        if not ask:
            return False
        edge, self.lagging = self._ask_planner("horizon", gen)
        if edge is None:  # no rank has built in this generation yet: this one and its build-ahead may go
            edge = step + self.prefetch + 1
        self.edge = (gen, edge)
        return step < edge

    def _pace(self, gen: int, step: int, dp_rank: int) -> None:
        """Backpressure: wait while `step` is more than the Planner's window ahead of the slowest reading
        rank (instead of that rank's steps leaving the window); a long wait is logged, naming that rank."""
        if self._within(gen, step):
            return
        self.window_waits += 1
        t0, reported = time.monotonic(), False
        while not self._within(gen, step):
            time.sleep(POLL_S)
            if not reported and time.monotonic() - t0 >= REPORT_S:
                reported = True
                log.warning("plait: DP rank %d's step %d waits for %s (the Planner keeps a window of planned "
                            "steps) for %.0f s", dp_rank, step, self.lagging, time.monotonic() - t0)

    def get(self, gen: int, step: int, dp_rank: int, limit: int | None = None,
            cp: tuple[int, int] = (1, 0), with_state: bool = True,
            client: str | None = None) -> tuple[dict | None, list[MicroBatch]]:
        """(state at the start of `step`, the rank's micro-batches of `step`), each cut to CP rank cp[1]
        of cp[0] (the build is shared by the replica's ranks; only the shard travels to the trainer).
        Without `with_state` the state is None and the Planner sends none for the build: a thin client
        fetches it only for a checkpoint (the Planner -> Constructors traffic per step is then the rank's
        plan alone). Waits while `step` is beyond the Planner's window (`_pace`). `client` (the reader's
        name) is not used here: the Planner follows the ranks by their builds."""
        dp_rank, cp = served_rank(self.dynamic, dp_rank, cp)  # dynamic CP: the pool rank's build, cut already
        self._pace(gen, step, dp_rank)
        with self.lock:
            # The build-ahead stops at the window's edge; the last few builds stay for the replica's other ranks.
            fut = self.cache.request((gen, step, dp_rank), lambda s: (limit is None or s < limit) and
                                     self._within(gen, s, ask=False), with_state)
            self.requests += 1
            self.consumed[dp_rank] = max(self.consumed.get(dp_rank, 0), step + 1)
            waited = not fut.done()
            if waited:
                self.waits += 1
        t0 = time.perf_counter()
        try:
            state, batches = fut.result()
        except BaseException:
            with self.lock:
                self.cache.forget((gen, step, dp_rank))
            raise
        finally:
            if waited:
                with self.lock:
                    self.wait_seconds[dp_rank] = self.wait_seconds.get(dp_rank, 0.0) + time.perf_counter() - t0
        if with_state and state is None:  # built for a client that did not ask for it
            state = get(self.planner.state_at.remote(gen, step))
        return BuildCache.served((state, batches), cp, with_state)

    def stats(self) -> dict:
        return {"requests": self.requests, "waits": self.waits, "pid": os.getpid(), "cached": len(self.cache.builds),
                "rss": process_rss(), "consumed": dict(self.consumed), "wait_s": dict(self.wait_seconds),
                "window_waits": self.window_waits,
                "routing_version": self.route.version, "build_threads": len(self.cache.workers.threads),
                "group_builds": self.groups.builds}

    def telemetry(self) -> dict:
        """Per-source tokens, samples and images built so far, and build times (Telemetry.delivery_counts)."""
        return self.counts.delivery_counts()

    def serve_flight(self, host: str, token: str) -> str:
        """Serve this Constructor's builds to thin trainer clients over Arrow Flight (a server in this
        process, bound to `host` on a free port, refusing calls without the job's `token`; started once):
        its location. See plait.runtime.ray.flight_server."""
        from plait.runtime.ray.flight_server import ConstructorFlight

        server = getattr(self, "flight_server", None)
        if server is None:
            server = self.flight_server = ConstructorFlight(self.get, host, token)
        return server.location


class ConstructorPool:
    """A driver process's Constructor actors, by key: `node-<node id>` (one per node, serving the DP
    replicas whose ranks run there) or `replica-<dp rank>`. A Constructor is found by name when another
    process of the job started it already, else started on the rank's node: this process's, unless
    `place` put the rank on another (a thin trainer's node: plait.runtime.ray.serving)."""

    def __init__(self, job: str, mode: str, prefetch: int, dp: int, lifetime: str | None = None):
        self.job = job
        self.mode = mode  # "node", "replica", or "planner" (the Planner's process builds: planner_host)
        self.prefetch = prefetch
        self.dp = dp
        self.lifetime = lifetime
        self.handles: dict[str, object] = {}
        self.rank_nodes: dict[int, str] = {}  # DP rank -> Ray node id, where not this process's node

    def node_of(self, dp_rank: int) -> str:
        """The Ray node whose Constructor serves `dp_rank`."""
        return self.rank_nodes.get(dp_rank) or ray_module().get_runtime_context().get_node_id()

    def place(self, dp_rank: int, node_id: str) -> None:
        """Serve `dp_rank` from a Constructor on node `node_id` from now on (started by `for_rank`)."""
        self.rank_nodes[dp_rank] = node_id

    def key(self, dp_rank: int) -> str:
        """The Constructor serving `dp_rank` from this process."""
        if self.mode == "replica":
            return f"replica-{dp_rank}"
        return f"node-{self.node_of(dp_rank)[:16]}"

    def name(self, key: str) -> str:
        return constructor_name(self.job, key)

    def for_rank(self, dp_rank: int, planner):
        """The handle serving `dp_rank`, started (and registered with `planner`) when this process has none."""
        if self.mode == "planner":
            return planner
        key = self.key(dp_rank)
        handle = self.handles.get(key)
        if handle is None:
            ray = ray_module()
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            # Hard affinity: a Constructor serves the trainers of its node (num_cpus=0: always feasible there).
            # A soft one fell back to the driver's node when the other node had just joined (seen in tests),
            # leaving that node's trainers to fetch every batch across the network.
            here = NodeAffinitySchedulingStrategy(self.node_of(dp_rank), soft=False)
            opts = actor_options(self.name(key), self.lifetime, num_cpus=0, max_concurrency=64,
                                 scheduling_strategy=here)
            ranks = 1 if self.mode == "replica" else self.dp  # a node's Constructor may serve every rank
            handle = ray.remote(ConstructorActor).options(**opts).remote(self.job, self.prefetch, build_threads(ranks))
            planner.register_constructor.remote(self.name(key))
            self.handles[key] = handle
        return handle

    def restart_missing(self, planner) -> list[int]:
        """Start Constructors for the DP ranks whose Constructor was dropped; returns those ranks."""
        missing = [r for r in range(self.dp) if self.key(r) not in self.handles]
        for r in missing:
            self.for_rank(r, planner)
        return missing

    def items(self) -> list[tuple[str, object]]:
        return list(self.handles.items())

    def names(self) -> list[str]:
        return [self.name(k) for k in self.handles]

    def drop(self, key: str) -> None:
        del self.handles[key]

    def kill_all(self) -> None:
        """End every Constructor of this process (they may be gone already) and forget them."""
        ray = ray_module()
        for handle in self.handles.values():
            try:
                ray.kill(handle)
            except Exception:  # noqa: BLE001 - may be gone already
                pass
        self.handles.clear()
