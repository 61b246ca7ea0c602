"""`constructors="planner"`: the Planner's process is also the job's Constructor (a one-node job: one
process fewer).

`PlannerHostActor` is the job's Planner actor (same name, same methods, same standby) that also serves
the Constructor's `get`, `telemetry` and `serve_flight`: every trainer process's ConstructorPool hands out
the Planner's handle as its Constructor. The Constructor role (plait.runtime.ray.constructor_actor) runs
unchanged inside it: its build half asks this very object's plan half by plain calls (no Ray hop, no
second copy of a plan; job.plan_stream.PlanSource) and its payloads still come straight from the loaders. The actor serves many
calls at once (a trainer waiting for a build must not hold up the others); every Planner request holds the
Planner's own lock (plait.runtime.ray.planner_requests.planner_call), so they still run one at a time, and
the Constructor's side here runs beside them.

Suited to a job on one node: on several nodes every trainer would fetch its batches from the Planner's
node. The default on a cluster of one node (`constructors="auto"`: plait.runtime.ray.runtime.resolve_constructors).
"""

from __future__ import annotations

from plait.runtime.ray.common import planner_name
from plait.runtime.ray.constructor_actor import ConstructorActor, build_threads
from plait.runtime.ray.planner_actor import PlannerActor


class PlannerHostActor(PlannerActor):
    """The job's Planner, building every rank's micro-batches in its own process."""

    ACTOR_OPTIONS = {"max_concurrency": 64}  # a trainer waiting for its build must not hold up the others

    def __init__(self, spec_dict: dict, job: str, options: dict):
        super().__init__(spec_dict, job, options)
        prefetch = int(options.get("prefetch", 2))
        # the build half asks this object's plan half by plain calls (each takes the Planner's lock)
        self.builder = ConstructorActor(job, prefetch, build_threads(self.planner.ranks), host=self)

    def builder_names(self) -> list[str]:
        """This actor builds: the job's /metrics and the autoscaler read its figures as a Constructor's."""
        return super().builder_names() + [planner_name(self.job)]

    # ----- the Constructor's side (not a Planner request: a build waits for the Planner's side) ----------
    def get(self, gen: int, step: int, dp_rank: int, limit: int | None = None, cp: tuple[int, int] = (1, 0),
            with_state: bool = True, client: str | None = None):
        return self.builder.get(gen, step, dp_rank, limit, cp, with_state, client)

    def telemetry(self) -> dict:
        return self.builder.telemetry()

    def serve_flight(self, host: str, token: str) -> str:
        return self.builder.serve_flight(host, token)

    def info(self) -> dict:
        """PlannerActor.info, and that this Planner is the job's Constructor (trainers that attach use it)."""
        return {**super().info(), "constructors": "planner"}

    def stats(self) -> dict:
        """The Planner's figures and the Constructor's (requests, waits, pid, rss)."""
        return {**super().stats(), **self.builder.stats()}
