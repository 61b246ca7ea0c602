"""What does a Ray call cost with its request as six arguments, and as one tuple?

A Constructor asks each SourceLoader for a build's spans with one call per loader per build. Until
2026-12-05 the call carried the request as six arguments (source, keys, block_index, position, offset,
length: numpy arrays and a list of block keys); now it carries them as one tuple (LoaderActor.gather).
Ray serializes each argument of a call on its own, through msgpack: a 256 KiB Packer buffer per argument
and per non-msgpack object inside it (every numpy array, every key tuple), and the receiver reads each
with a 1 MiB Unpacker buffer (heaptrack on the Constructor, docs/soak.md). This benchmark measures what
that costs per call, like against like in one run: an actor with plait's options answers both forms of
a request of `--items` spans over `--blocks` keys with a small array (as a gather of text does), called
from `--callers` threads for `--calls` calls per form, the forms alternating for `--rounds` rounds. It
reports per call the caller's CPU (the process's, all its threads: serialization and Ray's core worker),
the actor's CPU and the wall time, and each ratio six / one.

    python -m benchmarks.ray_call_args --calls 3000 --rounds 3 --json call-args.json
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

from benchmarks.common import main, own_ray_instance, write_result

HELP = "per-call CPU of a Ray actor call with a gather's request as six arguments vs one tuple"
DESCRIPTION = __doc__

FORMS = ("six", "one")
FIGURES = ("caller_cpu", "actor_cpu", "wall")  # seconds spent, per form


def add_arguments(p) -> None:
    p.add_argument("--calls", type=int, default=2000, help="calls of each form per round (default 2000)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the two forms alternating (default 3)")
    p.add_argument("--items", type=int, default=256, help="spans in one request (default 256)")
    p.add_argument("--blocks", type=int, default=8, help="block keys in one request (default 8)")
    p.add_argument("--callers", type=int, default=4, help="threads calling at once (default 4)")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")


class Answering:
    """Answers a request in either form with as many int32 zeros as its spans ask: the reply is the same
    for both forms, only the request's shape differs."""

    def pid(self) -> int:
        return os.getpid()

    def six(self, source, keys, block_index, position, offset, length) -> np.ndarray:
        return np.zeros(min(int(len(length)), 4096), dtype=np.int32)

    def one(self, request: tuple) -> np.ndarray:
        return self.six(*request)


def request(args) -> tuple:
    """A gather's request as the Constructor makes it (plait.plan.Items.block_keys and its columns)."""
    rng = np.random.default_rng(0)
    keys = [(int(s), 0, int(f), int(b)) for s, f, b in rng.integers(0, 64, size=(args.blocks, 3))]
    block_index = np.sort(rng.integers(0, args.blocks, size=args.items))
    return (rng.integers(0, 16, size=args.items), keys, block_index, rng.integers(0, 4096, size=args.items),
            np.zeros(args.items, dtype=np.int64), rng.integers(16, 2048, size=args.items))


def call_round(actor, form: str, req: tuple, args) -> None:
    """`args.calls` calls of one form from `args.callers` threads, each waiting for its answer."""
    import ray

    def loop(n: int) -> None:
        for _ in range(n):
            ray.get(actor.one.remote(req) if form == "one" else actor.six.remote(*req))

    share = [args.calls // args.callers + (i < args.calls % args.callers) for i in range(args.callers)]
    threads = [threading.Thread(target=loop, args=(n,)) for n in share]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def measure(actor, proc, args) -> dict[str, dict[str, float]]:
    """Per form: seconds of caller CPU, actor CPU and wall, summed over the rounds."""
    req = request(args)
    call_round(actor, "six", req, args)  # warm both paths (imports, first serializations)
    call_round(actor, "one", req, args)
    spent = {f: dict.fromkeys(FIGURES, 0.0) for f in FORMS}
    for r in range(args.rounds):
        for form in (FORMS if r % 2 == 0 else FORMS[::-1]):  # alternate which goes first
            c0, a0, w0 = time.process_time(), sum(proc.cpu_times()[:2]), time.perf_counter()
            call_round(actor, form, req, args)
            spent[form]["caller_cpu"] += time.process_time() - c0
            spent[form]["actor_cpu"] += sum(proc.cpu_times()[:2]) - a0
            spent[form]["wall"] += time.perf_counter() - w0
    return spent


def run(args) -> int:
    import psutil
    import ray

    from plait.runtime.ray.common import actor_options

    with own_ray_instance("raycall-"):
        actor = ray.remote(Answering).options(**actor_options(num_cpus=0, max_concurrency=args.callers)).remote()
        try:
            spent = measure(actor, psutil.Process(ray.get(actor.pid.remote())), args)
        finally:
            ray.kill(actor)
    calls = args.calls * args.rounds
    per_call = {f: {f"{k}_us_per_call": round(v / calls * 1e6, 1) for k, v in spent[f].items()} for f in FORMS}
    ratios = {k: round(spent["six"][k] / spent["one"][k], 2) for k in FIGURES if spent["one"][k] > 0}
    print(f"a gather's request ({args.items} spans, {args.blocks} keys), {calls} calls of each form, "
          f"{args.callers} callers:")
    print(f"  {'form':<6}{'caller CPU (us/call)':>22}{'actor CPU (us/call)':>21}{'wall (us/call)':>16}")
    for f in FORMS:
        p = per_call[f]
        print(f"  {f:<6}{p['caller_cpu_us_per_call']:>22.1f}{p['actor_cpu_us_per_call']:>21.1f}"
              f"{p['wall_us_per_call']:>16.1f}")
    print("  six / one: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    write_result(args.json, {"items": args.items, "blocks": args.blocks, "calls": calls, "callers": args.callers,
                             "per_call": per_call, "ratio_six_over_one": ratios})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
