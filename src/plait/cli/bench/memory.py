"""`plait bench memory`: memory of data loading for R ranks over S sources, per-rank vs plait, by PSS and RSS.

Both setups stream the same spec (S pre-tokenized Parquet sources, equal weights, written to a temp
dir) for a job of R data-parallel ranks, each rank a real trainer process with torch imported, with the
same readers and buffers per source (the same SourceLoader code and cache limits):

  per-rank  each trainer iterates a torch DataLoader (multiprocessing_context "fork", persistent
            workers: what users run) whose W workers each run the local runtime over all S sources.
  plait     --client node: the local runtime as torchrun starts it (LOCAL_RANK 0's trainer hosts the
            node's data plane); ray/flight/flight-local: the job's own processes (actors, `plait serve`).

Every trainer first imports torch and waits until all have; the harness then takes each one's baseline
(so shared library pages are split the same way at baseline and at measurement), and after every rank
has consumed `--steps` steps (all processes still alive, holding their buffers) it sums, per role:
  per-rank  (trainer + its forked workers) - the trainer's baseline
  plait     what each trainer added over its baseline + every plait process (actors, server)
PSS splits a page shared by n processes n ways: a forked worker's pages shared with its trainer count
once, where RSS counts them in both (so the ratio by PSS comes first). Ray's own daemons (GCS, raylet,
agents, idle workers) are reported separately. Only processes started by this benchmark are counted.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from plait.cli.bench.processes import finish, start_serve, start_trainers, stop_serve, torchrun_env

CACHED_BLOCKS = 256  # decoded blocks a SourceLoader keeps, in both setups (the ray runtime's default)
HELP = "resident memory of data loading: per-rank loaders vs plait's ray runtime (S sources, R ranks)"
DESCRIPTION = __doc__


def add_arguments(p) -> None:
    p.add_argument("--sources", type=int, default=64, help="number of sources (S)")
    p.add_argument("--ranks", type=int, default=16, help="DP ranks, each a trainer process (R)")
    p.add_argument("--steps", type=int, default=6, help="global steps every rank consumes before measuring")
    p.add_argument("--block-mb", type=float, default=2.0, help="decoded size of one Parquet row group (a block)")
    p.add_argument("--files", type=int, default=2, help="files per source")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per micro-batch")
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
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")
    p.add_argument("--data", metavar="DIR", help="keep the sources in DIR and reuse them when it holds them already "
                   "(the same --sources/--files/--block-mb: 1,000 sources take minutes to write)")


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
def _per_rank_loader(spec_dict: dict, rank: int, steps: int, workers: int):
    """The per-rank baseline: a torch DataLoader as users start it (forked, persistent workers), each
    worker running the local runtime over every source; worker k delivers the steps t with t % W == k.
    A worker keeps its runtime (every source's state and buffers) until it is killed, so it is measured
    holding them."""
    import torch.utils.data as tud

    from plait.runtime.local import LocalRuntime
    from plait.spec import load_spec

    class PerRankSteps(tud.IterableDataset):
        def __iter__(self):
            info = tud.get_worker_info()
            worker, count = (info.id, info.num_workers) if info is not None else (0, 1)
            self.runtime = LocalRuntime(load_spec(spec_dict))
            self.runtime.loader.max_cached_blocks = CACHED_BLOCKS  # the ray runtime's loaders' cache limit
            for _, mb in self.runtime.iter_rank(rank, self.runtime.state_dict(), 0, steps):
                if mb.step % count == worker:
                    yield mb

    return tud.DataLoader(PerRankSteps(), batch_size=None, num_workers=workers, multiprocessing_context="fork",
                          persistent_workers=True)


def _trainer() -> None:
    """One trainer process (`python -m plait.cli.bench.memory --trainer JSON`): imports torch, says ready,
    waits for the harness to take its baseline, loads, reports, waits to be measured."""
    import psutil
    import torch

    torch.zeros(1)
    cfg = json.loads(sys.argv[2])
    cfg["spec"] = json.loads(Path(cfg.pop("spec_path")).read_text())
    print(json.dumps({"pid": os.getpid()}), flush=True)
    sys.stdin.readline()  # every trainer's baseline taken
    import plait
    from plait.spec import load_spec

    spec = load_spec(cfg["spec"])
    workers: list = []
    if cfg["mode"] == "per-rank":
        loader = _per_rank_loader(cfg["spec"], cfg["rank"], cfg["steps"], int(cfg.get("workers", 1)))
        n = sum(1 for _ in loader)
        me = psutil.Process()
        children = me.children()  # the DataLoader's workers, alive (persistent) with their state
        workers = [c.pid for c in children]
        forked = all(c.cmdline() == me.cmdline() for c in children)  # a spawned worker runs another command
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
    print(json.dumps({"pid": os.getpid(), "workers": workers, "batches": n,
                      **({"forked": forked} if workers else {})}), flush=True)
    sys.stdin.readline()  # the harness measures, then tells us to go
    if cfg["mode"] != "per-rank":  # a DataLoader stops its workers when it is collected
        loader.close()


def _mem(pid: int) -> tuple[int, int]:
    import psutil

    try:
        m = psutil.Process(pid).memory_full_info()
        return m.rss, m.pss
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0, 0


def _maps(pid: int) -> dict[str, int]:
    """A process's PSS by kind of mapping, bytes: anonymous (heap, malloc arenas, Arrow's allocator),
    shared-memory segments (/dev/shm) and files (libraries, memory-mapped data)."""
    import psutil

    kinds = {"anonymous": 0, "shm": 0, "files": 0}
    try:
        for m in psutil.Process(pid).memory_maps(grouped=True):
            path = m.path or ""
            kind = "shm" if path.startswith("/dev/shm") else "files" if path.startswith("/") else "anonymous"
            kinds[kind] += m.pss
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass
    return kinds


def _run_trainers(mode: str, spec_dict: dict, ranks: int, steps: int, extra: dict) -> tuple[list, list]:
    """Starts the trainers; once all have imported torch takes each one's baseline (base_rss, base_pss in
    its report), lets them load, and returns them with their reports (they wait for `finish`)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run_id = f"bench-memory-{os.getpid()}"
    spec_path = Path(spec_dict["sources"][0]["path"]).parent.parent / f"spec-{mode}.json"  # 1,000 sources: too
    spec_path.write_text(json.dumps(spec_dict))  # long for a command line
    cfgs = [{"mode": mode, "spec_path": str(spec_path), "rank": r, "steps": steps, **extra,
             **({"torchrun": torchrun_env(r, ranks, run_id)} if mode == "node" else {})}
            for r in range(ranks)]
    procs, ready = start_trainers("plait.cli.bench.memory", cfgs, env)
    bases = [_mem(r["pid"]) for r in ready]
    first_maps = _maps(ready[0]["pid"])  # the node's host (LOCAL_RANK 0) where there is one
    reports = []
    try:
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for cfg, p, (base_rss, base_pss) in zip(cfgs, procs, bases):
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"a {cfg['mode']} trainer failed (exit {p.wait()})")
            reports.append({**json.loads(line), "base_rss": base_rss, "base_pss": base_pss,
                            **({"base_maps": first_maps} if not reports else {})})
    except BaseException:
        finish(procs)
        raise
    return procs, reports


def _role(sizes: list[tuple[int, int]]) -> dict:
    """A role's processes (or what they added): count and summed RSS and PSS, bytes."""
    return {"count": len(sizes), "rss": int(sum(r for r, _ in sizes)), "pss": int(sum(p for _, p in sizes))}


def measure_per_rank(spec_dict: dict, ranks: int, steps: int, workers: int = 1) -> dict:
    procs, reports = _run_trainers("per-rank", spec_dict, ranks, steps, {"workers": workers})
    try:
        trainers, forked = [], []
        for rep in reports:
            t_rss, t_pss = _mem(rep["pid"])
            trainers.append((t_rss - rep["base_rss"], t_pss - rep["base_pss"]))  # < 0: pages now shared with workers
            forked += [_mem(pid) for pid in rep["workers"]]
        roles = {"trainer": _role(trainers), "worker": _role(forked)}
        return {"total_rss": roles["trainer"]["rss"] + roles["worker"]["rss"],
                "total_pss": roles["trainer"]["pss"] + roles["worker"]["pss"], "roles": roles,
                "worker_rss_mean": float(np.mean([r for r, _ in forked])),
                "worker_pss_mean": float(np.mean([p for _, p in forked])),
                "workers_forked": all(r.get("forked", False) for r in reports),
                "batches": sum(r["batches"] for r in reports)}
    finally:
        finish(procs)


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
            clients = [(r_ - rep["base_rss"], p_ - rep["base_pss"]) for rep in reports for r_, p_ in [_mem(rep["pid"])]]
            client_rss, client_pss = sum(r for r, _ in clients), sum(p for _, p in clients)
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
                "actors": {k: _role(v) for k, v in actors.items()},
                "roles": {**{k: _role(v) for k, v in actors.items()}, "trainer": _role(clients)},
                "client_rss": client_rss, "client_rss_per_rank": client_rss / ranks,
                "client_pss_per_rank": client_pss / ranks,
                "daemons_rss": sum(r for v in daemons.values() for r, _ in v),
                "daemons_pss": sum(p for v in daemons.values() for _, p in v),
                "daemons": {k: {"count": len(v), "rss": sum(r for r, _ in v)} for k, v in daemons.items()},
                "batches": sum(r["batches"] for r in reports),
            }
        finally:
            finish(procs)
    finally:
        if serve is not None:
            stop_serve(serve)
            os.unlink(f.name)
        if ray is not None:
            ray.shutdown()


def measure_node(spec_dict: dict, ranks: int, steps: int) -> dict:
    """plait's local runtime as torchrun starts it: LOCAL_RANK 0's trainer hosts the node's data plane,
    every trainer reads from it; no Ray, no other process."""
    procs, reports = _run_trainers("node", spec_dict, ranks, steps, {})
    try:
        added = [(r_ - rep["base_rss"], p_ - rep["base_pss"]) for rep in reports for r_, p_ in [_mem(rep["pid"])]]
        host, clients = _role(added[:1]), _role(added[1:])
        now = _maps(reports[0]["pid"])
        host["pss_by_mapping"] = {k: now[k] - reports[0]["base_maps"][k] for k in now}  # what the host added
        return {"total_rss": host["rss"] + clients["rss"], "total_pss": host["pss"] + clients["pss"],
                "actors": {"host trainer (LOCAL_RANK 0)": host},
                "roles": {"host": host, "rank": clients},
                "client_rss": clients["rss"], "client_rss_per_rank": clients["rss"] / max(1, ranks - 1),
                "client_pss_per_rank": clients["pss"] / max(1, ranks - 1),
                "daemons_rss": 0, "daemons_pss": 0, "daemons": {},
                "batches": sum(r["batches"] for r in reports)}
    finally:
        finish(procs)


def _spec_in(folder: Path, args) -> dict:
    """The bench's spec over sources in `folder`, written there unless a run with the same data wrote them."""
    data = {"sources": args.sources, "files": args.files, "block_mb": args.block_mb}
    done = folder / "sources.json"
    if done.exists() and json.loads(done.read_text())["data"] == data:
        entries = json.loads(done.read_text())["entries"]
    else:
        folder.mkdir(parents=True, exist_ok=True)
        entries = make_sources(folder, args.sources, files=args.files, block_mb=args.block_mb)
        done.write_text(json.dumps({"data": data, "entries": entries}))
    return {"sources": entries, "packing": {"seq_len": args.seq_len, "microbatches": 1},
            "topology": {"dp": args.ranks}, "cost": {"hidden": 1024, "layers": 8, "ffn": 4096, "heads": 8}, "seed": 0}


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    mb = 2**20
    with tempfile.TemporaryDirectory(prefix="plait-bench-memory-") as tmp:
        t0 = time.perf_counter()
        spec_dict = _spec_in(Path(args.data) if args.data else Path(tmp), args)
        console.print(f"{args.sources} sources written in {time.perf_counter() - t0:.1f} s; "
                      f"{args.ranks} trainer processes per setup, {args.steps} steps each")
        result: dict = {"sources": args.sources, "ranks": args.ranks, "steps": args.steps, "block_mb": args.block_mb,
                        "workers_per_rank": args.workers, "max_cached_blocks": CACHED_BLOCKS, "client": args.client,
                        "per_rank_start": "fork"}  # as a torch DataLoader starts its workers
        if args.only != "plait":
            a = measure_per_rank(spec_dict, args.ranks, args.steps, args.workers)
            result["per_rank"] = a
            result["per_rank_total_bytes"] = a["total_rss"]
        if args.only != "per-rank":
            b = measure_plait(spec_dict, args.ranks, args.steps, args.loaders, args.client)
            result["plait"] = b
            result["plait_total_bytes"] = b["total_rss"]
            result["ray_daemons_bytes"] = b["daemons_rss"]
            if args.client == "node":
                result["host_pss_mib"] = b["roles"]["host"]["pss"] / 2**20
                result["host_rss_mib"] = b["roles"]["host"]["rss"] / 2**20
                result["host_pss_by_mapping_mib"] = {k: v / 2**20 for k, v in b["roles"]["host"]["pss_by_mapping"].items()}
    if "per_rank" in result and "plait" in result:
        a, b = result["per_rank"], result["plait"]
        result["ratio"] = a["total_rss"] / max(1, b["total_rss"])
        result["ratio_with_daemons"] = a["total_rss"] / max(1, b["total_rss"] + b["daemons_rss"])
        result["ratio_pss"] = a["total_pss"] / max(1, b["total_pss"])
        result["ratio_pss_with_daemons"] = a["total_pss"] / max(1, b["total_pss"] + b["daemons_pss"])
        assert a["batches"] == b["batches"], (a["batches"], b["batches"])
    table = Table(title=f"data-loading memory, {args.sources} sources x {args.ranks} ranks")
    for col in ("what", "PSS MiB", "RSS MiB", "note"):
        table.add_column(col, justify="left" if col in ("what", "note") else "right")
    if "per_rank" in result:
        a = result["per_rank"]
        table.add_row("per-rank loaders", f"{a['total_pss'] / mb:,.0f}", f"{a['total_rss'] / mb:,.0f}",
                      f"{args.ranks * args.workers} forked DataLoader workers, {a['worker_pss_mean'] / mb:.0f} MiB "
                      f"PSS ({a['worker_rss_mean'] / mb:.0f} RSS) each")
    if "plait" in result:
        b = result["plait"]
        roles = ", ".join(f"{v['count']} {k.replace('Actor', '')} {v['rss'] / mb:.0f} MiB"
                          for k, v in sorted(b["actors"].items()))
        setup = {"flight-local": "one-process server, flight client",
                 "node": "local runtime, one data plane per node"}.get(args.client, f"ray runtime, {args.client} client")
        table.add_row(f"plait ({setup})", f"{b['total_pss'] / mb:,.0f}", f"{b['total_rss'] / mb:,.0f}",
                      f"{roles}; client {b['client_pss_per_rank'] / mb:.0f} MiB PSS "
                      f"({b['client_rss_per_rank'] / mb:.0f} RSS)/rank")
        table.add_row("Ray daemons (separate)", f"{b['daemons_pss'] / mb:,.0f}", f"{b['daemons_rss'] / mb:,.0f}",
                      ", ".join(f"{v['count']} {k}" for k, v in b["daemons"].items()))
    console.print(table)
    if "ratio" in result:
        console.print(f"plait / per-rank: {1 / result['ratio_pss']:.2f} by PSS ({1 / result['ratio']:.2f} by RSS) "
                      f"without Ray's daemons, {1 / result['ratio_pss_with_daemons']:.2f} by PSS "
                      f"({1 / result['ratio_with_daemons']:.2f} by RSS) with them")
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
