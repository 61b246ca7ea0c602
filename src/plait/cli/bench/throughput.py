"""`plait bench throughput [SPEC]`: tokens/s to packed batches, one rank, one core.

Without SPEC it writes a pre-tokenized Parquet dataset; with SPEC it reads your spec's sources (as one
DP rank that takes every micro-batch). In the same run it measures the baseline: simply reading the same
column of the same Parquet files into Arrow with pyarrow (every row group, no shuffling, no packing; only
when every source is Parquet). The ratio plait / raw says how much of the raw read speed survives
tokenizing, shuffling, mixing, balancing and packing.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HELP = "tokens/s to packed batches (one rank, one core) on generated Parquet or your SPEC, vs a raw pyarrow read"
DESCRIPTION = __doc__


def add_arguments(p) -> None:
    p.add_argument("spec", nargs="?", metavar="SPEC", help="your spec (YAML/JSON); default: a generated dataset")
    p.add_argument("--tokens", type=float, default=64e6, help="dataset size in tokens (default 64M); with SPEC, "
                   "tokens to stream (default: one pass of the raw read, at most 64M)")
    p.add_argument("--files", type=int, default=8, help="Parquet files")
    p.add_argument("--row-groups", type=int, default=8, help="row groups per file")
    p.add_argument("--median-len", type=int, default=800, help="median document length")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="take the best of this many passes of each")
    p.add_argument("--data", metavar="DIR", help="where to write the dataset (default: a temp dir)")
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


def raw_read(paths: list[tuple[str, str]]) -> tuple[int, float]:
    """Baseline: every row group's token column (file, column) into one numpy array each."""
    t = time.perf_counter()
    n = 0
    for path, column in paths:
        pf = pq.ParquetFile(path, memory_map=True)
        for rg in range(pf.num_row_groups):
            col = pf.read_row_group(rg, columns=[column]).column(0).combine_chunks()
            n += len(col.values.to_numpy())
    return n, time.perf_counter() - t


def spec_files(spec) -> list[tuple[str, str]] | None:
    """(file, token column) of every file of the spec, or None unless every source is local, pre-tokenized
    Parquet (the only case where a raw read measures the same tokens)."""
    from plait.sources import Source, infer_format

    out = []
    for i, src in enumerate(spec.sources):
        source = Source(src, i, spec.seed)
        protocols = source.fs.protocol if isinstance(source.fs.protocol, tuple) else (source.fs.protocol,)
        for f in source.files:
            if "file" not in protocols or not src.tokens_field or (src.format or infer_format(f)) != "parquet":
                return None
            out.append((f, src.tokens_field))
    return out


def plait_read(spec, target_tokens: int) -> tuple[int, float, int]:
    """Stream one rank (dp=1) until `target_tokens` were delivered, no prefetch thread."""
    from plait.client import Loader

    loader = Loader(spec, dp_rank=0, read_ahead=0)
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
    if args.spec:
        return run_spec(args, console)
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    tmp = None
    root = Path(args.data) if args.data else Path(tmp := tempfile.mkdtemp(prefix="plait-bench-"))
    with console.status("writing the dataset…"):
        paths = make_dataset(root, args.tokens, args.files, args.row_groups, args.median_len)
        columns = [(str(path), "input_ids") for path in paths]
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
        n, s = raw_read(columns)
        raw_tokens, raw_best = n, max(raw_best, n / s)
        m, s2, batches = plait_read(spec, n)
        ours_tokens, ours_best = m, max(ours_best, m / s2)
    result = {
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
    table.add_row("plait: shuffle + mix + balance + pack", f"{ours_best:,.0f}")
    table.add_row("ratio plait / raw", f"{ours_best / raw_best:.2f}")
    console.print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if tmp:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def run_spec(args, console) -> int:
    """Your spec, as one DP rank taking every micro-batch (dp=1, its packing kept), against a raw read."""
    from rich.table import Table

    from plait.spec import load_spec

    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    spec = load_spec(args.spec).with_overrides(topology={"dp": 1, "tp": 1, "pp": 1, "cp": 1}, steps=None)
    files = spec_files(spec)
    raw_best = ours_best = 0.0
    raw_tokens = 0
    for _ in range(args.repeats):
        if files:
            raw_tokens, s = raw_read(files)
            raw_best = max(raw_best, raw_tokens / s)
        target = int(min(args.tokens, raw_tokens) if raw_tokens else args.tokens)
        m, s2, batches = plait_read(spec, target)
        ours_best = max(ours_best, m / s2)
    result = {"spec": args.spec, "tokens_per_s": ours_best, "raw_tokens_per_s": raw_best or None,
              "ratio": ours_best / raw_best if raw_best else None, "tokens": int(m), "microbatches": batches,
              "seq_len": spec.packing.seq_len}
    table = Table(title=f"throughput of {args.spec} (1 rank, 1 core)")
    table.add_column("pipeline")
    table.add_column("tokens/s", justify="right")
    if raw_best:
        table.add_row("raw pyarrow read of the token columns (baseline)", f"{raw_best:,.0f}")
    table.add_row("plait: read + shuffle + mix + balance + pack", f"{ours_best:,.0f}")
    if raw_best:
        table.add_row("ratio plait / raw", f"{ours_best / raw_best:.2f}")
    else:
        table.add_row("baseline", "none: not every source is local, pre-tokenized Parquet")
    console.print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
