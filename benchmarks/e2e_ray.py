"""plait on the ray runtime in the e2e benchmarks (`python -m benchmarks.e2e`, `benchmarks.e2e_workloads`,
`benchmarks.e2e_cpu_roles`): the simulated job of plait.cli.bench.e2e_run fed by one plait.Loader per rank
of a Ray job (loaders="auto", autoscale where the runtime has it), and the Ray instance it runs in."""

from __future__ import annotations

import os
import time

import numpy as np

from plait.cli.bench.e2e_run import GpuClock, load_average, plait_shape, run_synchronous, summarize


def autoscale_available() -> bool:
    from plait.runtime.ray.runtime import RayRuntime

    return "autoscale" in RayRuntime.option_names()


def full_step_seconds(spec, clock: GpuClock) -> float:
    """The simulated GPU's time for a step of full text micro-batches: the pace the first loader layout
    must keep (the probe measures each source's cost, images decoded, and sizes the loaders for it)."""
    n = spec.packing.seq_len
    return spec.packing.num_microbatches * clock.seconds(np.array([n // 8] * 8), np.zeros(0, np.int64))


def images_decoded(runtime) -> int | None:
    """Images the job's current loaders decoded for payloads (None where they cannot be asked; the caller
    drops it after a rescale, whose new loaders counted only their own)."""
    try:
        return int(sum(s.get("images_decoded", 0) for s in runtime.stats()["loaders"]))
    except Exception:  # noqa: BLE001 - a figure beside the rates, never a reason to lose the row
        return None


def run_plait(spec, args, clock: GpuClock, autoscale: bool, **options) -> dict:
    import plait

    ranks = spec.topology.dp
    options = {"loaders": "auto", "step_time": max(full_step_seconds(spec, clock), 0.01), **options,
               **({"autoscale": True} if autoscale else {})}
    job = f"bench-e2e-{os.getpid()}-{time.time_ns()}"
    load_before = load_average()
    t0 = time.perf_counter()
    loaders = [plait.Loader(spec, dp_rank=r, runtime="ray", job=job, attach=r > 0, steps=args.steps, **options)
               for r in range(ranks)]  # rank 0 creates the job, the others join it
    try:
        trace = run_synchronous(loaders, args.steps, args.microbatches, clock, plait_shape)
        trace.start = t0
        row = summarize(trace, args.warmup)
        row["images_delivered"] = int(trace.images.sum())
        row["images_decoded"] = images_decoded(loaders[0].runtime)
        layout = loaders[0].runtime.layout
        report = loaders[0].scaling_report() if hasattr(loaders[0], "scaling_report") else None
    finally:
        for ld in loaders:
            ld.close()
    events = (report or {}).get("events") or []
    if any(e.get("kind") != "unmet" for e in events):  # a rescale replaced loaders: these counted their own
        row["images_decoded"] = None
    row.update(loaders_at_start=layout.loaders, autoscale=autoscale,
               loaders_at_end=events[-1]["loaders"] if events else layout.loaders,
               rescale_events=None if report is None else len([e for e in events if e.get("kind") != "unmet"]),
               unmet_reports=len([e for e in events if e.get("kind") == "unmet"]),
               load_average=[load_before, load_average()])
    return row


AGENT_WAIT_MS = "120000"


def patient_agents() -> None:
    """Give a new Ray node's agents 2 minutes to register (Ray waits 30 s: on a loaded machine the
    dashboard agent's imports take longer, and the raylet aborts: "Timed out waiting for file
    .../metrics_agent_port"). Ray's processes read it from the environment they inherit."""
    os.environ.setdefault("RAY_agent_register_timeout_ms", AGENT_WAIT_MS)


def start_ray(tries: int = 5, **options) -> None:
    """ray.init, tried again when the node does not register within Ray's fixed 30 s (a loaded machine)."""
    import ray

    patient_agents()

    for attempt in range(tries):
        try:
            ray.init(namespace="plait", log_to_driver=False, configure_logging=False, **options)
            return
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for a slow start
            if "timed out during startup" not in str(e) or attempt == tries - 1:
                raise
            ray.shutdown()


def ray_runner():
    """(run(spec, args, clock): a row of plait on Ray, starting Ray as plait starts it (with --cpus CPUs) on
    the first call unless one is running; stop(): shuts down the instance it started)."""
    import ray

    started = []

    def run(spec, args, clock):
        if not ray.is_initialized():
            from plait.runtime.ray.instance import start_ray as start_as_plait

            started.append(start_as_plait(None, {"num_cpus": args.cpus}))
        return run_plait(spec, args, clock, autoscale_available() and not args.no_autoscale)

    def stop():
        if any(started):
            ray.shutdown()

    return run, stop
