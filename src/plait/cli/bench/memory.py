"""`plait bench memory`: resident memory of data loading for R ranks over S sources, per-rank vs plait.

Both setups stream the same spec (S pre-tokenized Parquet sources, equal weights, written to a temp
dir) for a job of R data-parallel ranks, each rank a real trainer process, with the same readers and
buffers per source (the same SourceLoader code and cache limits):

  per-rank  each trainer starts one worker process (spawned, as a torch DataLoader worker) that runs
            the local runtime over all S sources and hands the trainer its micro-batches by a queue.
  plait     the ray runtime: one Planner, the SourceLoaders and one Constructor per node are Ray
            actors; each trainer holds a plait.Loader attached to the job.

After every rank has consumed `--steps` steps (all processes still alive, holding their buffers) it
sums resident memory (psutil RSS; PSS alongside, which splits shared library pages fairly):
  per-rank total = every worker process + what the loader added to each trainer process
  plait total    = every plait actor process + what the client added to each trainer process
                   (importing and connecting Ray included)
Ray's own daemons (GCS, raylet, agents, idle workers) are reported separately; the ratio is given
without and with them. Only processes started by this benchmark are counted.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from plait.cli.bench import memory_realistic
from plait.cli.bench.memory_realistic import start_serve, stop_serve

CACHED_BLOCKS = 256  # decoded blocks a SourceLoader keeps, in both setups (the ray runtime's default)
HELP = "resident memory of data loading: per-rank loaders vs plait's ray runtime (S sources, R ranks)"
DESCRIPTION = __doc__


def add_arguments(p) -> None:
    p.add_argument("--sources", type=int, default=64, help="number of sources (S)")
    p.add_argument("--ranks", type=int, default=16, help="DP ranks, each a trainer process (R)")
    p.add_argument("--steps", type=int, default=6, help="global steps every rank consumes before measuring")
    p.add_argument("--block-mb", type=float, default=2.0, help="decoded size of one Parquet row group (a block)")
    p.add_argument("--files", type=int, default=2, help="files per source")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per micro-batch (default 2048; 8192 with --realistic)")
    p.add_argument("--workers", type=int, default=1,
                   help="per-rank: loader worker processes per rank (torch DataLoader num_workers; each holds "
                        "every source's state and serves every W-th step)")
    p.add_argument("--loaders", type=int, default=None, help="ray: SourceLoader actors (default: the runtime's)")
    p.add_argument("--only", choices=["per-rank", "plait"], default=None, help="measure one setup only")
    p.add_argument("--client", choices=["ray", "flight", "flight-local", "node"], default="ray",
                   help="plait's trainers: Ray drivers (plait.Loader runtime=ray) or thin clients over Arrow Flight "
                        "(runtime=flight, served by `plait serve`, no Ray in the trainers); flight-local: the thin "
                        "clients served by one `plait serve --runtime local` process (no Ray at all); node: the "
                        "local runtime as torchrun starts it (LOCAL_RANK 0's trainer hosts the node's data plane)")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")
    memory_realistic.add_arguments(p)


# ----- data -------------------------------------------------------------------------------------------
def make_sources(root: Path, sources: int, *, files: int = 2, row_groups: int = 2, block_mb: float = 2.0,
                 doc_len: int = 1024, seed: int = 0) -> list[dict]:
    """S folders of pre-tokenized Parquet (list<int32>); one row group decodes to about block_mb."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    docs = max(1, int(block_mb * 2**20 / 4 / doc_len))
    entries = []
    for s in range(sources):
        folder = root / f"src{s:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        for f in range(files):
            lengths = np.clip(rng.lognormal(np.log(doc_len), 0.6, size=docs * row_groups), 16, 16 * doc_len).astype(np.int64)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            flat = rng.integers(2, 32000, size=int(offsets[-1]), dtype=np.int32)
            col = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
            pq.write_table(pa.table({"input_ids": col}), folder / f"part-{f:03d}.parquet", row_group_size=docs,
                           compression="none")
        entries.append({"name": f"src{s:04d}", "path": str(folder / "*.parquet"), "tokens_field": "input_ids",
                        "eos": 1, "weight": 1.0})
    return entries


def make_spec_dict(root: Path, sources: int, ranks: int, *, seq_len: int = 2048, **data) -> dict:
    entries = make_sources(root, sources, **data)
    return {"sources": entries, "packing": {"seq_len": seq_len, "microbatches": 1}, "topology": {"dp": ranks},
            "cost": {"hidden": 1024, "layers": 8, "ffn": 4096, "heads": 8}, "seed": 0}


# ----- trainer processes ---------------------------------------------------------------------------------
def _rank_worker(spec_dict: dict, rank: int, steps: int, q, worker: int = 0, workers: int = 1) -> None:
    """A per-rank loader worker: the local runtime over every source, batches to the trainer by a queue.
    With W workers per rank (DataLoader style), worker k delivers the steps t with t % W == k."""
    from plait.runtime.local import LocalRuntime
    from plait.spec import load_spec

    rt = LocalRuntime(load_spec(spec_dict))
    rt.loader.max_cached_blocks = CACHED_BLOCKS  # the same cache limit as the ray runtime's loaders
    for _, mb in rt.iter_rank(rank, rt.state_dict(), 0, steps):
        if mb.step % workers == worker:
            q.put(mb)
    q.put(None)
    time.sleep(3600)  # keep the loader's state alive until measured (killed by the trainer)


def _trainer() -> None:
    """One trainer process (`python -m plait.cli.bench.memory --trainer JSON`): loads, reports, waits."""
    import psutil

    cfg = json.loads(sys.argv[2])
    import plait
    from plait.spec import load_spec

    spec = load_spec(cfg["spec"])
    me = psutil.Process()
    base = me.memory_full_info()
    workers: list = []
    if cfg["mode"] == "per-rank":
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        nw = int(cfg.get("workers", 1))
        queues = [ctx.Queue(maxsize=2) for _ in range(nw)]
        workers = [ctx.Process(target=_rank_worker, args=(cfg["spec"], cfg["rank"], cfg["steps"], queues[k], k, nw),
                               daemon=True) for k in range(nw)]
        for w in workers:
            w.start()
        n, live = 0, set(range(nw))
        while live:  # steps in order: step t comes from worker t % W
            for k in sorted(live):
                while True:
                    mb = queues[k].get()
                    if mb is None:
                        live.discard(k)
                        break
                    n += 1
                    if mb.microbatch == mb.num_microbatches - 1:
                        break
    elif cfg["mode"] == "node":  # torchrun's local processes: LOCAL_RANK 0 hosts the node's data plane
        os.environ.update(cfg["torchrun"])
        loader = plait.Loader(spec, dp_rank=cfg["rank"], steps=cfg["steps"])
        n = sum(1 for _ in loader)
    elif cfg["mode"] == "flight":
        loader = plait.Loader(spec, dp_rank=cfg["rank"], runtime="flight", job=cfg["job"], job_address=cfg["address"],
                              token=cfg["token"], steps=cfg["steps"])
        n = sum(1 for _ in loader)
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        loader = plait.Loader(spec, dp_rank=cfg["rank"], runtime="ray", job=cfg["job"], attach=cfg["rank"] > 0,
                              address=cfg["address"],
                              steps=cfg["steps"], max_cached_blocks=CACHED_BLOCKS,
                              **({"loaders": cfg["loaders"]} if cfg.get("loaders") else {}))
        n = sum(1 for _ in loader)
    print(json.dumps({"pid": os.getpid(), "workers": [w.pid for w in workers], "batches": n,
                      "base_rss": base.rss, "base_pss": base.pss}), flush=True)
    sys.stdin.readline()  # the harness measures, then tells us to go
    for w in workers:
        w.kill()
    if cfg["mode"] != "per-rank":
        loader.close()


def _mem(pid: int) -> tuple[int, int]:
    import psutil

    try:
        m = psutil.Process(pid).memory_full_info()
        return m.rss, m.pss
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0, 0


def _run_trainers(mode: str, spec_dict: dict, ranks: int, steps: int, extra: dict) -> tuple[list, list]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run_id = f"bench-memory-{os.getpid()}"
    cfgs = [{"mode": mode, "spec": spec_dict, "rank": r, "steps": steps, **extra,
             **({"torchrun": memory_realistic.torchrun_env(r, ranks, run_id)} if mode == "node" else {})}
            for r in range(ranks)]
    return memory_realistic.start_trainers("plait.cli.bench.memory", cfgs, env)


def measure_per_rank(spec_dict: dict, ranks: int, steps: int, workers: int = 1) -> dict:
    procs, reports = _run_trainers("per-rank", spec_dict, ranks, steps, {"workers": workers})
    try:
        rss = pss = 0
        workers = []
        for rep in reports:
            t_rss, t_pss = _mem(rep["pid"])
            w_rss = w_pss = 0
            for pid in rep["workers"]:
                r_, p_ = _mem(pid)
                w_rss, w_pss = w_rss + r_, w_pss + p_
                workers.append(r_)
            rss += max(0, t_rss - rep["base_rss"]) + w_rss
            pss += max(0, t_pss - rep["base_pss"]) + w_pss
        return {"total_rss": rss, "total_pss": pss, "worker_rss_mean": float(np.mean(workers)),
                "batches": sum(r["batches"] for r in reports)}
    finally:
        memory_realistic.finish(procs)


def measure_plait(spec_dict: dict, ranks: int, steps: int, loaders: int | None, client: str = "ray") -> dict:
    """`client` ray: trainers are Ray drivers; flight: a `plait serve` process (counted as plait's) serves
    thin trainers over Arrow Flight."""
    import psutil

    if client == "node":
        return measure_node(spec_dict, ranks, steps)
    ray = None
    if client != "flight-local":  # flight-local: one `plait serve --runtime local` process, no Ray at all
        import ray

        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, namespace="plait",
                 log_to_driver=False, configure_logging=False)
    job = f"bench-memory-{os.getpid()}"
    serve = None
    try:
        address = None if ray is None else ray.get_runtime_context().gcs_address
        if client in ("flight", "flight-local"):
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump(spec_dict, f)
            serve, flight_address, token = start_serve(Path(f.name), job, address, loaders,
                                                       {**os.environ, "OMP_NUM_THREADS": "1",
                                                        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")})
            extra = {"job": job, "address": flight_address, "token": token}
        else:
            extra = {"job": job, "address": address, "loaders": loaders}
        procs, reports = _run_trainers("plait" if client == "ray" else "flight", spec_dict, ranks, steps, extra)
        try:
            trainer_pids = {r["pid"] for r in reports}
            client_rss = client_pss = 0
            for rep in reports:
                t_rss, t_pss = _mem(rep["pid"])
                client_rss += max(0, t_rss - rep["base_rss"])
                client_pss += max(0, t_pss - rep["base_pss"])
            actors: dict[str, list[int]] = {}
            daemons: dict[str, list[int]] = {}
            for child in psutil.Process().children(recursive=True):
                if child.pid in trainer_pids:
                    continue
                try:
                    cmd = " ".join(child.cmdline())
                except psutil.Error:
                    continue
                role = "serve" if serve is not None and child.pid == serve.pid else \
                    next((r for r in ("PlannerActor", "LoaderActor", "ConstructorActor") if f"ray::{r}" in cmd), None)
                rss, pss = _mem(child.pid)
                if role:
                    actors.setdefault(role, []).append((rss, pss))
                else:
                    name = os.path.basename(cmd.split()[0]) if cmd else "?"
                    if "ray::" in cmd:
                        name = "worker (idle/other)"
                    elif "dashboard" in cmd or "agent" in cmd:
                        name = "agents"
                    daemons.setdefault(name, []).append((rss, pss))
            actor_rss = sum(r for v in actors.values() for r, _ in v)
            actor_pss = sum(p for v in actors.values() for _, p in v)
            return {
                "total_rss": actor_rss + client_rss, "total_pss": actor_pss + client_pss,
                "actors": {k: {"count": len(v), "rss": sum(r for r, _ in v), "pss": sum(p for _, p in v)}
                           for k, v in actors.items()},
                "client_rss": client_rss, "client_rss_per_rank": client_rss / ranks,
                "daemons_rss": sum(r for v in daemons.values() for r, _ in v),
                "daemons_pss": sum(p for v in daemons.values() for _, p in v),
                "daemons": {k: {"count": len(v), "rss": sum(r for r, _ in v)} for k, v in daemons.items()},
                "batches": sum(r["batches"] for r in reports),
            }
        finally:
            memory_realistic.finish(procs)
    finally:
        if serve is not None:
            stop_serve(serve)
            os.unlink(f.name)
        if ray is not None:
            ray.shutdown()


def measure_node(spec_dict: dict, ranks: int, steps: int) -> dict:
    """plait's local runtime as torchrun starts it: LOCAL_RANK 0's trainer hosts the node's data plane,
    every trainer reads over Flight on loopback; no Ray, no other process."""
    procs, reports = _run_trainers("node", spec_dict, ranks, steps, {})
    try:
        added = [(max(0, r_ - rep["base_rss"]), max(0, p_ - rep["base_pss"]))
                 for rep in reports for r_, p_ in [_mem(rep["pid"])]]
        host_rss, host_pss = added[0]
        client_rss = sum(a for a, _ in added[1:])
        return {"total_rss": sum(a for a, _ in added), "total_pss": sum(p for _, p in added),
                "actors": {"host trainer (LOCAL_RANK 0)": {"count": 1, "rss": host_rss, "pss": host_pss}},
                "client_rss": client_rss, "client_rss_per_rank": client_rss / max(1, ranks - 1),
                "daemons_rss": 0, "daemons_pss": 0, "daemons": {},
                "batches": sum(r["batches"] for r in reports)}
    finally:
        memory_realistic.finish(procs)


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    if args.realistic:
        args.seq_len = args.seq_len or 8192
        return memory_realistic.run(args)
    args.seq_len = args.seq_len or 2048
    console = Console()
    mb = 2**20
    with tempfile.TemporaryDirectory(prefix="plait-bench-memory-") as tmp:
        t0 = time.perf_counter()
        spec_dict = make_spec_dict(Path(tmp), args.sources, args.ranks, seq_len=args.seq_len, files=args.files,
                                   block_mb=args.block_mb)
        console.print(f"{args.sources} sources written in {time.perf_counter() - t0:.1f} s; "
                      f"{args.ranks} trainer processes per setup, {args.steps} steps each")
        result: dict = {"sources": args.sources, "ranks": args.ranks, "steps": args.steps, "block_mb": args.block_mb,
                        "workers_per_rank": args.workers, "max_cached_blocks": CACHED_BLOCKS, "client": args.client}
        if args.only != "plait":
            a = measure_per_rank(spec_dict, args.ranks, args.steps, args.workers)
            result["per_rank"] = a
            result["per_rank_total_bytes"] = a["total_rss"]
        if args.only != "per-rank":
            b = measure_plait(spec_dict, args.ranks, args.steps, args.loaders, args.client)
            result["plait"] = b
            result["plait_total_bytes"] = b["total_rss"]
            result["ray_daemons_bytes"] = b["daemons_rss"]
    if "per_rank" in result and "plait" in result:
        a, b = result["per_rank"], result["plait"]
        result["ratio"] = a["total_rss"] / max(1, b["total_rss"])
        result["ratio_with_daemons"] = a["total_rss"] / max(1, b["total_rss"] + b["daemons_rss"])
        result["ratio_pss"] = a["total_pss"] / max(1, b["total_pss"])
        result["ratio_pss_with_daemons"] = a["total_pss"] / max(1, b["total_pss"] + b["daemons_pss"])
        assert a["batches"] == b["batches"], (a["batches"], b["batches"])
    table = Table(title=f"data-loading memory, {args.sources} sources x {args.ranks} ranks")
    for col in ("what", "RSS MiB", "PSS MiB", "note"):
        table.add_column(col, justify="left" if col in ("what", "note") else "right")
    if "per_rank" in result:
        a = result["per_rank"]
        table.add_row("per-rank loaders", f"{a['total_rss'] / mb:,.0f}", f"{a['total_pss'] / mb:,.0f}",
                      f"{args.ranks * args.workers} workers, {a['worker_rss_mean'] / mb:.0f} MiB RSS each")
    if "plait" in result:
        b = result["plait"]
        roles = ", ".join(f"{v['count']} {k.replace('Actor', '')} {v['rss'] / mb:.0f} MiB"
                          for k, v in sorted(b["actors"].items()))
        setup = {"flight-local": "one-process server, flight client",
                 "node": "local runtime, one data plane per node"}.get(args.client, f"ray runtime, {args.client} client")
        table.add_row(f"plait ({setup})", f"{b['total_rss'] / mb:,.0f}", f"{b['total_pss'] / mb:,.0f}",
                      f"{roles}; client {b['client_rss_per_rank'] / mb:.0f} MiB/rank")
        table.add_row("Ray daemons (separate)", f"{b['daemons_rss'] / mb:,.0f}", f"{b['daemons_pss'] / mb:,.0f}",
                      ", ".join(f"{v['count']} {k}" for k, v in b["daemons"].items()))
    console.print(table)
    if "ratio" in result:
        console.print(f"ratio per-rank / plait: {result['ratio']:.1f}x RSS ({result['ratio_pss']:.1f}x PSS) without "
                      f"Ray's daemons; {result['ratio_with_daemons']:.1f}x RSS "
                      f"({result['ratio_pss_with_daemons']:.1f}x PSS) with them")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--trainer":
        _trainer()
    else:  # pragma: no cover
        import argparse

        parser = argparse.ArgumentParser()
        add_arguments(parser)
        sys.exit(run(parser.parse_args()))
