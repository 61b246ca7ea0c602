"""`python -m benchmarks.ray_throughput`: tokens/s delivered to R simulated ranks by the ray runtime, and how
often a rank had to wait for data.

R trainer ranks (threads of this process, each with its own plait.Loader attached to one job) consume
the demo dataset's packed micro-batches; each "computes" for --compute-ms per micro-batch (0: as fast
as possible). A step on which a rank's next micro-batch was not ready (the call blocked longer than
--wait-ms) counts as a wait. The baseline measured in the same run is the local runtime: every rank
with its own in-process loader (each plans the step itself and builds its own share).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from benchmarks.common import main, write_result


HELP = "ray runtime: tokens/s to R simulated ranks and the fraction of steps a rank waited for data"
DESCRIPTION = __doc__


def add_arguments(p) -> None:
    p.add_argument("--ranks", type=int, default=8, help="DP ranks (threads)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--compute-ms", type=float, default=0.0, help="simulated compute per micro-batch")
    p.add_argument("--wait-ms", type=float, default=2.0, help="a next() slower than this counts as waiting")
    p.add_argument("--loaders", type=int, default=None)
    p.add_argument("--prefetch", type=int, default=2, help="steps each Constructor builds ahead")
    p.add_argument("--runtime", choices=["ray", "local", "both"], default="both")
    p.add_argument("--cache", default=None, help="demo dataset folder (default: the demo cache)")
    p.add_argument("--json", metavar="PATH")


def _consume(loader, compute_s: float, wait_s: float, out: dict) -> None:
    waits, tokens, steps, first = 0, 0, 0, None
    waited_step = False
    it = iter(loader)
    t_start = time.perf_counter()
    while True:
        t = time.perf_counter()
        try:
            mb = next(it)
        except StopIteration:
            break
        now = time.perf_counter()
        if first is None:
            first = now - t_start
        elif now - t > wait_s:
            waited_step = True
        tokens += mb.num_tokens
        if mb.microbatch == mb.num_microbatches - 1:
            steps += 1
            waits += waited_step
            waited_step = False
        if compute_s:
            time.sleep(compute_s)
    out.update(tokens=tokens, steps=steps, waits=waits, first_batch_s=first, end=time.perf_counter())


def measure(spec, runtime: str, compute_s: float, wait_s: float, options: dict) -> dict:
    import plait

    ranks = spec.topology.dp
    job = f"bench-throughput-{os.getpid()}-{time.time_ns()}"
    kwargs = {"runtime": runtime, **({"job": job, **options} if runtime == "ray" else {})}
    loaders = [plait.Loader(spec, dp_rank=r, **kwargs) for r in range(ranks)]
    outs = [dict() for _ in range(ranks)]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=_consume, args=(ld, compute_s, wait_s, o)) for ld, o in zip(loaders, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(o["end"] for o in outs) - t0
    first = max(o["first_batch_s"] for o in outs)
    for ld in loaders:
        ld.close()
    tokens = sum(o["tokens"] for o in outs)
    steps = sum(o["steps"] for o in outs)
    waited = sum(o["waits"] for o in outs)
    steady = max(1e-9, wall - first)
    first_step_tokens = tokens / max(1, spec.steps)
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "steady_tokens_per_s": (tokens - first_step_tokens) / steady, "first_batch_s": first,
            "wait_fraction": waited / max(1, steps - ranks),  # each rank's first step always waits
            "rank_steps": steps}


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from plait.cli.demo_data import default_cache_dir, generate
    from plait.spec import load_spec

    console = Console()
    spec = load_spec(generate(Path(args.cache) if args.cache else default_cache_dir())).with_overrides(
        topology={"dp": args.ranks}, packing={"seq_len": args.seq_len, "microbatches": args.microbatches},
        steps=args.steps)
    result: dict = {"ranks": args.ranks, "steps": args.steps, "compute_ms": args.compute_ms}
    runtimes = ["local", "ray"] if args.runtime == "both" else [args.runtime]
    if "ray" in runtimes:
        import ray

        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, namespace="plait",
                 log_to_driver=False, configure_logging=False)
    try:
        for rt in runtimes:
            opts = {"build_ahead": args.prefetch, **({"loaders": args.loaders} if args.loaders else {})}
            result[rt] = measure(spec, rt, args.compute_ms / 1000, args.wait_ms / 1000, opts)
    finally:
        if "ray" in runtimes:
            import ray

            ray.shutdown()
    table = Table(title=f"tokens delivered to {args.ranks} ranks, {args.steps} steps, "
                        f"compute {args.compute_ms:g} ms per micro-batch")
    for col in ("runtime", "tokens/s", "steady tokens/s", "first batch s", "steps a rank waited"):
        table.add_column(col, justify="right")
    for rt in runtimes:
        m = result[rt]
        table.add_row(rt, f"{m['tokens_per_s']:,.0f}", f"{m['steady_tokens_per_s']:,.0f}", f"{m['first_batch_s']:.2f}",
                      f"{m['wait_fraction']:.1%}")
    console.print(table)
    if len(runtimes) == 2:
        result["ratio"] = result["ray"]["tokens_per_s"] / max(1e-9, result["local"]["tokens_per_s"])
        console.print(f"ray / local tokens/s: {result['ratio']:.2f}x")
    if args.json:
        write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
