"""`python -m benchmarks.memory`: memory of data loading for R ranks over S sources, per-rank loaders against
plait, by PSS and RSS (`plait bench memory` measures plait's node data plane alone, on the same harness).

Both setups stream the same spec (S pre-tokenized Parquet sources, or --spec) for a job of R data-parallel
ranks, each rank a real trainer process with torch imported, with the same readers and buffers per source
(the same SourceLoader code and cache limits):

  per-rank  each trainer iterates a torch DataLoader (multiprocessing_context "fork", persistent
            workers: what users run) whose W workers each run the local runtime over all S sources.
  plait     --client node: the local runtime as torchrun starts it (LOCAL_RANK 0's trainer hosts the
            node's data plane); ray: Ray drivers (plait.Loader runtime="ray"); flight: thin clients served
            by `plait serve` on Ray; flight-local: served by one `plait serve --runtime local` (no Ray).

After every rank has consumed --steps steps (all processes alive, holding their buffers) it sums, per role:
  per-rank  (trainer + its forked workers) - the trainer's baseline
  plait     what each trainer added over its baseline + every plait process (actors, server)
PSS splits a page shared by n processes n ways: a forked worker's pages shared with its trainer count
once, where RSS counts them in both (so the ratio by PSS comes first). Ray's own daemons (GCS, raylet,
agents, idle workers) are reported separately. Only processes started by this benchmark are counted.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from benchmarks.common import main
from benchmarks.processes import init_ray, plait_processes, start_serve, stop_serve
from plait.cli.bench import memory as product

HELP = "resident memory of data loading: per-rank loaders vs plait (node, Ray or Flight; S sources, R ranks)"
DESCRIPTION = __doc__
MODULE = "benchmarks.memory"  # the trainers' `python -m` module
CACHED_BLOCKS = 256  # decoded blocks a SourceLoader keeps, in both setups (the ray runtime's default)
MIB = 2**20


def add_arguments(p) -> None:
    product.add_data_arguments(p)
    p.add_argument("--workers", type=int, default=1,
                   help="per-rank: DataLoader workers per rank (num_workers, forked; each holds every source's "
                        "state and serves every W-th step)")
    p.add_argument("--loaders", type=int, default=None, help="ray: SourceLoader actors (default: the runtime's)")
    p.add_argument("--only", choices=["per-rank", "plait"], default=None, help="measure one setup only")
    p.add_argument("--client", choices=["ray", "flight", "flight-local", "node"], default="ray",
                   help="plait's trainers: Ray drivers (plait.Loader runtime=ray) or thin clients over Arrow Flight "
                        "(runtime=flight, served by `plait serve`, no Ray in the trainers); flight-local: the thin "
                        "clients served by one `plait serve --runtime local` process (no Ray at all); node: the "
                        "local runtime as torchrun starts it (LOCAL_RANK 0's trainer hosts the node's data plane)")


def per_rank_loader(spec, rank: int, steps: int, workers: int):
    """The per-rank baseline: a torch DataLoader as users start it (forked, persistent workers), each
    worker running the local runtime over every source; worker k delivers the steps t with t % W == k.
    A worker keeps its runtime (every source's state and buffers) until it is killed, so it is measured
    holding them."""
    import torch.utils.data as tud

    from plait.runtime.local import LocalRuntime

    class PerRankSteps(tud.IterableDataset):
        def __iter__(self):
            info = tud.get_worker_info()
            worker, count = (info.id, info.num_workers) if info is not None else (0, 1)
            self.runtime = LocalRuntime(spec)
            self.runtime.loader.max_cached_blocks = CACHED_BLOCKS  # the ray runtime's loaders' cache limit
            for _, mb in self.runtime.iter_rank(rank, self.runtime.state_dict(), 0, steps):
                if mb.step % count == worker:
                    yield mb

    return tud.DataLoader(PerRankSteps(), batch_size=None, num_workers=workers, multiprocessing_context="fork",
                          persistent_workers=True)


def load(cfg: dict, spec) -> tuple[dict, object]:
    """A trainer's loader of each setup but node (plait.cli.bench.memory's own trainers), and its report."""
    import plait

    if cfg["mode"] == "per-rank":
        import psutil

        loader = per_rank_loader(spec, cfg["rank"], cfg["steps"], int(cfg.get("workers", 1)))
        n = sum(1 for _ in loader)
        me = psutil.Process()
        children = me.children()  # the DataLoader's workers, alive (persistent) with their state
        forked = all(c.cmdline() == me.cmdline() for c in children)  # a spawned worker runs another command
        return {"workers": [c.pid for c in children], "batches": n, "forked": forked}, loader
    if cfg["mode"] == "flight":
        loader = plait.Loader(spec, dp_rank=cfg["rank"], runtime="flight", job=cfg["job"], job_address=cfg["address"],
                              token=cfg["token"], steps=cfg["steps"])
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        loader = plait.Loader(spec, dp_rank=cfg["rank"], runtime="ray", job=cfg["job"], attach=cfg["rank"] > 0,
                              address=cfg["address"], steps=cfg["steps"], max_cached_blocks=CACHED_BLOCKS,
                              **({"loaders": cfg["loaders"]} if cfg.get("loaders") else {}))
    return {"batches": sum(1 for _ in loader)}, loader


def measure_per_rank(spec_path, args) -> dict:
    cfgs = product.trainer_cfgs("per-rank", spec_path, args, workers=args.workers)
    procs, reports = product.run_trainers(MODULE, cfgs)
    try:
        trainers = product.added(reports)  # < 0: pages now shared with the workers
        forked = [product.mem(pid) for rep in reports for pid in rep["workers"]]
        roles = {"trainer": product.role(trainers), "worker": product.role(forked)}
        return {"total_rss": roles["trainer"]["rss"] + roles["worker"]["rss"],
                "total_pss": roles["trainer"]["pss"] + roles["worker"]["pss"], "roles": roles,
                "worker_rss_mean": float(np.mean([r for r, _ in forked])),
                "worker_pss_mean": float(np.mean([p for _, p in forked])),
                "workers_forked": all(r.get("forked", False) for r in reports),
                "batches": sum(r["batches"] for r in reports)}
    finally:
        product.finish(procs)


def measure_plait(spec_path, args) -> dict:
    """node: plait.cli.bench.memory's measurement; ray: the trainers are Ray drivers; flight, flight-local:
    a `plait serve` process (counted as plait's) serves thin trainers over Arrow Flight."""
    if args.client == "node":
        return product.measure_node(spec_path, args)
    ray = None if args.client == "flight-local" else init_ray()
    job, serve = f"bench-memory-{os.getpid()}", None
    try:
        address = None if ray is None else ray.get_runtime_context().gcs_address
        extra = {"job": job, "address": address, "loaders": args.loaders}
        if args.client != "ray":
            serve, flight_address, token = start_serve(spec_path, job, address, args.loaders, {
                **os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")})
            extra = {"job": job, "address": flight_address, "token": token}
        cfgs = product.trainer_cfgs("plait" if args.client == "ray" else "flight", spec_path, args, **extra)
        procs, reports = product.run_trainers(MODULE, cfgs)
        try:
            clients = product.added(reports)
            client_rss, client_pss = sum(r for r, _ in clients), sum(p for _, p in clients)
            serve_pid = None if serve is None else serve.pid
            actors, daemons = plait_processes({r["pid"] for r in reports}, serve_pid, product.mem)
            return {"total_rss": sum(r for v in actors.values() for r, _ in v) + client_rss,
                    "total_pss": sum(p for v in actors.values() for _, p in v) + client_pss,
                    "actors": {k: product.role(v) for k, v in actors.items()},
                    "roles": {**{k: product.role(v) for k, v in actors.items()}, "trainer": product.role(clients)},
                    "client_rss": client_rss, "client_rss_per_rank": client_rss / args.ranks,
                    "client_pss_per_rank": client_pss / args.ranks,
                    "daemons_rss": sum(r for v in daemons.values() for r, _ in v),
                    "daemons_pss": sum(p for v in daemons.values() for _, p in v),
                    "daemons": {k: {"count": len(v), "rss": sum(r for r, _ in v)} for k, v in daemons.items()},
                    "batches": sum(r["batches"] for r in reports)}
        finally:
            product.finish(procs)
    finally:
        if serve is not None:
            stop_serve(serve)
        if ray is not None:
            ray.shutdown()


def run(args) -> int:
    from rich.console import Console

    setups = {}
    if args.only != "plait":
        setups["per_rank"] = measure_per_rank
    if args.only != "per-rank":
        setups["plait"] = measure_plait
    result = product.measure(args, setups)
    result.update(workers_per_rank=args.workers, max_cached_blocks=CACHED_BLOCKS,
                  per_rank_start="fork")  # as a torch DataLoader starts its workers
    rows = []
    if "per_rank" in result:
        a = result["per_rank"]
        result["per_rank_total_bytes"] = a["total_rss"]
        rows.append(("per-rank loaders", f"{a['total_pss'] / MIB:,.0f}", f"{a['total_rss'] / MIB:,.0f}",
                     f"{args.ranks * args.workers} forked DataLoader workers, {a['worker_pss_mean'] / MIB:.0f} MiB "
                     f"PSS ({a['worker_rss_mean'] / MIB:.0f} RSS) each"))
    if "plait" in result:
        b = result["plait"]
        rows.append(product.plait_row(result))
        if "daemons" in b:  # the Ray and Flight layouts: Ray's own processes (the node layout runs none)
            rows.append(("Ray daemons (separate)", f"{b['daemons_pss'] / MIB:,.0f}", f"{b['daemons_rss'] / MIB:,.0f}",
                         ", ".join(f"{v['count']} {k}" for k, v in b["daemons"].items())))
    if "per_rank" in result and "plait" in result:
        a, b = result["per_rank"], result["plait"]
        assert a["batches"] == b["batches"], (a["batches"], b["batches"])
        result.update(ratio=a["total_rss"] / max(1, b["total_rss"]), ratio_pss=a["total_pss"] / max(1, b["total_pss"]))
        if "daemons" in b:
            result.update(ratio_with_daemons=a["total_rss"] / max(1, b["total_rss"] + b["daemons_rss"]),
                          ratio_pss_with_daemons=a["total_pss"] / max(1, b["total_pss"] + b["daemons_pss"]))
    product.report(result, rows, args.json)
    if "ratio" in result:
        daemons = (f"; {1 / result['ratio_pss_with_daemons']:.2f} by PSS ({1 / result['ratio_with_daemons']:.2f} by "
                   "RSS) with Ray's daemons" if "ratio_with_daemons" in result else "")
        Console().print(f"plait / per-rank: {1 / result['ratio_pss']:.2f} by PSS ({1 / result['ratio']:.2f} by RSS)"
                        + daemons)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--trainer":
        product.trainer(load)
    else:
        sys.exit(main(sys.modules[__name__]))
