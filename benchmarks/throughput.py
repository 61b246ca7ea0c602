"""`python -m benchmarks.throughput`: tokens/s to packed batches on a generated pre-tokenized Parquet
dataset (one rank, one core), against a raw pyarrow read of the same token column.

It writes --files Parquet files of lognormal document lengths (median --median-len), then measures them
as `plait bench throughput SPEC` measures a user's spec (plait.cli.bench.throughput.measure).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import main, write_result
from plait.cli.bench import throughput as product

HELP = "tokens/s to packed batches (one rank, one core) on generated Parquet, vs a raw pyarrow read"
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
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")


def make_dataset(root: Path, tokens: float, files: int, row_groups: int, median_len: int, seed: int = 0) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    per_file, paths = int(tokens // files), []
    for f in range(files):
        lengths, total = [], 0
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


def run(args) -> int:
    from plait.spec import load_spec

    with tempfile.TemporaryDirectory(prefix="plait-bench-") as tmp:
        root = Path(args.data or tmp)
        make_dataset(root, args.tokens, args.files, args.row_groups, args.median_len)
        spec = load_spec({"sources": [{"name": "tokens", "path": str(root / "*.parquet"), "tokens_field": "input_ids"}],
                          "packing": {"seq_len": args.seq_len, "microbatches": args.microbatches},
                          "topology": {"dp": 1}})
        result = product.measure(spec, args.tokens, args.repeats)
    product.report(result, "throughput: pre-tokenized Parquet -> packed batches (1 rank, 1 core)", None)
    write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
