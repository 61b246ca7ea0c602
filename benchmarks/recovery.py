"""`python -m benchmarks.recovery`: kill SourceLoaders during a run; measure recovery and check exactly-once.

It streams a small three-source dataset (pre-tokenized Parquet, written to a temp dir) for every DP
rank twice: once without failures (the reference) and once while SourceLoaders are killed at seeded
random steps. Per failure it reports when the death was detected, how long the takeover took, and the
steps on which a rank waited longer than a normal step build. The two streams of sample ids must be
equal: lost = 0 and duplicated = 0, same order.

The baseline measured in the same run is the normal build time of one step (median over the
reference run); the target is that, with shadows, no step waits longer than that.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import compare_streams, kill_points, main, mixed_spec, write_result

HELP = "kill SourceLoaders mid-run: time to recover, steps that waited, lost = duplicated = 0"
DESCRIPTION = __doc__

log = logging.getLogger("plait.recovery")

def add_arguments(p) -> None:
    p.add_argument("--steps", type=int, default=40, help="global steps per run (default 40)")
    p.add_argument("--dp", type=int, default=4, help="DP ranks (default 4)")
    p.add_argument("--failures", type=int, default=3, help="SourceLoader kills during the run (default 3)")
    p.add_argument("--shadows", type=int, default=1, help="shadow loaders per source (0: cold restart)")
    p.add_argument("--interval", type=int, default=1, help="steps between differential checkpoints")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill points")
    p.add_argument("--respawn-delay", type=int, default=4,
                   help="ray: steps after a takeover before a replacement shadow starts (large: never)")
    p.add_argument("--runtime", choices=["ray", "local"], default="ray",
                   help="ray: kill actors with ray.kill; local: in-process loaders with simulated deaths")
    p.add_argument("--planner", action="store_true",
                   help="ray: kill the Planner of a named job instead (its standby makes the successor): takeover "
                        "time, bytes per step the standby receives (benchmarks/planner_takeover.py)")
    p.add_argument("--kill-at", type=int, default=None, help="--planner: the step after which it dies (default: middle)")
    p.add_argument("--data", metavar="DIR", help="where to write the dataset (default: a temp dir)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    console = Console()
    tmp = None
    root = Path(args.data) if args.data else Path(tmp := tempfile.mkdtemp(prefix="plait-bench-recovery-"))
    spec = mixed_spec(root, dp=args.dp, shadows=args.shadows)
    if getattr(args, "planner", False):
        return _run_planner(spec, args, console, tmp)
    if args.runtime == "ray":
        result = _run_ray(spec, args)
    else:
        result = _run_local(spec, args)
    table = Table(title=f"recovery: {result['failures']} SourceLoader kills, {args.steps} steps, dp={args.dp}, "
                        f"shadows={args.shadows}")
    for col in ("failure", "actor", "step", "recover s", "waited steps"):
        table.add_column(col, justify="right")
    for i, ev in enumerate(result["events"]):
        table.add_row(str(i), ev["actor"], str(ev["step"]), f"{ev['recovery_s']:.4f}", str(ev.get("waited_steps", [])))
    console.print(table)
    console.print(
        f"normal step build (median, baseline): {result['step_build_s']:.4f} s; worst wait at a failure: "
        f"{result['max_wait_s']:.4f} s ({result['max_wait_s'] / max(result['step_build_s'], 1e-9):.2f}x)\n"
        f"lost: {result['lost']}  duplicated: {result['duplicated']}  same order: {result['same_order']}"
    )
    if result.get("slow_steps"):
        console.print(f"all steps slower than 2x normal: {result['slow_steps']} (replacement shadows started at "
                      f"planner steps {result.get('shadow_starts_at_planner_step')}: a new worker process)")
    if args.json:
        write_result(args.json, result)
    if tmp:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    ok = result["lost"] == 0 and result["duplicated"] == 0 and result["same_order"]
    return 0 if ok else 1


def _run_planner(spec, args, console, tmp) -> int:
    from benchmarks import planner_takeover

    result = planner_takeover.measure(spec, steps=args.steps, kill_at=args.kill_at or args.steps // 2)
    result.update(compare_streams(*result.pop("streams")))
    planner_takeover.report(result, console)
    if args.json:
        write_result(args.json, result)
    if tmp:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    ok = result["lost"] == 0 and result["duplicated"] == 0 and result["same_order"] and result["takeovers"] == 1
    return 0 if ok else 1


def _run_local(spec, args) -> dict:
    return simulate(spec, steps=args.steps, failures=args.failures, shadows=args.shadows,
                    interval=args.interval, seed=args.seed)


# ----- in-process simulation: the roles, with deaths simulated ---------------------------------------
class _Dead(Exception):
    pass


class _Mortal:
    """Wraps a loader; once killed every call raises, like a call to a dead actor."""

    def __init__(self, loader, name: str):
        self.loader, self.name, self.alive = loader, name, True

    def __getattr__(self, attr):
        target = getattr(self.loader, attr)
        if not callable(target):
            return target

        def call(*a, **k):
            if not self.alive:
                raise _Dead(self.name)
            return target(*a, **k)

        return call


class LocalGroup:
    """One SourceLoader per source plus `shadows` ShadowLoaders each, in this process.

    The same supervision the Ray runtime does with actors: route every call to the source's current
    owner; when that owner is found dead, promote a shadow (or start a fresh loader if none is left),
    log the failure and the recovery, and retry the call. Calls are pure functions of block keys, so
    a retry returns exactly what the dead loader would have.
    """

    def __init__(self, spec, shadows: int = 0, interval: int = 1):
        from plait.roles.shadow import ShadowLoader
        from plait.roles.source_loader import SourceLoader

        self.spec, self.interval = spec, interval
        n = len(spec.sources)
        self.owner = [_Mortal(SourceLoader(spec, [i]), f"loader/{spec.sources[i].name}#0") for i in range(n)]
        self.generation = [0] * n
        self.standby = shadows
        self.shadows = [[ShadowLoader(spec, [i], primary=self.owner[i].name) for _ in range(shadows)] for i in range(n)]
        self.events: list[dict] = []
        self.delta_bytes: list[int] = []
        self.step = 0

    # provider (Planner) and loader_for (Constructor)
    def first_key(self, source):
        return self.call(source, "first_key", source)

    def block_meta(self, source, key):
        return self.call(source, "block_meta", source, key)

    def loader_for(self, source):
        group = self

        class _Route:
            def gather(self, *a):
                return group.call(source, "gather", *a)

        return _Route()

    def call(self, source, method, *a):
        """`method` on the source's current owner; a dead owner is replaced and the call retried."""
        while True:
            owner = self.owner[source]
            try:
                return getattr(owner, method)(*a)
            except _Dead:
                self._replace(source)

    def _replace(self, source: int) -> None:
        from plait.roles.source_loader import SourceLoader

        t0 = time.perf_counter()
        dead = self.owner[source]
        log.warning("failure: %s died (detected at step %d)", dead.name, self.step)
        self.generation[source] += 1
        name = f"loader/{self.spec.sources[source].name}#{self.generation[source]}"
        if self.shadows[source]:
            shadow = self.shadows[source].pop(0)
            info = shadow.promote()
            new, how = shadow, f"shadow promoted, re-read {info['reread_blocks']} blocks"
        else:
            new, how, info = SourceLoader(self.spec, [source]), "cold restart (no shadow)", {}
        self.owner[source] = _Mortal(new, name)
        took = time.perf_counter() - t0
        if self.standby:  # keep the number of shadows: a new one starts from the new owner's snapshot
            from plait.roles.shadow import ShadowLoader

            fresh = ShadowLoader(self.spec, [source], primary=name)
            fresh.sync(new.checkpoint_snapshot(self.step))
            self.shadows[source].append(fresh)
        log.warning("recovery: %s replaced by %s (%s) in %.4f s", dead.name, name, how, took)
        self.events.append({"actor": dead.name, "replacement": name, "step": self.step, "recovery_s": took,
                            "how": how, **{k: v for k, v in info.items() if k == "reread_blocks"}})

    def kill(self, source: int) -> None:
        self.owner[source].alive = False
        self.owner[source].loader.close()

    def release(self, live: set) -> None:
        for i in range(len(self.owner)):
            self.call(i, "retain", {k for k in live if k[0] == i})

    def checkpoint(self) -> None:
        """Every `interval` steps: each owner's delta to its shadows."""
        from plait.state.log import nbytes

        if self.step % self.interval:
            return
        for i in range(len(self.owner)):
            delta = self.call(i, "checkpoint_delta", self.step)
            self.delta_bytes.append(nbytes(delta))
            for sh in self.shadows[i]:
                sh.follow(delta)


def simulate(spec, *, steps: int, failures: int, shadows: int, interval: int = 1, seed: int = 0) -> dict:
    """Reference run, then the same run with loader deaths (in-process); exactly-once and timings."""
    from plait.roles.constructor import Constructor, LoaderPayloads
    from plait.roles.planner import Planner

    def one_run(kills: dict[int, int]):
        group = LocalGroup(spec, shadows=shadows if kills else 0, interval=interval)
        planner = Planner(spec, group)
        constructor = Constructor(LoaderPayloads(group.loader_for))
        ids, step_s = [], []
        for step in range(steps):
            group.step = step
            plan = planner.plan_step()
            group.checkpoint()  # deltas right after planning: shadows decode the blocks just announced
            if step in kills:
                group.kill(kills[step])
            t0 = time.perf_counter()
            for r in range(plan.ranks):
                for mb in constructor.build(plan.for_rank(r)):
                    ids.append(mb.sample_ids)
            step_s.append(time.perf_counter() - t0)
            group.release(planner.live_blocks())
        return ids, step_s, group

    ref_ids, ref_s, _ = one_run({})
    kills = kill_points(steps, failures, seed, len(spec.sources))
    ids, step_s, group = one_run(kills)
    step_build = float(np.median(ref_s))
    for ev in group.events:
        s = ev["step"]
        ev["wait_s"] = max(0.0, step_s[s] - step_build)
        ev["waited_steps"] = [s] if ev["wait_s"] > step_build else []
    out = compare_streams(ref_ids, ids)
    return {
        "runtime": "local-simulated",
        "failures": len(group.events),
        "events": group.events,
        "step_build_s": step_build,
        "max_wait_s": max((ev["wait_s"] for ev in group.events), default=0.0),
        "delta_bytes_mean": float(np.mean(group.delta_bytes)) if group.delta_bytes else 0.0,
        "delta_bytes_max": int(max(group.delta_bytes, default=0)),
        **out,
    }


def _run_ray(spec, args) -> dict:
    """Two Ray runs of the same spec: the reference, then one with SourceLoader kills."""
    import ray

    from plait.runtime.ray import RayRuntime

    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False, namespace="plait", log_to_driver=False, configure_logging=False)
    loaders = len(spec.sources)
    delta_stats: list[tuple[int, int]] = []

    def one_run(kills: dict[int, int]):
        rt = RayRuntime(spec, loaders=loaders, checkpoint_interval=args.interval, respawn_delay=args.respawn_delay)
        ids, step_s, killed_at = [], [], []
        try:
            for step in range(args.steps):
                plan = rt.plan()
                if step in kills:
                    handles = ray.get(rt.planner.get_loaders.remote())
                    killed_at.append((step, kills[step], time.time()))
                    ray.kill(handles[kills[step]], no_restart=True)
                t0 = time.perf_counter()
                for r in range(plan.ranks):
                    ids.extend(mb.sample_ids for mb in rt.build(plan, r))
                step_s.append(time.perf_counter() - t0)
            events = rt.recovery_events()
            shadows = [st for group in ray.get(rt.planner.shadow_stats.remote()) for st in group]
            delta_stats.append((sum(st["delta_bytes"] for st in shadows), sum(st["deltas"] for st in shadows)))
        finally:
            rt.close()
        return ids, step_s, killed_at, events

    try:
        ref_ids, ref_s, _, _ = one_run({})
        kills = kill_points(args.steps, args.failures, args.seed, loaders)
        ids, step_s, killed_at, events = one_run(kills)
    finally:
        if started:
            ray.shutdown()
    warm = ref_s[3:] or ref_s  # the first steps include actor start-up
    step_build = float(np.median(warm))
    out_events = []
    loader_events = [e for e in events if e["role"] == "loader"]
    # A kill at step s can delay the builds in flight then: s and the `prefetch` (2) steps after it.
    # A replacement shadow starts a few steps later; its process start-up is reported on its own.
    respawn = [e for e in events if e["role"] == "shadow-start"]
    for (step, k, t_kill), ev in zip(killed_at, loader_events):
        window = range(step, min(len(step_s), step + 3))
        excess = [max(0.0, step_s[s] - step_build) for s in window]
        out_events.append({
            "actor": ev["actor"].split("/", 1)[-1], "step": step, "replacement": ev["replacement"].split("/", 1)[-1],
            "how": ev["how"], "recovery_s": ev["recovery_s"], "kill_to_serving_s": max(0.0, ev["at"] - t_kill),
            "wait_s": max(excess, default=0.0), "waited_steps": [s for s, e in zip(window, excess) if e > step_build],
        })
    out = compare_streams(ref_ids, ids)
    return {
        "runtime": "ray",
        "failures": len(out_events),
        "delta_bytes_mean": delta_stats[0][0] / max(1, delta_stats[0][1]) if delta_stats else None,
        "kills": len(killed_at),
        "events": out_events,
        "step_build_s": step_build,
        "max_wait_s": max((e["wait_s"] for e in out_events), default=0.0),
        "max_kill_to_serving_s": max((e["kill_to_serving_s"] for e in out_events), default=0.0),
        "waited_steps": sorted({s for e in out_events for s in e["waited_steps"]}),
        "slow_steps": [s for s, t in enumerate(step_s) if s >= 3 and t > 2 * step_build],
        "shadow_starts_at_planner_step": [e["step"] for e in respawn],
        "target_met": max((e["wait_s"] for e in out_events), default=0.0) <= step_build,
        **out,
    }


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
