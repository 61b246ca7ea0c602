"""Ray runtime: the Planner, the SourceLoaders and the Constructors are Ray actors.

Wiring (one job; actor names are `<job>/planner`, `<job>/loader-<i>`, `<job>/constructor-<node|rank>` in
the `plait` namespace, so trainer processes started by torchrun join a job by its name, `attach=True`).
One module each:

  runtime            RayRuntime, the driver side a trainer process or `plait run` holds (options: RayOptions)
  planner_actor      the job's one Planner: plans every step once, keeps the window of planned steps
                     (plait.job.window, the window every runtime's job service keeps)
  planner_requests   how the Planner serves a request (its lock) and whom it tells: the observers of
                     each planning call and each request (standby, routing, shadows, presence)
  planner_layout     the Planner's loader layouts: the first one, rescaling and autoscaling while it runs
  planner_jobs       the Planner's side of a job's lifetime: attached trainers, heartbeats, idle end
  planner_reports    skipped records and the job's memory, gathered from its actors
  planner_host       `constructors="planner"`: the Planner's process builds every rank's batches too
  routing            which loaders serve which blocks, by layout version (the Constructors' routes)
  loader_actor       a SourceLoader owning partitions of one or several sources (plait.runtime.placement)
  shadow_actor       a standby SourceLoader following its primary's deltas
  constructor_actor  builds (step, dp_rank) once for every TP/PP/CP rank of a replica, from payloads
                     pulled straight from the loaders (RayPayloads); serves each CP rank its shard
  recovery           what happens when a loader, a shadow, a Constructor or the Planner dies
  standby_planner    a shared job's standby Planner: follows the Planner's per-step state, makes its
                     successor (exactly one, same stream) when it dies
  jobs               a job's lifecycle: joining (attach, torchrun), a trainer's membership and heartbeat,
                     leaving at close, garbage collection or exit; `plait jobs` list/stop
  liveness           the Planner's roster of live trainers: a job whose trainers all stopped ends
  instance           joining a cluster or starting the local instance (set up for a long job): RayUse
  job_metrics        the job's Prometheus endpoint, served by the Planner (per-loader and delivered counts
                     collected from the actors at scrape time)
  common             namespace, names, `get`, dead-actor errors, actor options, Ray's long-run settings

The stream is the local runtime's, bit for bit. Ray is imported lazily (plait[ray] is optional); the
local runtime never imports this package.
"""

from __future__ import annotations

import importlib

# The names are resolved on first use (PEP 562): each actor's process imports its own module
# (plait.runtime.ray.loader_actor, ...), and an eager import here would load the whole driver side (runtime,
# Planner, Constructor, recovery) into every one of them: ~0.2 CPU-s more per actor start, paid again at
# every respawn.
EXPORTS = {"NAMESPACE": "common", "RayOptions": "runtime", "RayRuntime": "runtime",
           "check_reachable": "runtime", "loaders_option": "runtime"}
__all__ = list(EXPORTS)


def __getattr__(name: str):
    if name not in EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{EXPORTS[name]}"), name)
