"""`plait bench throughput`: tokens/s from pre-tokenized Parquet to packed batches, one rank, one core.

In the same run it measures the baseline: simply reading the same token column of the same files into
numpy with pyarrow (every row group, no shuffling, no packing). The ratio plait / raw says how much of
the raw read speed survives shuffling, mixing, balancing and packing.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HELP = "tokens/s from pre-tokenized Parquet to packed batches (one rank, one core) vs raw pyarrow read"
DESCRIPTION = __doc__


def add_arguments(p) -> None:
    p.add_argument("--tokens", type=float, default=64e6, help="dataset size in tokens (default 64M)")
    p.add_argument("--files", type=int, default=8, help="Parquet files")
    p.add_argument("--row-groups", type=int, default=8, help="row groups per file")
    p.add_argument("--median-len", type=int, default=800, help="median document length")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="take the best of this many passes of each")
    p.add_argument("--data", metavar="DIR", help="where to write the dataset (default: a temp dir)")
    p.add_argument("--runtime", choices=["local", "ray"], default="local",
                   help="ray: tokens/s to --ranks simulated ranks and the fraction of steps a rank waited "
                   "(same as `plait bench ray-throughput`)")
    p.add_argument("--ranks", type=int, default=8, help="ray runtime: simulated DP ranks")
    p.add_argument("--steps", type=int, default=30, help="ray runtime: global steps")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")


def make_dataset(root: Path, tokens: float, files: int, row_groups: int, median_len: int, seed: int = 0) -> list[Path]:
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    per_file = int(tokens // files)
    paths = []
    for f in range(files):
        lengths = []
        total = 0
        while total < per_file:
            chunk = np.clip(rng.lognormal(np.log(median_len), 0.9, size=4096), 16, 32768).astype(np.int64)
            lengths.append(chunk)
            total += int(chunk.sum())
        lengths = np.concatenate(lengths)
        lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), per_file)) + 1]
        offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        flat = rng.integers(0, 50000, size=int(offsets[-1]), dtype=np.int32)
        col = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
        path = root / f"part-{f:04d}.parquet"
        pq.write_table(pa.table({"input_ids": col}), path, row_group_size=-(-len(lengths) // row_groups))
        paths.append(path)
    return paths


def raw_read(paths: list[Path]) -> tuple[int, float]:
    """Baseline: every row group's token column into one numpy array each."""
    t = time.perf_counter()
    n = 0
    for p in paths:
        pf = pq.ParquetFile(p, memory_map=True)
        for rg in range(pf.num_row_groups):
            col = pf.read_row_group(rg, columns=["input_ids"]).column(0).combine_chunks()
            values = col.values.to_numpy()
            n += len(values)
    return n, time.perf_counter() - t


def plait_read(spec, target_tokens: int) -> tuple[int, float, int]:
    """Stream one rank (dp=1) until `target_tokens` were delivered, no prefetch thread."""
    from plait.client import Loader

    loader = Loader(spec, dp_rank=0, prefetch=0)
    t = time.perf_counter()
    n = 0
    batches = 0
    for mb in loader:
        n += mb.num_tokens
        batches += 1
        if n >= target_tokens:
            break
    return n, time.perf_counter() - t, batches


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from plait.spec import load_spec

    console = Console()
    if args.runtime == "ray":
        import argparse

        from plait.cli.bench import ray_throughput

        ray_args = argparse.ArgumentParser()
        ray_throughput.add_arguments(ray_args)
        ns = ray_args.parse_args(["--runtime", "ray", "--ranks", str(args.ranks), "--steps", str(args.steps),
                                  "--seq-len", str(args.seq_len)] + (["--json", args.json] if args.json else []))
        return ray_throughput.run(ns)
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    tmp = None
    root = Path(args.data) if args.data else Path(tmp := tempfile.mkdtemp(prefix="plait-bench-"))
    with console.status("writing the dataset…"):
        paths = make_dataset(root, args.tokens, args.files, args.row_groups, args.median_len)
    spec = load_spec({
        "sources": [{"name": "tokens", "path": str(root / "*.parquet"), "tokens_field": "input_ids"}],
        "packing": {"seq_len": args.seq_len, "microbatches": args.microbatches},
        "topology": {"dp": 1},
    })
    total = sum(pq.ParquetFile(p).metadata.num_rows and pq.read_metadata(p).num_rows for p in paths)
    raw_best, ours_best = 0.0, 0.0
    raw_tokens = ours_tokens = 0
    batches = 0
    for _ in range(args.repeats):
        n, s = raw_read(paths)
        raw_tokens, raw_best = n, max(raw_best, n / s)
        m, s2, batches = plait_read(spec, n)
        ours_tokens, ours_best = m, max(ours_best, m / s2)
    result = {
        "runtime": args.runtime,
        "documents": int(total),
        "tokens_per_s": ours_best,
        "raw_tokens_per_s": raw_best,
        "ratio": ours_best / raw_best,
        "tokens": int(ours_tokens),
        "raw_tokens": int(raw_tokens),
        "microbatches": batches,
        "seq_len": args.seq_len,
    }
    table = Table(title="throughput: pre-tokenized Parquet → packed batches (1 rank, 1 core)")
    table.add_column("pipeline")
    table.add_column("tokens/s", justify="right")
    table.add_row("raw pyarrow read of the token column (baseline)", f"{raw_best:,.0f}")
    table.add_row(f"plait ({args.runtime}): shuffle + mix + balance + pack", f"{ours_best:,.0f}")
    table.add_row("ratio plait / raw", f"{ours_best / raw_best:.2f}")
    console.print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if tmp:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0
