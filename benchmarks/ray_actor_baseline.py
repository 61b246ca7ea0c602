"""How much does a bare Ray actor's process grow, with plait's settings, when it is only called?

The soak bench (`python -m benchmarks.soak --runtime ray`, docs/soak.md) fits a slope to the RSS of plait's actors;
part of an actor's process is Ray's own core worker (its gRPC threads, task receivers, reference counting),
which grows as it serves calls whatever the actor does. This benchmark is that baseline: it starts Ray as
plait starts it (`plait.runtime.ray.instance.start_ray`: long-run settings, MALLOC_ARENA_MAX=2) in a temp
dir of its own, starts actors with plait's actor options (`actor_options`: no task events) that do nothing
but return `--reply-kib` of bytes, calls each of them `--rate` times a second from `--callers` threads,
samples each actor's RSS every `--interval-s`, and fits the slope after `--warmup-s` as the soak does
(least squares, its second half, the band's drift). Two actors by default: `max_concurrency` 64 (as the
Constructor) and 1, so whether the call threads matter shows too.

Run it beside a soak (its own Ray instance, its own processes: the soak does not count them) to read the
soak's actor slopes against what Ray alone adds in the same minutes on the same machine:

    python -m benchmarks.ray_actor_baseline --minutes 62 --warmup-s 120 --json ray-baseline.json
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

from benchmarks.common import main, own_ray_instance, write_result

HELP = "RSS slope of bare Ray actors that are only called (plait's Ray settings): the soak's Ray baseline"
DESCRIPTION = __doc__


def add_arguments(p) -> None:
    p.add_argument("--minutes", type=float, default=10.0, help="how long to call the actors (default 10)")
    p.add_argument("--warmup-s", type=float, default=120.0, help="seconds left out of the slope (default 120)")
    p.add_argument("--interval-s", type=float, default=5.0, help="seconds between RSS samples (default 5)")
    p.add_argument("--rate", type=float, default=50.0, help="calls per second to each actor (default 50)")
    p.add_argument("--callers", type=int, default=4, help="threads calling each actor (default 4)")
    p.add_argument("--reply-kib", type=int, default=64, help="bytes each call returns, KiB (default 64)")
    p.add_argument("--concurrency", default="64,1", help="max_concurrency of each actor, comma separated")
    p.add_argument("--forward", action="store_true", help="each actor asks a leaf actor for every answer (nested "
                   "calls, as a Constructor asks its SourceLoaders); the leaf is sampled too")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")


LEAF_CONCURRENCY = 4  # the leaf answers every forwarding actor's calls, as a SourceLoader does (max_concurrency=4)


class Bare:
    """An actor that only answers: its process is Ray's core worker and the Python it needs. With a `leaf`
    it asks the leaf for every answer (a nested call, as a Constructor asks its SourceLoaders: it then owns
    the objects of the calls it makes)."""

    def __init__(self, leaf=None):
        self.leaf = leaf

    def pid(self) -> int:
        return os.getpid()

    def reply(self, nbytes: int) -> bytes:
        if self.leaf is not None:
            import ray

            return ray.get(self.leaf.reply.remote(nbytes))
        return bytes(nbytes)


class Callers:
    """`args.callers` threads per actor, each calling it `args.rate / args.callers` times a second until
    stopped; `counts[i]` holds actor i's calls, one counter per thread (no shared increment)."""

    def __init__(self, actors: list, args):
        self.stop = threading.Event()
        self.period, self.nbytes = args.callers / args.rate, args.reply_kib * 1024
        self.counts = [[[0] for _ in range(args.callers)] for _ in actors]
        self.threads = [threading.Thread(target=self.loop, args=(a, self.counts[i][k]), daemon=True)
                        for i, a in enumerate(actors) for k in range(args.callers)]
        for t in self.threads:
            t.start()

    def loop(self, actor, count: list[int]) -> None:
        import ray

        next_at = time.monotonic()
        while not self.stop.is_set():
            ray.get(actor.reply.remote(self.nbytes))
            count[0] += 1
            next_at += self.period
            self.stop.wait(max(0.0, next_at - time.monotonic()))

    def calls(self, i: int) -> int:
        return sum(n[0] for n in self.counts[i])

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def sample_rss(procs: list, args) -> tuple[np.ndarray, np.ndarray]:
    """(seconds, RSS in bytes per process: one row per sample) every `args.interval_s` for `args.minutes`."""
    t0, times, rss = time.monotonic(), [], []
    deadline = t0 + args.minutes * 60
    while True:
        times.append(time.monotonic() - t0)
        rss.append([p.memory_info().rss for p in procs])
        if time.monotonic() >= deadline:
            return np.array(times), np.array(rss, dtype=np.float64)
        time.sleep(min(args.interval_s, max(0.0, deadline - time.monotonic())))


def run(args) -> int:
    import psutil
    import ray

    from benchmarks.soak_sampler import MIB, fit_figures
    from plait.errors import PlaitError
    from plait.runtime.ray.common import actor_options

    if not 0 <= args.warmup_s < args.minutes * 60 - 2 * args.interval_s:
        raise PlaitError(f"--warmup-s {args.warmup_s:g} leaves too little of a {args.minutes:g}-minute run to fit")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    with own_ray_instance("raybase-"):
        bare = ray.remote(Bare)
        leaves = [bare.options(**actor_options(num_cpus=0, max_concurrency=LEAF_CONCURRENCY)).remote()] \
            if args.forward else []
        actors = [bare.options(**actor_options(num_cpus=0, max_concurrency=c)).remote(*leaves) for c in concurrencies]
        callers = None
        try:
            procs = [psutil.Process(ray.get(a.pid.remote())) for a in [*actors, *leaves]]  # the leaf last
            callers = Callers(actors, args)
            t, rss = sample_rss(procs, args)
            calls = [callers.calls(i) for i in range(len(actors))]
        finally:
            if callers is not None:
                callers.close()
            for a in [*actors, *leaves]:
                ray.kill(a)
    fit = t >= args.warmup_s
    kinds = [("forwarding" if args.forward else "answering", c, n) for c, n in zip(concurrencies, calls)]
    kinds += [("leaf", LEAF_CONCURRENCY, sum(calls))] if args.forward else []
    rows = [{"actor": kind, "max_concurrency": c, "calls_per_s": round(n / t[-1], 1),
             "rss_start_mib": round(rss[fit, i][0] / MIB, 1), "rss_end_mib": round(rss[-1, i] / MIB, 1),
             **fit_figures(t[fit], rss[fit, i]), "rss_mib": [round(v / MIB, 2) for v in rss[:, i]]}
            for i, (kind, c, n) in enumerate(kinds)]
    print(f"bare Ray actors, {args.minutes:g} min, fit from {args.warmup_s:g} s, reply {args.reply_kib} KiB:")
    for r in rows:
        print(f"  {r['actor']}, max_concurrency {r['max_concurrency']:>3}: {r['calls_per_s']:.0f} calls/s, RSS "
              f"{r['rss_start_mib']:.1f} -> {r['rss_end_mib']:.1f} MiB, slope {r['slope_mib_per_hour']:+.2f} "
              f"MiB/hour (2nd half {r['late_slope_mib_per_hour']:+.2f}, band {r['band_slope_mib_per_hour']:+.2f})")
    write_result(args.json, {"minutes": args.minutes, "warmup_s": args.warmup_s, "rate": args.rate,
                             "forward": args.forward, "reply_kib": args.reply_kib,
                             "sample_t": [round(x, 1) for x in t], "actors": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
