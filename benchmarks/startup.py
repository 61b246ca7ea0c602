"""`python -m benchmarks.startup`: time from start to the first batch of every rank, over many sharded sources.

It writes S sources of F small pre-tokenized Parquet shards each (default 256 x 64 = 16,384 files) to a
temp dir, then times, for each rank count R in --ranks, a fresh job on the ray runtime from the moment
it is created to the moment every one of its R ranks holds its first micro-batch. Nothing is indexed
up front: a source lists its files, and a shard's footer is read when the order first reaches it, so
startup touches one shard per source whatever the number of shards, and the first step is planned once
for all ranks (it should not grow with R).

Reported alongside: the Ray instance's own start (once, not part of a job's startup) and the local
runtime's time to its first step for reference (one process planning and building every rank).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import main, write_result, write_token_parquet

HELP = "time to the first batch of every rank for a job over many sources x shards (ray runtime)"
DESCRIPTION = __doc__


def add_arguments(p) -> None:
    p.add_argument("--sources", type=int, default=256)
    p.add_argument("--shards", type=int, default=64, help="Parquet files per source")
    p.add_argument("--ranks", default="1,4,16", help="comma-separated DP rank counts, one job each")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--loaders", type=int, default=None, help="SourceLoader actors (default: the runtime's)")
    p.add_argument("--no-local", action="store_true", help="skip the local-runtime reference")
    p.add_argument("--json", metavar="PATH")


def make_sources(root: Path, sources: int, shards: int, *, docs: int = 16, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    entries = []
    for s in range(sources):
        folder = root / f"src{s:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        for f in range(shards):
            write_token_parquet(folder / f"shard-{f:05d}.parquet", rng.integers(32, 1024, size=docs), rng,
                                vocab=(2, 32000), compression="none")
        entries.append({"name": f"src{s:04d}", "path": str(folder), "tokens_field": "input_ids", "eos": 1,
                        "weight": float(rng.uniform(0.5, 2.0))})
    return entries


def _spec(entries: list[dict], ranks: int, seq_len: int):
    from plait.spec import load_spec

    return load_spec({"sources": entries, "packing": {"seq_len": seq_len, "microbatches": 1},
                      "topology": {"dp": ranks}, "cost": {"hidden": 1024, "layers": 8, "ffn": 4096, "heads": 8},
                      "seed": 0})


def time_ray_job(spec, loaders: int | None) -> dict:
    from plait.runtime.ray import RayRuntime

    t0 = time.perf_counter()
    rt = RayRuntime(spec, **({"loaders": loaders} if loaders else {}))
    t_actors = time.perf_counter() - t0
    plan = rt.plan()
    t_plan = time.perf_counter() - t0
    firsts = [rt.build(plan, r) for r in range(plan.ranks)]
    t_all = time.perf_counter() - t0
    assert all(len(b) == plan.microbatches for b in firsts)
    rt.close()
    return {"actors_ready_s": t_actors, "first_step_planned_s": t_plan, "first_batch_all_ranks_s": t_all}


def time_local(spec) -> float:
    from plait.runtime.local import LocalRuntime

    t0 = time.perf_counter()
    rt = LocalRuntime(spec)
    plan = rt.plan()
    for r in range(plan.ranks):
        rt.build(plan, r)
    took = time.perf_counter() - t0
    rt.close()
    return took


def run(args) -> int:
    import ray
    from rich.console import Console
    from rich.table import Table

    console = Console()
    ranks = [int(x) for x in str(args.ranks).split(",") if x]
    result: dict = {"sources": args.sources, "shards": args.shards, "ranks": ranks, "jobs": {}}
    with tempfile.TemporaryDirectory(prefix="plait-bench-startup-") as tmp:
        t0 = time.perf_counter()
        entries = make_sources(Path(tmp), args.sources, args.shards)
        console.print(f"{args.sources} sources x {args.shards} shards written in {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, namespace="plait",
                 log_to_driver=False, configure_logging=False)
        result["ray_start_s"] = time.perf_counter() - t0
        try:
            for r in ranks:
                result["jobs"][str(r)] = time_ray_job(_spec(entries, r, args.seq_len), args.loaders)
        finally:
            ray.shutdown()
        if not args.no_local:
            result["local_first_step_s"] = time_local(_spec(entries, max(ranks), args.seq_len))
    table = Table(title=f"startup: {args.sources} sources x {args.shards} shards (ray runtime)")
    for col in ("DP ranks", "actors ready s", "first step planned s", "first batch, every rank s"):
        table.add_column(col, justify="right")
    for r, j in result["jobs"].items():
        table.add_row(r, f"{j['actors_ready_s']:.2f}", f"{j['first_step_planned_s']:.2f}", f"{j['first_batch_all_ranks_s']:.2f}")
    console.print(table)
    console.print(f"Ray instance start (once per machine, not per job): {result['ray_start_s']:.2f} s")
    if "local_first_step_s" in result:
        console.print(f"local runtime, first step for all {max(ranks)} ranks in one process: "
                      f"{result['local_first_step_s']:.2f} s")
    worst = max(j["first_batch_all_ranks_s"] for j in result["jobs"].values())
    result["worst_first_batch_s"] = worst
    console.print(f"worst time to the first batch of every rank: {worst:.2f} s (target < 15 s)")
    if args.json:
        write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
