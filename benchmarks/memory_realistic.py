"""`python -m benchmarks.memory_realistic`: the memory plait adds to a real training set-up, at 4 and 64 sources.

Set-up (the issue's): T trainer processes (default 8, one per DP rank), each with torch imported, read
pre-tokenized Parquet whose row groups decode to 16-64 MiB, and each consumes `--microbatches`
micro-batches of `--seq-len` tokens (default 200 of 8,192). Measured per runtime:

  local   each trainer runs plait.Loader(spec, rank) as torchrun starts it (LOCAL_RANK, LOCAL_WORLD_SIZE set):
          LOCAL_RANK 0's trainer hosts the node's one data plane and every trainer reads from it over
          Flight on loopback (plait.runtime.node_share)
  local-process  the same with share="process": every trainer plans the step and buffers every source
  flight  one `plait serve` job on Ray (Planner, SourceLoaders, a Constructor) serves the trainers, which
          use plait.Loader(spec, rank, runtime="flight") and never import Ray
  flight-local  the same thin trainers, served by one `plait serve --runtime local` process (no Ray at all)

What plait adds = sum over trainers of (RSS after the run - RSS of the same process idle with torch
imported, before plait is imported) + every plait process (the serve driver and the job's actors);
Ray's daemons (GCS, raylet, agents, idle workers) are reported apart. Each trainer also reports the
largest decoded buffer its local loader held (sampled every step).

Data: `--distinct` distinct files (2 row groups each, sizes spread over 16-64 MiB decoded) are written
once; each source is a folder of symlinks to two of them (a source's order is its own: sharing bytes on
disk changes nothing for plait), so 64 sources cost the disk of `--distinct` files. Removed at the end.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import main
from benchmarks.processes import init_ray, plait_processes, start_serve, stop_serve
from plait.cli.bench.memory import finish, start_trainers, torchrun_env

HELP = "memory plait adds to 8 torch trainers at 4 and 64 sources of 16-64 MiB row groups, per runtime"
DESCRIPTION = __doc__
ROOT = Path(__file__).resolve().parents[1]  # trainers run `python -m benchmarks.memory_realistic` from here
MIB = 2**20


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="a small version (CI; ~10 s on the local runtime)")
    p.add_argument("--trainers", type=int, default=8, help="trainer processes (DP ranks)")
    p.add_argument("--source-counts", default="4,64", help="comma-separated numbers of sources")
    p.add_argument("--microbatches", type=int, default=200, help="micro-batches each trainer consumes")
    p.add_argument("--runtimes", default="local,flight",
                   help="comma-separated: local (one data plane per node, as under torchrun), local-process (every "
                        "trainer its own loader), flight (served on Ray), flight-local (`plait serve --runtime local`)")
    p.add_argument("--row-group-mb", default="16,64", help="decoded row-group sizes: smallest,largest (MiB)")
    p.add_argument("--distinct", type=int, default=6, help="distinct Parquet files written (disk use)")
    p.add_argument("--buffer-mb", type=float, default=None, help="every source's buffer_mb (default: the spec's)")
    p.add_argument("--max-buffer-mb", type=float, default=None,
                   help="the job-wide cap loading.max_buffer_mb (default: the spec's)")
    p.add_argument("--seq-len", type=int, default=8192, help="tokens per micro-batch")
    p.add_argument("--loaders", type=int, default=None, help="flight: SourceLoader actors (default 1)")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")


def quick(args) -> None:
    """The CI size: 2 trainers, 8 sources of 8-16 MiB row groups, 20 micro-batches of 2,048 tokens (one
    source count: each run starts its trainers, torch and all, ~2.5 s of CPU each)."""
    args.trainers, args.source_counts, args.microbatches = 2, "8", 20
    args.row_group_mb, args.distinct, args.seq_len = "8,16", 2, 2048


# ----- data ------------------------------------------------------------------------------------------
def write_files(root: Path, distinct: int, smallest: float, largest: float, seed: int = 0) -> list[Path]:
    """`distinct` Parquet files of list<int32> token documents, 2 row groups each, decoded sizes spread
    evenly over [smallest, largest] MiB."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    sizes = np.linspace(smallest, largest, 2 * distinct)
    rng.shuffle(sizes)
    paths = []
    for f in range(distinct):
        groups = []
        for mb in sizes[2 * f:2 * f + 2]:
            tokens = int(mb * MIB / 4)
            lengths = np.clip(rng.lognormal(np.log(1500), 0.9, size=tokens // 1000 + 16), 16, 32768).astype(np.int64)
            lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), tokens)) + 1]
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            flat = rng.integers(2, 50000, size=int(offsets[-1]), dtype=np.int32)
            groups.append(pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))}))
        path = root / f"data-{f:02d}.parquet"
        with pq.ParquetWriter(path, groups[0].schema, compression="none") as w:
            for t in groups:
                w.write_table(t, row_group_size=len(t))
        paths.append(path)
    return paths


def make_spec(root: Path, files: list[Path], sources: int, trainers: int, seq_len: int, microbatches: int,
              buffer_mb: float | None, max_buffer_mb: float | None = None) -> dict:
    entries = []
    for s in range(sources):
        folder = root / f"s{sources}" / f"src{s:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        for k, f in enumerate((files[s % len(files)], files[(s + 1) % len(files)])):
            link = folder / f"part-{k}.parquet"
            if not link.exists():  # the same sources serve every runtime measured
                link.symlink_to(f)
        entries.append({"name": f"src{s:03d}", "path": str(folder / "*.parquet"), "tokens_field": "input_ids",
                        "eos": 1, "weight": 1.0, **({} if buffer_mb is None else {"buffer_mb": buffer_mb})})
    return {"sources": entries, "packing": {"seq_len": seq_len, "microbatches": 1}, "topology": {"dp": trainers},
            "cost": {"hidden": 2048, "layers": 16, "ffn": 5632, "heads": 16}, "seed": 0, "steps": microbatches,
            **({} if max_buffer_mb is None else {"loading": {"max_buffer_mb": max_buffer_mb}})}


# ----- processes -------------------------------------------------------------------------------------
def process_memory(pid: int) -> int:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0


def run_trainers(cfg: dict, trainers: int, env: dict, torchrun_id: str | None = None) -> tuple[list, list]:
    """One trainer per rank; with `torchrun_id`, each sees the environment torchrun would give it."""
    cfgs = [{**cfg, "rank": r, **({} if torchrun_id is None else {"torchrun": torchrun_env(r, trainers, torchrun_id)})}
            for r in range(trainers)]
    return start_trainers("benchmarks.memory_realistic", cfgs, env)


def _trainer() -> None:
    """A trainer (`python -m benchmarks.memory_realistic --trainer JSON`): torch imported, then plait;
    consumes its micro-batches as torch tensors; reports its RSS before plait and its loader's buffer."""
    import psutil
    import torch

    cfg = json.loads(sys.argv[2])
    torch.zeros(1)
    idle = psutil.Process().memory_info().rss
    import plait

    if cfg["runtime"] in ("flight", "flight-local"):
        loader = plait.Loader(cfg["spec"], dp_rank=cfg["rank"], runtime="flight", job=cfg["job"],
                              address=cfg["address"], token=cfg["token"])
    else:
        os.environ.update(cfg.get("torchrun") or {})
        loader = plait.Loader(cfg["spec"], dp_rank=cfg["rank"],
                              share="process" if cfg["runtime"] == "local-process" else "auto")
    source_loader = getattr(loader.runtime, "loader", None)  # where this trainer holds sources (local; host)
    n = tokens = peak_buffer = 0
    for batch in loader:
        tokens += int(batch.to_torch()["input_ids"].numel())
        n += 1
        if source_loader is not None:
            peak_buffer = max(peak_buffer, source_loader.cached_bytes)
    over = None if source_loader is None else source_loader.buffer_over_budget
    print(json.dumps({"pid": os.getpid(), "idle_rss": idle, "batches": n, "tokens": tokens,
                      "peak_buffer": peak_buffer, "over_budget": over, "ray_imported": "ray" in sys.modules}),
          flush=True)
    sys.stdin.readline()  # measured: go
    loader.close()


def measure(spec_dict: dict, root: Path, runtime: str, trainers: int, loaders: int | None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if runtime in ("local", "local-process"):
        procs, reports = run_trainers({"runtime": runtime, "spec": spec_dict}, trainers, env,
                                      torchrun_id=f"bench-{os.getpid()}-{len(spec_dict['sources'])}")
        try:
            return _summary(reports, {}, {})
        finally:
            finish(procs)
    ray = init_ray() if runtime == "flight" else None
    serve = None
    try:
        spec_path = root / f"spec-{len(spec_dict['sources'])}.json"
        spec_path.write_text(json.dumps(spec_dict))
        job = f"bench-memory-{os.getpid()}-{len(spec_dict['sources'])}"
        ray_address = None if ray is None else ray.get_runtime_context().gcs_address
        serve, address, token = start_serve(spec_path, job, ray_address, loaders, env)
        procs, reports = run_trainers({"runtime": "flight", "spec": spec_dict, "job": job, "address": address,
                                       "token": token}, trainers, env)
        try:
            roles, daemons = plait_processes({r["pid"] for r in reports}, serve.pid, process_memory)
            return _summary(reports, roles, daemons)
        finally:
            finish(procs)
    finally:
        if serve is not None:
            stop_serve(serve)
        if ray is not None:
            ray.shutdown()


def _summary(reports: list[dict], roles: dict, daemons: dict) -> dict:
    added = [max(0, process_memory(r["pid"]) - r["idle_rss"]) for r in reports]
    processes = sum(sum(v) for v in roles.values())
    return {"trainer_added": int(sum(added)), "trainer_added_per_rank": int(np.mean(added)),
            "trainer_added_each": [int(a) for a in added],
            "plait_processes": int(processes), "total": int(sum(added) + processes),
            "roles": {k: {"count": len(v), "rss": int(sum(v))} for k, v in roles.items()},
            "ray_daemons": int(sum(sum(v) for v in daemons.values())),
            "peak_buffer_per_rank": int(max(r["peak_buffer"] for r in reports)),
            "over_budget": [r["over_budget"] for r in reports if r["over_budget"] is not None],  # loaders' only
            "batches": sum(r["batches"] for r in reports),
            "tokens": sum(r["tokens"] for r in reports), "ray_imported": any(r["ray_imported"] for r in reports)}


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    if args.quick:
        quick(args)
    console = Console()
    counts = [int(c) for c in args.source_counts.split(",")]
    runtimes = [r.strip() for r in args.runtimes.split(",")]
    smallest, largest = (float(x) for x in args.row_group_mb.split(","))
    result: dict = {"trainers": args.trainers, "microbatches": args.microbatches, "seq_len": args.seq_len,
                    "row_group_mb": [smallest, largest], "runs": {}}
    with tempfile.TemporaryDirectory(prefix="plait-bench-memory-") as tmp:
        t0 = time.perf_counter()
        files = write_files(Path(tmp), args.distinct, smallest, largest)
        disk = sum(f.stat().st_size for f in files)
        console.print(f"{args.distinct} distinct files ({disk / MIB:,.0f} MiB on disk) written in "
                      f"{time.perf_counter() - t0:.1f} s; {args.trainers} trainers x {args.microbatches} "
                      f"micro-batches of {args.seq_len} tokens")
        result["disk_bytes"] = disk
        for runtime in runtimes:
            for n in counts:
                spec = make_spec(Path(tmp), files, n, args.trainers, args.seq_len, args.microbatches, args.buffer_mb,
                                 args.max_buffer_mb)
                t1 = time.perf_counter()
                got = measure(spec, Path(tmp), runtime, args.trainers, args.loaders)
                got["seconds"] = time.perf_counter() - t1
                assert got["batches"] == args.trainers * args.microbatches, got["batches"]
                result["runs"][f"{runtime}/{n}"] = got
    table = Table(title=f"memory plait adds: {args.trainers} torch trainers, {args.microbatches} micro-batches of "
                        f"{args.seq_len} tokens, row groups {smallest:g}-{largest:g} MiB")
    for col in ("runtime", "sources", "added MiB", "per trainer", "plait procs", "Ray daemons", "buffer/rank", "s"):
        table.add_column(col, justify="left" if col == "runtime" else "right")
    for key, got in result["runs"].items():
        runtime, n = key.split("/")
        table.add_row(runtime, n, f"{got['total'] / MIB:,.0f}", f"{got['trainer_added_per_rank'] / MIB:,.0f}",
                      f"{got['plait_processes'] / MIB:,.0f}",
                      f"{got['ray_daemons'] / MIB:,.0f}", f"{got['peak_buffer_per_rank'] / MIB:.1f}",
                      f"{got['seconds']:.0f}")
    console.print(table)
    for key, got in result["runs"].items():
        if got["roles"]:
            console.print(f"{key} sources, plait processes (MiB): " + ", ".join(
                f"{k.replace('Actor', '')} {v['rss'] / MIB:.0f}" for k, v in sorted(got["roles"].items())))
    for runtime in runtimes:
        totals = [result["runs"][f"{runtime}/{n}"]["total"] for n in counts]
        result[f"{runtime}_spread"] = max(totals) / max(1, min(totals)) - 1
        console.print(f"{runtime}: {counts[-1]} sources add {totals[-1] / MIB:,.0f} MiB in all "
                      f"({totals[-1] / MIB / args.trainers:,.0f} MiB per trainer); spread over "
                      f"{', '.join(map(str, counts))} sources {100 * result[f'{runtime}_spread']:.0f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--trainer":
        _trainer()
    else:
        sys.exit(main(sys.modules[__name__]))
