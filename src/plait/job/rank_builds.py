"""Per-rank builds, the other half of a job's service: each (generation, step, build rank) built once, a few
steps ahead of the rank's requests (job.builds.BuildCache), and served cut to the asking CP rank.

A request asks the plan half (job.plan_stream.PlanSource) once: `admit` holds it while the step is beyond
the window (the one waiting rule is the plan stream's) and names where the build-ahead stops. A build asks
for its `order` and says when it is `built`. In process the plan half is a PlanStream (job.service); in a
Ray Constructor it is the Planner actor (plait.runtime.ray.constructor_actor).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from plait.batch import MicroBatch
from plait.errors import PlaitError
from plait.job.builds import Built, BuildCache, Key
from plait.job.consumers import Ask
from plait.job.cp_builds import served_rank
from plait.job.plan_stream import PlanSource

Build = Callable[[Any, Key], list[MicroBatch]]  # (the order, (gen, step, build rank)) -> the micro-batches


class RankBuilds:
    """Builds of a job's steps from `plans` with `build`: `builds` a step (its DP ranks, or with dynamic
    context parallelism, `dynamic`, its pool of DP x CP ranks: a trainer reads its pool rank's build, cut
    already). `ahead` steps are built ahead of a rank's request on `threads` threads (None:
    job.builds.default_threads)."""

    def __init__(self, plans: PlanSource, build: Build, *, builds: int, dynamic: bool, ahead: int,
                 threads: int | None = None):
        self.plans, self.build = plans, build
        self.builds, self.dynamic = int(builds), bool(dynamic)
        self.cache = BuildCache(self._build, ahead, threads)
        self.lock = threading.Lock()
        self.requests = 0
        self.waits = 0  # requests that found their build not finished yet
        self.consumed: dict[int, int] = {}  # build rank -> steps asked for (last step + 1)
        self.wait_seconds: dict[int, float] = {}  # build rank -> seconds its requests waited for a build

    def _build(self, gen: int, step: int, rank: int, with_state: bool = True) -> Built:
        order, state = self.plans.order(gen, step, rank, with_state)
        batches = self.build(order, (gen, step, rank))
        self.plans.built(gen, step, rank)
        return state, batches

    def get(self, gen: int, step: int, dp_rank: int, limit: int | None = None, cp: tuple[int, int] = (1, 0),
            with_state: bool = True, client: str | None = None) -> Built:
        """(state at the start of `step` or None without `with_state`, the rank's micro-batches of `step` cut
        to CP rank cp[1] of cp[0]); the rank's next steps are queued behind it, up to `limit` and the
        window's edge. `client` names the reader (default: its ranks). Waits while `step` is more than the
        window ahead of the slowest reader (the plan stream's rule)."""
        rank, cut = served_rank(self.dynamic, dp_rank, cp)  # dynamic CP: the pool rank's build, cut already
        if not (0 <= rank < self.builds and dp_rank >= 0):
            whose = f"pool of {self.builds} DP x CP ranks" if self.dynamic else f"{self.builds} DP ranks"
            raise PlaitError(f"dp_rank {dp_rank} is not one of this job's {whose}")
        ask = Ask(client or f"rank-{dp_rank}-cp-{cp[1]}", dp_rank, cp[1], rank, limit)
        edge = self.plans.admit(gen, step, ask)
        with self.lock:
            fut = self.cache.request((gen, step, rank), lambda s: (limit is None or s < int(limit)) and
                                     (edge is None or s < edge), with_state)
            self.requests += 1
            self.consumed[rank] = max(self.consumed.get(rank, 0), step + 1)
            waited = not fut.done()
            self.waits += waited
        t0 = time.perf_counter()
        try:
            state, batches = fut.result()
        except BaseException:
            with self.lock:
                self.cache.forget((gen, step, rank))
            raise
        finally:
            if waited:
                with self.lock:
                    self.wait_seconds[rank] = self.wait_seconds.get(rank, 0.0) + time.perf_counter() - t0
        if with_state and state is None:  # built for a reader that did not ask for the state
            state = self.plans.state_at(gen, step)
        return BuildCache.served((state, batches), cut, with_state)

    def forget(self) -> None:
        """Drop every build (a new generation)."""
        with self.lock:
            self.cache.forget()

    def stats(self) -> dict:
        with self.lock:
            return {"requests": self.requests, "waits": self.waits, "builds": len(self.cache.builds),
                    "most_builds": self.cache.most, "consumed": dict(self.consumed),
                    "wait_s": dict(self.wait_seconds), "build_threads": len(self.cache.workers.threads)}

    def close(self) -> None:
        self.cache.close()
