"""`python -m benchmarks.planning_reads`: what a stored length column (`length_field`) saves one rank at DP > 1.

On the local runtime every DP rank plans the whole global step itself: without `length_field` planning
decodes every block the step draws from (reads the token column, or tokenizes the text) just to learn
document lengths; with it, planning reads the small `n_tokens` column and the tokens are decoded only
when the rank gathers its own micro-batches. Same data, same spec but for `length_field`, in the same
run: one rank's tokens/s end to end (plan + build, no prefetch thread), and planning alone (steps/s of
`plan()` with nothing built), with the ratio with / without for each. The batches are identical.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.common import main, write_result

HELP = "one rank's tokens/s at DP 8 with and without length_field (planning reads lengths only)"
DESCRIPTION = __doc__


def add_arguments(p) -> None:
    p.add_argument("--kind", choices=["tokens", "text"], default="tokens",
                   help="tokens: a list<int32> column; text: a string column tokenized on read (bytes)")
    p.add_argument("--tokens", type=float, default=32e6, help="dataset size in tokens (default 32M)")
    p.add_argument("--files", type=int, default=8, help="Parquet files")
    p.add_argument("--row-groups", type=int, default=8, help="row groups per file")
    p.add_argument("--median-len", type=int, default=800, help="median document length")
    p.add_argument("--dp", type=int, default=8, help="DP ranks (rank 0 is measured)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--microbatches", type=int, default=2, help="micro-batches per rank per step")
    p.add_argument("--steps", type=int, default=200, help="global steps measured")
    p.add_argument("--repeats", type=int, default=3, help="best of this many passes of each")
    p.add_argument("--data", metavar="DIR", help="where to write the dataset (default: a temp dir)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")


def make_dataset(root: Path, kind: str, tokens: float, files: int, row_groups: int, median_len: int,
                 seed: int = 0) -> None:
    """Parquet files with the documents (`doc`) and their token counts (`n_tokens`)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    per_file = int(tokens // files)
    for f in range(files):
        lengths = np.clip(rng.lognormal(np.log(median_len), 0.9, size=4 * per_file // median_len + 16), 16, 32768)
        lengths = lengths.astype(np.int64)
        lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), per_file)) + 1]
        offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        if kind == "tokens":
            flat = rng.integers(0, 50000, size=int(offsets[-1]), dtype=np.int32)
            col = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
        else:  # ASCII letters and spaces: one byte, one token (the byte tokenizer)
            flat = rng.integers(97, 123, size=int(offsets[-1]), dtype=np.uint8)
            flat[rng.random(len(flat)) < 0.15] = 32
            col = pa.StringArray.from_buffers(len(lengths), pa.py_buffer(offsets), pa.py_buffer(flat))
        table = pa.table({"doc": col, "n_tokens": pa.array(lengths, pa.int32())})
        pq.write_table(table, root / f"part-{f:04d}.parquet", row_group_size=-(-len(lengths) // row_groups))


def spec_for(root: Path, args, length_field: str | None):
    from plait.spec import load_spec

    field = {"tokens_field": "doc"} if args.kind == "tokens" else {"text_field": "doc"}
    source = {"name": "corpus", "path": str(root / "*.parquet"), **field, "eos": 0}
    if length_field:
        source["length_field"] = length_field
    return load_spec({
        "sources": [source],
        "packing": {"seq_len": args.seq_len, "microbatches": args.microbatches},
        "topology": {"dp": args.dp},
        "steps": args.steps,
    })


def one_rank(spec) -> tuple[int, float, str]:
    """Rank 0's micro-batches of every step: (tokens, seconds, digest of the batches)."""
    import hashlib

    from plait.client import Loader

    h = hashlib.sha256()
    loader = Loader(spec, dp_rank=0, read_ahead=0)
    t = time.perf_counter()
    n = 0
    for mb in loader:
        n += mb.num_tokens
        h.update(mb.input_ids.tobytes())
        h.update(mb.sample_ids.tobytes())
    seconds = time.perf_counter() - t
    loader.close()
    return n, seconds, h.hexdigest()


def planning_only(spec) -> tuple[int, float]:
    """Global steps planned (nothing built) and the seconds it took."""
    from plait.runtime.local import LocalRuntime

    rt = LocalRuntime(spec)
    t = time.perf_counter()
    for _ in range(spec.steps):
        rt.plan()
        rt.release()
    seconds = time.perf_counter() - t
    rt.close()
    return spec.steps, seconds


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    tmp = None
    root = Path(args.data) if args.data else Path(tmp := tempfile.mkdtemp(prefix="plait-bench-"))
    with console.status("writing the dataset…"):
        make_dataset(root, args.kind, args.tokens, args.files, args.row_groups, args.median_len)
    result: dict = {"kind": args.kind, "dp": args.dp, "steps": args.steps, "seq_len": args.seq_len,
                    "microbatches": args.microbatches}
    digests = {}
    specs = {"without": spec_for(root, args, None), "with": spec_for(root, args, "n_tokens")}
    planning_only(specs["without"].with_overrides(steps=3))  # warm up: JIT caches, page cache
    for label in specs:
        result[label] = {"rank_tokens_per_s": 0.0, "plan_steps_per_s": 0.0}
    for _ in range(args.repeats):  # interleaved, best of each: neither side gets a warmer machine
        for label, spec in specs.items():
            n, s, digests[label] = one_rank(spec)
            steps, s2 = planning_only(spec)
            r = result[label]
            r["rank_tokens"] = n
            r["rank_tokens_per_s"] = max(r["rank_tokens_per_s"], n / s)
            r["plan_steps_per_s"] = max(r["plan_steps_per_s"], steps / s2)
    result["identical_batches"] = digests["with"] == digests["without"]
    result["rank_ratio"] = result["with"]["rank_tokens_per_s"] / result["without"]["rank_tokens_per_s"]
    result["plan_ratio"] = result["with"]["plan_steps_per_s"] / result["without"]["plan_steps_per_s"]
    table = Table(title=f"planning reads: one rank of DP {args.dp}, {args.kind} Parquet, local runtime")
    for col in ("length_field", "rank tokens/s (plan + build)", "planning steps/s (plan only)"):
        table.add_column(col, justify="right")
    for label in ("without", "with"):
        r = result[label]
        table.add_row(label, f"{r['rank_tokens_per_s']:,.0f}", f"{r['plan_steps_per_s']:,.2f}")
    table.add_row("ratio with / without", f"{result['rank_ratio']:.2f}", f"{result['plan_ratio']:.2f}")
    console.print(table)
    console.print(f"identical batches: {result['identical_batches']}")
    if args.json:
        write_result(args.json, result)
    if tmp:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if result["identical_batches"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
