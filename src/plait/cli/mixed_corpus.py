"""The mixed corpus: three pre-tokenized Parquet sources of clearly different lengths, and a spec over it.

The chaos and recovery tests and the recovery benchmarks (benchmarks/) stream this corpus, killing
loaders, Planners and Constructors on the way; one generator here keeps their data the same bytes
(seeded: the same files for the same seed). Small on purpose: the whole corpus is ~2 MB of Parquet.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from plait.spec import Spec, load_spec

# (name, files, docs per file, row group size, length range (lo, hi), weight)
MIXED_SOURCES = (
    ("short", 6, 240, 40, (8, 120), 0.3),
    ("mid", 4, 160, 32, (60, 600), 0.4),
    ("long", 3, 24, 6, (300, 1500), 0.3),
)


def write_token_parquet(path: Path, lengths: np.ndarray, rng: np.random.Generator, *, row_group_size: int | None = None,
                        vocab: tuple[int, int] = (2, 30000), compression: str = "snappy") -> None:
    """One Parquet file of pre-tokenized documents (`input_ids`: list<int32>) with the given lengths and
    random ids in [vocab[0], vocab[1])."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    flat = rng.integers(vocab[0], vocab[1], size=int(offsets[-1]), dtype=np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
    pq.write_table(pa.table({"input_ids": column}), path, row_group_size=row_group_size, compression=compression)


def mixed_sources(root: Path, *, scale: int = 1, seed: int = 0) -> list[dict]:
    """Write MIXED_SOURCES under `root` (once; later calls reuse the files, whatever their scale) and
    return their spec entries. `scale` multiplies the documents per file."""
    rng = np.random.default_rng(seed)
    entries = []
    for name, files, docs, row_group, (lo, hi), weight in MIXED_SOURCES:
        folder = Path(root) / name
        if not folder.exists():
            folder.mkdir(parents=True)
            for f in range(files):
                lengths = rng.integers(lo, hi + 1, size=docs * scale)
                write_token_parquet(folder / f"{name}-{f:03d}.parquet", lengths, rng, row_group_size=row_group)
        entries.append({"name": name, "path": str(folder / "*.parquet"), "tokens_field": "input_ids", "eos": 1,
                        "weight": weight})
    return entries


def mixed_spec(root: Path, *, dp: int = 8, seq_len: int = 256, microbatches: int = 2, seed: int = 7,
               shadows: int = 0, **extra) -> Spec:
    """A loaded Spec over `mixed_sources(root)` with a simple explicit cost model (linear 1, quadratic
    0.001); `extra` adds or replaces top-level spec sections."""
    sources = mixed_sources(root)
    if shadows:
        sources = [{**s, "shadows": shadows} for s in sources]
    return load_spec({"seed": seed, "sources": sources, "packing": {"seq_len": seq_len, "microbatches": microbatches},
                      "topology": {"dp": dp}, "cost": {"linear": 1.0, "quadratic": 0.001}, **extra})
