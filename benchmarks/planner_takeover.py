"""`python -m benchmarks.recovery --planner`: kill the Planner of a shared job; its standby makes the successor.

One Ray run of a named job (the Planner has a standby, plait.runtime.ray.standby_planner) streams every DP
rank's batches; at step `--kill-at` the Planner actor is killed. Reported:

  takeover_s         from the standby's decision to the successor serving (its process start included)
  kill_to_serving_s  from the kill to the successor serving (detection included)
  wait_s             how much longer the slowest step after the kill took than a normal step (median of
                     the same run, the baseline; steps of actor start-up and after the kill excluded)
  standby bytes      what the standby received: per planned step (state diffs, the steady state), and
                     the full states (the first one, and the successor's)
and that the stream is the failure-free one (the local runtime's): lost = duplicated = 0, same order.
"""

from __future__ import annotations

import os
import time

import numpy as np


def measure(spec, *, steps: int, kill_at: int) -> dict:
    """Run `steps` steps of a named job on Ray, killing its Planner after planning step `kill_at`; `streams`
    holds the failure-free (local) and the observed sample ids."""
    import ray

    from plait.runtime.local import LocalRuntime
    from plait.runtime.ray import RayRuntime
    from plait.runtime.ray.standby_planner import standby_stats

    kill_at = min(max(kill_at, 2), steps - 2)
    reference = []
    local = LocalRuntime(spec)
    try:
        for _ in range(steps):
            plan = local.plan()
            for r in range(plan.ranks):
                reference.extend(mb.sample_ids for mb in local.build(plan, r))
            local.release()
    finally:
        local.close()

    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False, namespace="plait", log_to_driver=False, configure_logging=False)
    job = f"bench-takeover-{os.getpid()}"
    rt = RayRuntime(spec, job=job, loaders=len(spec.sources))
    ids, step_s, t_kill = [], [], None
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            plan = rt.plan()
            for r in range(plan.ranks):
                ids.extend(mb.sample_ids for mb in rt.build(plan, r))
            step_s.append(time.perf_counter() - t0)
            if step == kill_at:
                deadline = time.monotonic() + 60  # the standby is a process of its own: let it start
                while (standby_stats(job) or {}).get("steps_followed", 0) < 2 and time.monotonic() < deadline:
                    time.sleep(0.05)
                before = standby_stats(job)
                t_kill = time.time()
                ray.kill(rt.planner, no_restart=True)
        after = standby_stats(job)
        events = [e for e in rt.recovery_events() if e.get("how") == "standby" and "recovery_s" in e]
    finally:
        rt.close()
        if started:
            ray.shutdown()
    # A kill after step s delays the steps whose plans were not fetched yet: s+1 and the prefetch after it.
    failure = range(kill_at + 1, min(steps, kill_at + 4))
    normal = [t for s, t in enumerate(step_s) if s >= 3 and s not in failure]
    step_time = float(np.median(normal or step_s))
    follow = before or {}
    takeover = events[0] if events else None
    return {
        "runtime": "ray", "steps": steps, "kill_at": kill_at, "dp": spec.topology.dp, "sources": len(spec.sources),
        "takeover_s": takeover["recovery_s"] if takeover else None,
        "kill_to_serving_s": takeover["at"] + takeover["recovery_s"] - t_kill if takeover else None,
        "step_s": step_time,
        "wait_s": max(max(0.0, step_s[s] - step_time) for s in failure),
        "standby_bytes_per_step": follow.get("diff_bytes_per_step"),
        "standby_full_state_bytes": follow.get("full_bytes"),
        "standby_bytes_after": {k: after.get(k) for k in ("messages", "full_bytes", "diff_bytes", "steps_followed")}
        if after else None,
        "takeovers": len(after["takeovers"]) if after else 0,
        "streams": (reference, ids),  # compared by the caller (benchmarks.common.compare_streams)
    }


def report(result: dict, console) -> None:
    console.print(
        f"Planner killed after step {result['kill_at']} of {result['steps']} (dp={result['dp']}, "
        f"{result['sources']} sources): takeover {result['takeover_s']:.3f} s (standby's decision to the "
        f"successor serving), kill to serving {result['kill_to_serving_s']:.3f} s; the slowest step after it "
        f"waited {result['wait_s']:.3f} s over a normal step of {result['step_s']:.4f} s "
        f"({result['wait_s'] / max(result['step_s'], 1e-9):.1f}x)\n"
        f"standby received {result['standby_bytes_per_step']:.0f} bytes per planned step (state diffs), "
        f"{result['standby_full_state_bytes']} bytes of full state at its start\n"
        f"takeovers: {result['takeovers']}  lost: {result['lost']}  duplicated: {result['duplicated']}  "
        f"same order: {result['same_order']}"
    )
