"""`plait bench throughput SPEC`: tokens/s of your spec's stream to packed batches, one rank, one core.

It reads your spec's sources as one DP rank that takes every micro-batch (dp = 1, the spec's packing
kept), and in the same run the baseline: simply reading the same token columns of the same Parquet
files into Arrow with pyarrow (every row group, no shuffling, no packing; only when every source is
local, pre-tokenized Parquet). The ratio plait / raw says how much of the raw read speed survives
tokenizing, shuffling, mixing, balancing and packing. On a generated dataset: `python -m benchmarks.throughput`.
"""

from __future__ import annotations

import time

HELP = "tokens/s to packed batches of your SPEC (one rank, one core) vs a raw pyarrow read of its token columns"
DESCRIPTION = __doc__


def add_arguments(p) -> None:
    p.add_argument("spec", metavar="SPEC", help="your spec (YAML/JSON)")
    p.add_argument("--tokens", type=float, default=64e6, help="tokens to stream (default: one pass of the raw "
                   "read, at most 64M)")
    p.add_argument("--repeats", type=int, default=3, help="take the best of this many passes of each")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")


def raw_read(paths: list[tuple[str, str]]) -> tuple[int, float]:
    """Baseline: every row group's token column (file, column) into one numpy array each."""
    import pyarrow.parquet as pq

    t, n = time.perf_counter(), 0
    for path, column in paths:
        pf = pq.ParquetFile(path, memory_map=True)
        for rg in range(pf.num_row_groups):
            n += len(pf.read_row_group(rg, columns=[column]).column(0).combine_chunks().values.to_numpy())
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
    t, n, batches = time.perf_counter(), 0, 0
    for mb in loader:
        n, batches = n + mb.num_tokens, batches + 1
        if n >= target_tokens:
            break
    return n, time.perf_counter() - t, batches


def measure(spec, tokens: float, repeats: int) -> dict:
    """Best of `repeats` passes of the raw read (where there is one) and of plait over as many tokens."""
    import pyarrow as pa

    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    spec = spec.with_overrides(topology={"dp": 1, "tp": 1, "pp": 1, "cp": 1}, steps=None)
    files = spec_files(spec)
    raw_best = ours_best = 0.0
    raw_tokens = 0
    for _ in range(repeats):
        if files:
            raw_tokens, s = raw_read(files)
            raw_best = max(raw_best, raw_tokens / s)
        m, s2, batches = plait_read(spec, int(min(tokens, raw_tokens) if raw_tokens else tokens))
        ours_best = max(ours_best, m / s2)
    return {"tokens_per_s": ours_best, "raw_tokens_per_s": raw_best or None,
            "ratio": ours_best / raw_best if raw_best else None, "tokens": int(m), "raw_tokens": raw_tokens,
            "microbatches": batches, "seq_len": spec.packing.seq_len}


def report(result: dict, title: str, json_path: str | None) -> None:
    from plait.cli.common import print_table, write_json

    raw = result["raw_tokens_per_s"]
    print_table(title, ([("raw pyarrow read of the token columns (baseline)", f"{raw:,.0f}")] if raw else []) + [
        ("plait: read + shuffle + mix + balance + pack", f"{result['tokens_per_s']:,.0f}"),
        ("ratio plait / raw", f"{result['ratio']:.2f}") if raw else
        ("baseline", "none: not every source is local, pre-tokenized Parquet")], columns=("measure", "tokens/s"))
    write_json(json_path, result)


def run(args) -> int:
    from plait.spec import load_spec

    result = {"spec": args.spec, **measure(load_spec(args.spec), args.tokens, args.repeats)}
    report(result, f"throughput of {args.spec} (1 rank, 1 core)", args.json)
    return 0
