"""`plait bench memory`: the memory plait's node data plane adds to R trainer processes, by PSS and RSS.

R trainer processes, started as torchrun starts them (LOCAL_RANK 0's hosts the node's data plane, the others
read from it), stream your spec (--spec, set to R DP ranks) or S generated pre-tokenized Parquet sources.
Once all have imported torch, each one's baseline is taken (shared library pages split alike then and at
measurement); after every rank consumed --steps steps (all alive, holding their buffers) it reports what
each added, host and reading ranks, by PSS (a page shared by n processes counts 1/n in each) and by RSS.
Against per-rank DataLoaders, and the Ray and Flight layouts: `python -m benchmarks.memory`.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HELP = "memory plait's node data plane adds to R trainer processes (your spec or S sources), by PSS and RSS"
DESCRIPTION = __doc__
MIB = 2**20


def add_arguments(p) -> None:
    add_data_arguments(p)
    p.add_argument("--client", choices=["node"], default="node", help="the trainers as torchrun starts them "
                   "(LOCAL_RANK 0's trainer hosts the node's data plane); other layouts: python -m benchmarks.memory")
    p.add_argument("--only", choices=["plait"], default="plait", help="plait is what this measures (per-rank "
                   "loaders: python -m benchmarks.memory)")


def add_data_arguments(p) -> None:
    """The data and the job (benchmarks.memory shares them)."""
    p.add_argument("--spec", metavar="SPEC", help="your spec (its sources; topology set to --ranks DP ranks) "
                   "instead of generated sources")
    p.add_argument("--sources", type=int, default=64, help="number of generated sources (S)")
    p.add_argument("--ranks", type=int, default=16, help="DP ranks, each a trainer process (R)")
    p.add_argument("--steps", type=int, default=6, help="global steps every rank consumes before measuring")
    p.add_argument("--block-mb", type=float, default=2.0, help="decoded size of one Parquet row group (a block)")
    p.add_argument("--files", type=int, default=2, help="files per source")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per micro-batch")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")
    p.add_argument("--data", metavar="DIR", help="keep the sources in DIR and reuse them when it holds them already "
                   "(the same --sources/--files/--block-mb: 1,000 sources take minutes to write)")


# ----- data -------------------------------------------------------------------------------------------
def make_sources(root: Path, sources: int, *, files: int = 2, row_groups: int = 2, block_mb: float = 2.0,
                 doc_len: int = 1024, seed: int = 0) -> list[dict]:
    """S folders of pre-tokenized Parquet (list<int32>); one row group decodes to about block_mb."""
    from plait.cli.mixed_corpus import write_token_parquet

    rng = np.random.default_rng(seed)
    docs = max(1, int(block_mb * MIB / 4 / doc_len))
    entries = []
    for s in range(sources):
        folder = root / f"src{s:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        for f in range(files):
            lengths = np.clip(rng.lognormal(np.log(doc_len), 0.6, size=docs * row_groups), 16, 16 * doc_len)
            write_token_parquet(folder / f"part-{f:03d}.parquet", lengths.astype(np.int64), rng, row_group_size=docs,
                                vocab=(2, 32000), compression="none")
        entries.append({"name": f"src{s:04d}", "path": str(folder / "*.parquet"), "tokens_field": "input_ids",
                        "eos": 1, "weight": 1.0})
    return entries


def spec_dict_of(entries: list[dict], ranks: int, seq_len: int = 2048) -> dict:
    return {"sources": entries, "packing": {"seq_len": seq_len, "microbatches": 1}, "topology": {"dp": ranks},
            "cost": {"hidden": 1024, "layers": 8, "ffn": 4096, "heads": 8}, "seed": 0}


def spec_file(args, folder: Path) -> tuple[Path, int]:
    """(the spec the trainers read, its number of sources): yours with R ranks, or generated sources in
    `folder`, written there unless a run with the same data wrote them."""
    from plait.spec import load_spec

    if args.spec:
        spec = load_spec(args.spec).with_overrides(topology={"dp": args.ranks, "tp": 1, "pp": 1, "cp": 1})
        spec_dict = spec.model_dump(mode="json")
    else:
        data = {"sources": args.sources, "files": args.files, "block_mb": args.block_mb}
        done = folder / "sources.json"
        if done.exists() and json.loads(done.read_text())["data"] == data:
            entries = json.loads(done.read_text())["entries"]
        else:
            folder.mkdir(parents=True, exist_ok=True)
            entries = make_sources(folder, args.sources, files=args.files, block_mb=args.block_mb)
            done.write_text(json.dumps({"data": data, "entries": entries}))
        spec_dict = spec_dict_of(entries, args.ranks, args.seq_len)
    path = folder / "spec.json"  # not on the trainers' command lines: 1,000 sources' spec is too long
    path.write_text(json.dumps(spec_dict))
    return path, len(spec_dict["sources"])


# ----- trainer processes ---------------------------------------------------------------------------------
def torchrun_env(local_rank: int, local_world_size: int, run_id: str) -> dict[str, str]:
    """What torchrun sets for a process of a one-node launch (plait.runtime.node_share reads it)."""
    return {"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world_size), "RANK": str(local_rank),
            "WORLD_SIZE": str(local_world_size), "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": "0"}


def start_trainers(module: str, cfgs: list[dict], env: dict) -> tuple[list, list]:
    """One `python -m MODULE --trainer CFG` process per config; returns them and the JSON line each printed
    once ready (it then waits for `finish`, so every process is measured while all are alive)."""
    procs = [subprocess.Popen([sys.executable, "-m", module, "--trainer", json.dumps(cfg)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) for cfg in cfgs]
    return procs, read_reports(procs, cfgs)


def read_reports(procs, cfgs: list[dict]) -> list[dict]:
    """The JSON line each trainer prints next; a RuntimeError naming the kind of one that exited instead."""
    reports = []
    for cfg, p in zip(cfgs, procs):
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"a {cfg.get('mode') or cfg.get('runtime')} trainer failed (exit {p.wait()})")
        reports.append(json.loads(line))
    return reports


def go(procs) -> None:
    for p in procs:
        with contextlib.suppress(BrokenPipeError):  # one that exited is reported by read_reports
            p.stdin.write("go\n")
            p.stdin.flush()


def finish(procs) -> None:
    go(procs)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()


def trainer(load) -> None:
    """One trainer process (`python -m MODULE --trainer CFG`, started by `run_trainers`): imports torch, says
    ready, waits for its baseline to be taken, loads (`load(cfg, spec)` -> (report, loader)), reports, waits
    to be measured, then closes its loader."""
    import psutil  # noqa: F401 - in the baseline: the per-rank setup reads its workers with it
    import torch

    torch.zeros(1)
    cfg = json.loads(sys.argv[2])
    print(json.dumps({"pid": os.getpid()}), flush=True)
    sys.stdin.readline()  # every trainer's baseline taken
    from plait.spec import load_spec

    report, loader = load(cfg, load_spec(cfg["spec_path"]))
    print(json.dumps({"pid": os.getpid(), **report}), flush=True)
    sys.stdin.readline()  # the harness measures, then tells us to go
    if hasattr(loader, "close"):  # a torch DataLoader has none: it stops its workers when it is collected
        loader.close()


def load_node(cfg: dict, spec) -> tuple[dict, object]:
    """torchrun's local processes: LOCAL_RANK 0 hosts the node's data plane."""
    import plait

    os.environ.update(cfg["torchrun"])
    loader = plait.Loader(spec, dp_rank=cfg["rank"], steps=cfg["steps"])
    return {"batches": sum(1 for _ in loader)}, loader


def mem(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process, bytes; 0 for one gone."""
    import psutil

    try:
        m = psutil.Process(pid).memory_full_info()
        return m.rss, m.pss
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0, 0


def pss_by_mapping(pid: int) -> dict[str, int]:
    """A process's PSS by kind of mapping, bytes: anonymous (heap, malloc arenas, Arrow's allocator),
    shared-memory segments (/dev/shm) and files (libraries, memory-mapped data)."""
    import psutil

    kinds = {"anonymous": 0, "shm": 0, "files": 0}
    try:
        for m in psutil.Process(pid).memory_maps(grouped=True):
            path = m.path or ""
            kinds["shm" if path.startswith("/dev/shm") else "files" if path.startswith("/") else "anonymous"] += m.pss
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass
    return kinds


def run_trainers(module: str, cfgs: list[dict]) -> tuple[list, list]:
    """Starts the trainers; once all have imported torch takes each one's baseline (base_rss, base_pss in
    its report, and the first one's base_maps), lets them load, and returns them with their reports (they
    wait for `finish`)."""
    procs, ready = start_trainers(module, cfgs, {**os.environ, "OMP_NUM_THREADS": "1"})
    bases = [mem(r["pid"]) for r in ready]
    first_maps = pss_by_mapping(ready[0]["pid"])  # the node's host (LOCAL_RANK 0) where there is one
    try:
        go(procs)
        loaded = read_reports(procs, cfgs)
        reports = [{**rep, "base_rss": rss, "base_pss": pss} for rep, (rss, pss) in zip(loaded, bases)]
    except BaseException:
        finish(procs)
        raise
    reports[0]["base_maps"] = first_maps
    return procs, reports


def trainer_cfgs(mode: str, spec_path: Path, args, **extra) -> list[dict]:
    run_id = f"bench-memory-{os.getpid()}"
    return [{"mode": mode, "spec_path": str(spec_path), "rank": r, "steps": args.steps, **extra,
             **({"torchrun": torchrun_env(r, args.ranks, run_id)} if mode == "node" else {})}
            for r in range(args.ranks)]


def role(sizes: list[tuple[int, int]]) -> dict:
    """A role's processes (or what they added): count and summed RSS and PSS, bytes."""
    return {"count": len(sizes), "rss": int(sum(r for r, _ in sizes)), "pss": int(sum(p for _, p in sizes))}


def added(reports: list[dict]) -> list[tuple[int, int]]:
    """What each trainer added over its baseline, (RSS, PSS)."""
    return [(rss - rep["base_rss"], pss - rep["base_pss"]) for rep in reports for rss, pss in [mem(rep["pid"])]]


def measure_node(spec_path: Path, args) -> dict:
    """plait's local runtime as torchrun starts it: LOCAL_RANK 0's trainer hosts the node's data plane,
    every trainer reads from it; no Ray, no other process."""
    procs, reports = run_trainers(__name__, trainer_cfgs("node", spec_path, args))
    try:
        grown = added(reports)
        host, clients = role(grown[:1]), role(grown[1:])
        now = pss_by_mapping(reports[0]["pid"])
        host["pss_by_mapping"] = {k: now[k] - reports[0]["base_maps"][k] for k in now}  # what the host added
        return {"total_rss": host["rss"] + clients["rss"], "total_pss": host["pss"] + clients["pss"],
                "actors": {"host trainer (LOCAL_RANK 0)": host}, "roles": {"host": host, "rank": clients},
                "client_rss": clients["rss"], "client_rss_per_rank": clients["rss"] / max(1, args.ranks - 1),
                "client_pss_per_rank": clients["pss"] / max(1, args.ranks - 1),
                "batches": sum(r["batches"] for r in reports)}
    finally:
        finish(procs)


# ----- the command -------------------------------------------------------------------------------------
def measure(args, setups: dict) -> dict:
    """The spec (yours or generated), then each setup's figures (setups: name -> measure(spec_path, args))."""
    from rich.console import Console

    with tempfile.TemporaryDirectory(prefix="plait-bench-memory-") as tmp:
        t0 = time.perf_counter()
        spec_path, sources = spec_file(args, Path(args.data) if args.data else Path(tmp))
        Console().print(f"{args.spec or f'{sources} sources written'} in {time.perf_counter() - t0:.1f} s; "
                        f"{args.ranks} trainer processes per setup, {args.steps} steps each")
        result: dict = {"spec": args.spec, "sources": sources, "ranks": args.ranks, "steps": args.steps,
                        "block_mb": args.block_mb, "client": args.client}
        for name, measure_setup in setups.items():
            result[name] = measure_setup(spec_path, args)
    host = result.get("plait", {}).get("roles", {}).get("host")  # the node layout's (a Ray layout has none)
    if host is not None:
        result.update(host_pss_mib=host["pss"] / MIB, host_rss_mib=host["rss"] / MIB,
                      host_pss_by_mapping_mib={k: v / MIB for k, v in host["pss_by_mapping"].items()})
    return result


def plait_row(result: dict) -> tuple[str, ...]:
    b = result["plait"]
    roles = ", ".join(f"{v['count']} {k.replace('Actor', '')} {v['rss'] / MIB:.0f} MiB"
                      for k, v in sorted(b["actors"].items()))
    return (f"plait ({result['client']} client)", f"{b['total_pss'] / MIB:,.0f}", f"{b['total_rss'] / MIB:,.0f}",
            f"{roles}; client {b['client_pss_per_rank'] / MIB:.0f} MiB PSS ({b['client_rss_per_rank'] / MIB:.0f} "
            "RSS)/rank")


def report(result: dict, rows: list[tuple[str, ...]], json_path: str | None) -> None:
    """The table of `rows` (what, PSS MiB, RSS MiB, note) and the JSON."""
    from plait.cli.common import print_table, write_json

    print_table(f"data-loading memory, {result['sources']} sources x {result['ranks']} ranks", rows,
                columns=("what", "PSS MiB", "RSS MiB", "note"), left=("what", "note"))
    write_json(json_path, result)


def run(args) -> int:
    result = measure(args, {"plait": measure_node})
    report(result, [plait_row(result)], args.json)
    return 0


if __name__ == "__main__":
    trainer(load_node)  # `plait bench memory` starts this module's trainers (`--trainer CFG`)
