"""Ray helpers every module of the ray runtime shares: the namespace and actor names, `get` that re-raises
plait's own errors, what "the actor is dead" looks like, and the options an actor is started with.

Ray is imported lazily (plait[ray] is an optional extra): `ray_module()` is the one place that imports it.
"""

from __future__ import annotations

import os
from typing import Any

from plait.errors import PlaitError

NAMESPACE = "plait"  # every actor of every job lives here; a job's actors are named `<job>/...`


def ray_module():
    """The `ray` module, or a PlaitError naming the extra to install."""
    try:
        import ray
    except ImportError as e:  # pragma: no cover - exercised without the extra
        raise PlaitError(f"the ray runtime needs `pip install plait[ray]` ({e})") from None
    return ray


def use_auth_mode(mode: str) -> None:
    """Join with Ray's authentication mode `mode` (a RAY_AUTH_MODE the user set wins). Ray reads the
    variable once per process, when it is imported (Ray's token-auth docs: set it before Ray starts): set
    it before `import ray`. Where Ray was imported already (by the trainer, by Ray Train), Ray's cached
    config is read again from the environment, as Ray itself does when it turns token auth on for a local
    instance (ray._private.authentication.authentication_token_setup._enable_token_auth)."""
    import sys

    if os.environ.get("RAY_AUTH_MODE"):
        return
    os.environ["RAY_AUTH_MODE"] = mode
    if "ray" in sys.modules:
        from ray._raylet import Config

        Config.initialize("")


def get(refs, timeout: float | None = None):
    """ray.get that re-raises plait's own errors as themselves (a bad spec or shard, not a Ray trace)."""
    ray = ray_module()
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, PlaitError):
            raise cause from None
        raise


def dead_errors() -> tuple[type, ...]:
    """Exceptions meaning "the actor you called is dead" (killed, crashed, its node lost)."""
    return (ray_module().exceptions.RayActorError,)


def planner_name(job: str) -> str:
    return f"{job}/planner"


def constructor_name(job: str, key: str) -> str:
    return f"{job}/constructor-{key}"


def job_of(actor_name: str) -> str | None:
    """The job an actor name of NAMESPACE belongs to (`<job>/planner` -> `<job>`), None for other names."""
    job, sep, role = actor_name.rpartition("/")
    return job if sep and job and role else None


def process_rss() -> int:
    """This process's resident memory in bytes (what each actor reports in its `stats()`)."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def actor_options(name: str | None = None, lifetime: str | None = None, **resources: Any) -> dict:
    """Options for `ray.remote(cls).options(...)`: a named actor is found again by its name (in
    NAMESPACE) rather than started twice; `lifetime="detached"` outlives its creator (shared jobs).

    Task events are off for plait's actors (`enable_task_events=False`, as Ray Serve does for its own):
    every actor call is otherwise a task event the GCS keeps (up to `task_events_max_num_task_in_gcs`)
    and, past that cap, one more "dropped attempt" record per call in a per-job set (Ray keeps up to a
    million), so gcs_server grew all through a soak (docs/soak.md); plait never reads them. This holds
    on a cluster plait joins too, whatever its system config."""
    opts = dict(resources, enable_task_events=False)
    if name is not None:
        opts.update(name=name, namespace=NAMESPACE, get_if_exists=True)
    if lifetime:
        opts["lifetime"] = lifetime
    return opts


def use_numpy_kernels() -> None:
    """Loader and Constructor actors copy a few spans per request: the numpy kernels (same values) do it
    without importing numba and llvmlite (60-80 MiB per process). The Planner keeps compiled balancing."""
    from plait import kernels

    kernels.use_compiled(False)


# The allocator of plait's actors (and of Ray's own processes when plait starts Ray). Ray's wheel ships
# jemalloc (ray/core/libjemalloc.so) and preloads it into its gcs_server and raylet, but takes it out of
# its workers (RAY_LD_PRELOAD_ON_WORKERS=0) unless told otherwise. In a worker, glibc's malloc fragments
# under Ray's call traffic (~200,000 malloc calls a second in the Constructor, a 256 KiB msgpack buffer per
# call argument): heaptrack saw nothing held, yet the Constructor's glibc heaps rose ~2.5 MiB/hour over an
# hour and had not gone flat (docs/soak.md). RAY_LD_PRELOAD_ON_WORKERS=1 is Ray's own switch to give the
# workers the same jemalloc; PLAIT_RAY_ALLOCATOR=glibc leaves Ray's default (a user's own LD_PRELOAD also
# replaces Ray's jemalloc everywhere: Ray then preloads nothing). MALLOC_ARENA_MAX=2 bounds glibc's arenas
# where glibc's malloc still runs (with glibc: the Constructor had 13 arenas, each rising with a flat Python
# heap; glibc's default is up to 8 per core). Read by a process as it starts: plait sets them in the
# environment of the Ray instance it starts (plait.runtime.ray.instance.daemon_env: the raylet passes them
# to every worker); a cluster plait joins gets them from `ray start`'s environment (docs/ray-long-runs.md).
# Not a runtime_env of plait's actors: Ray then starts new workers for them and the prestarted ones
# (~80 MiB each) sit idle.
ALLOCATOR_VARIABLE = "PLAIT_RAY_ALLOCATOR"
ALLOCATORS = ("jemalloc", "glibc")


def malloc_env() -> dict[str, str]:
    """The allocator variables for the processes of a Ray instance plait starts (above)."""
    allocator = os.environ.get(ALLOCATOR_VARIABLE, "jemalloc")
    if allocator not in ALLOCATORS:
        raise PlaitError(f"{ALLOCATOR_VARIABLE}={allocator!r}: expected one of {', '.join(ALLOCATORS)}")
    env = {"MALLOC_ARENA_MAX": "2"}
    if allocator == "jemalloc":
        env["RAY_LD_PRELOAD_ON_WORKERS"] = "1"
    return env

# ----- a Ray instance plait starts itself, configured for a job of days or weeks -------------------------
TASK_EVENTS_IN_GCS = 10_000  # Ray's default keeps 100,000 task events in the GCS (every actor call is one)
# A return up to this size travels inline in the call's reply instead of through the object store. Ray's
# 100 KiB default sends a loader's gather of a few small images (~0.45 MiB) through plasma: create, seal,
# map, release and free cost ~1.2 CPU ms more per call than the reply's copies; at 1 MiB the copies cost
# ~0.6 ms more than plasma (benchmarks/ray_inline_returns.py): builds and larger gathers stay in the store.
INLINE_RETURN_BYTES = 512 * 2**10
LOG_ROTATION_BYTES = 64 * 2**20  # per log file of Ray's processes (Ray's default: 512 MiB, 5 backups)
LOG_ROTATION_BACKUPS = 2
# Ray's log monitor (one per node) tails every worker's log file to copy new lines to drivers that asked for
# them; plait's drivers do not (log_to_driver=False). It looks for new files 10 times a second until a node
# has 1,000 of them: with a few hundred (every actor a job or its recoveries ever started leaves two) that
# glob alone was ~2.5% of a core on an idle instance. Past the threshold Ray rescans every
# LOG_NAME_UPDATE_INTERVAL_S; plait sets the threshold to 0 and the interval to 5 s (a new worker's lines
# reach a driver that asks for them up to 5 s late). Measured: benchmarks/reports/2026-12-06-ci-time.md.
LOG_MONITOR_ENV = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0", "LOG_NAME_UPDATE_INTERVAL_S": "5"}


def long_run_settings(dashboard: bool = False) -> tuple[dict, dict]:
    """(ray.init keyword arguments, environment variables) for a local instance that stays flat over a
    long job and carries a data plane: task events bounded in the GCS, returns up to INLINE_RETURN_BYTES
    inline in the reply, no dashboard (and no metrics agent exporting Ray's own
    metrics: plait serves its own) unless `dashboard`, logs rotated at LOG_ROTATION_BYTES, workers' output
    kept in their log files rather than copied to the trainer, the log monitor's rescans slowed
    (LOG_MONITOR_ENV). The variables must be in the environment
    before `ray.init` (Ray's processes read them at start); docs/ray-long-runs.md has the `ray start`
    equivalents for a cluster plait joins."""
    system_config: dict[str, Any] = {"task_events_max_num_task_in_gcs": TASK_EVENTS_IN_GCS,
                                     "max_direct_call_object_size": INLINE_RETURN_BYTES}
    if not dashboard:
        system_config["enable_metrics_collection"] = False
    init = {"include_dashboard": bool(dashboard), "log_to_driver": False, "_system_config": system_config}
    env = {"RAY_ROTATION_MAX_BYTES": str(LOG_ROTATION_BYTES), "RAY_ROTATION_BACKUP_COUNT": str(LOG_ROTATION_BACKUPS),
           **LOG_MONITOR_ENV}
    return init, env
