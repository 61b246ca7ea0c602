"""The Constructor actor: builds (step, dp_rank) once for every TP/PP/CP rank of the replica.

One per node (serving the DP replicas of that node; default) or one per DP replica
(`constructors="replica"`). For (step, dp_rank) it fetches the rank's plan from the Planner, pulls the
payloads straight from the owning loaders (`RayPayloads`: Ray's object store, never through the Planner),
packs the micro-batches (plait.roles.constructor.Constructor) and keeps `prefetch` steps built ahead. A
CP rank is served its shard of the shared build: the cut happens here, so only the shard travels.

`ConstructorPool` is a driver process's set of handles to its Constructors (found or started by name).
"""

from __future__ import annotations

import os
from typing import Callable

from plait.batch import MicroBatch
from plait.job.consumers import Ask
from plait.job.cp_builds import GroupBuilds, served_rank
from plait.job.rank_builds import RankBuilds
from plait.plan import RankPlan
from plait.roles.constructor import Constructor
from plait.runtime.ray import standby_planner
from plait.runtime.ray.payloads import RayPayloads
from plait.runtime.ray.pixel_rows import resolve_built
from plait.runtime.ray.planner_requests import WINDOW_GROUP
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


MAX_BUILD_THREADS = 16
GROUPS_KEPT = 4  # steps behind a build whose dynamic-CP groups a Constructor still keeps for their members


def build_threads(ranks: int) -> int:
    """Build threads of a Constructor serving `ranks` DP ranks: one per rank (at least 2: a rank's next step
    builds beside its current one; at most MAX_BUILD_THREADS). A build mostly waits for its loaders'
    gathers (remote calls, no GIL held), so with fewer threads than ranks a node's 8 ranks would keep only
    a few gathers in flight and leave most loaders idle: the pipeline is then bound by latency, not CPU."""
    return max(2, min(int(ranks), MAX_BUILD_THREADS))


class PlannerPlans:
    """The job's Planner as a Constructor's plan half (job.plan_stream.PlanSource). `ask(method, *args)`
    reaches it and waits for the answer, `tell` does not wait: over Ray, or by a plain call where the
    Planner's own process builds (plait.runtime.ray.planner_host). The routing a build order brings is kept
    in `route`; the window's edge last heard spares a request the Planner's answer it already has."""

    def __init__(self, ask: Callable, tell: Callable, route: Route):
        self.ask, self.tell, self.route = ask, tell, route
        self.edge: tuple[int, int] = (-1, 0)  # (generation, a step below which every step is admitted)

    def order(self, gen: int, step: int, rank: int, with_state: bool) -> tuple[RankPlan, dict | None]:
        plan, state, routing = self.ask("build_order", gen, step, rank, self.route.version, with_state)
        self.route.update(routing)
        return plan, state

    def admit(self, gen: int, step: int, ask: Ask | None) -> int | None:
        if self.edge[0] == gen and step < self.edge[1]:
            return self.edge[1]
        edge = self.ask("admit", gen, step, ask)
        self.edge = (gen, step + 1 if edge is None else edge)  # None: no rank built yet, ask again next step
        return edge

    def built(self, gen: int, step: int, rank: int) -> None:
        self.tell("mark_built", gen, step, rank)

    def state_at(self, gen: int, step: int) -> dict:
        return self.ask("state_at", gen, step)


class ConstructorActor:
    """Builds (step, dp_rank) once for all ranks of the replica, `prefetch` steps ahead, on `threads`
    build threads (build_threads of the ranks it serves): the build half of the job's service
    (job.rank_builds.RankBuilds) over the Planner's plan stream. `host`: the Planner actor object itself
    when it is this process's (planner_host), with its `info` and `routing` answered already."""

    def __init__(self, job: str, prefetch: int, threads: int = 2, host=None):
        use_numpy_kernels()
        self.job = job
        if host is None:
            self.planner = ray_module().get_actor(planner_name(job), namespace=NAMESPACE)
            info, routing = get(self.planner.info.remote()), get(self.planner.routing.remote())
            ask, tell = self._ask_planner, self._tell_planner
        else:  # calls to the Planner are plain calls; a replaced loader is asked of it over Ray, after its start
            self.planner = ray_module().get_runtime_context().current_actor
            info, routing = host.info(), host.routing()
            ask = tell = lambda method, *args: getattr(host, method)(*args)
        self.route = Route(routing)
        self.payloads = RayPayloads(self.route, planner=self.planner, pixels_apart=info.get("pixels_apart"))
        self.constructor = Constructor(self.payloads)
        # dynamic CP: a group's micro-batch is built once here for the members this Constructor serves (the
        # members served by another Constructor build it there: once per Constructor holding a member)
        self.groups = GroupBuilds()
        self.counts = Telemetry(info["sources"])  # what it built, summed by the job's /metrics (never served)
        self.prefetch = max(0, int(prefetch))
        self.builds = RankBuilds(PlannerPlans(ask, tell, self.route), self._build, builds=info["builds"],
                                 dynamic=bool(info.get("dynamic_cp")), ahead=self.prefetch, threads=max(1, threads))

    def _ask_planner(self, method: str, *args):
        """A call to the job's Planner; when it died, to its successor (the job's standby makes it once,
        whoever asks first). `admit` may wait in the window: on the Planner's threads for it."""
        while True:
            planner = self.planner
            call = getattr(planner, method)
            if method == "admit":
                call = call.options(concurrency_group=WINDOW_GROUP)
            try:
                return get(call.remote(*args))
            except dead_errors():
                successor = standby_planner.successor(self.job, planner)
                if successor is None:
                    raise
                self.planner = self.payloads.planner = successor[0]

    def _tell_planner(self, method: str, *args) -> None:
        getattr(self.planner, method).remote(*args)

    def _build(self, plan: RankPlan, key: tuple[int, int, int]) -> list[MicroBatch]:
        gen, step, _ = key
        with Stopwatch() as t:
            if plan.cp is None:
                batches = self.constructor.build(plan)
            else:  # groups more than a few steps behind this build belong to members served elsewhere
                self.groups.drop(lambda scope: scope[0] == gen and scope[1] >= step - self.prefetch - GROUPS_KEPT)
                batches = self.groups.rank_batches((gen, step), plan, lambda waves: self.constructor.build(plan, only=waves))
        self.counts.observe_build(batches, t.seconds)
        return batches

    def get(self, gen: int, step: int, dp_rank: int, limit: int | None = None, cp: tuple[int, int] = (1, 0),
            with_state: bool = True, client: str | None = None) -> tuple[dict | None, list[MicroBatch]]:
        """(state at the start of `step`, the rank's micro-batches of `step`), each cut to CP rank cp[1]
        of cp[0] (the build is shared by the replica's ranks; only the shard travels to the trainer).
        Without `with_state` the state is None and the Planner sends none for the build (a thin client
        fetches it only for a checkpoint). Waits while `step` is beyond the Planner's window (RankBuilds.get)."""
        return self.builds.get(gen, step, dp_rank, limit, cp, with_state, client)

    def get_assembled(self, *args, **kwargs) -> tuple[dict | None, list[MicroBatch]]:
        """`get` with the pixels assembled here, for a thin client (no Ray process: it cannot fetch the
        pixel objects the batches reference; plait.runtime.ray.pixel_rows)."""
        return resolve_built(self.get(*args, **kwargs))

    def forget_build(self, gen: int, step: int, dp_rank: int, cp: tuple[int, int] = (1, 0)) -> None:
        """Drop the build serving (step, dp_rank): a trainer found its pixel objects lost (their node
        died after the build); asked again, it is built again from the loaders that replaced them."""
        rank, _ = served_rank(self.builds.dynamic, dp_rank, cp)
        with self.builds.lock:
            self.builds.cache.forget((gen, step, rank))

    def stats(self) -> dict:
        return {**self.builds.stats(), "cached": len(self.builds.cache.builds), "pid": os.getpid(),
                "rss": process_rss(), "routing_version": self.route.version, "group_builds": self.groups.builds}

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
            server = self.flight_server = ConstructorFlight(self.get_assembled, host, token)
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

    def builders(self, planner) -> dict[str, object]:
        """The actors that build: these Constructors by key, or {"planner": `planner`} where it builds."""
        return {"planner": planner} if self.mode == "planner" else dict(self.handles)

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
