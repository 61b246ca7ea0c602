"""Test fixtures that several test modules share: a three-source pre-tokenized corpus and its spec, the
exactly-once comparison of two sample-id streams, seeded kill points, and synthetic document lengths.

The project's benchmarks (benchmarks/) have their own copies of the corpus: tests never import from the
measurement suite, so a change to a benchmark cannot change what a test checks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

# (name, files, docs per file, row group size, length range (lo, hi), weight)
MIXED_SOURCES = (
    ("short", 6, 240, 40, (8, 120), 0.3),
    ("mid", 4, 160, 32, (60, 600), 0.4),
    ("long", 3, 24, 6, (300, 1500), 0.3),
)


def mixed_sources(root: Path, *, seed: int = 0) -> list[dict]:
    """Write MIXED_SOURCES under `root` once (later calls reuse the files); return their spec entries."""
    rng = np.random.default_rng(seed)
    entries = []
    for name, files, docs, row_group, (lo, hi), weight in MIXED_SOURCES:
        folder = root / name
        if not folder.exists():
            folder.mkdir(parents=True)
            for f in range(files):
                lengths = rng.integers(lo, hi + 1, size=docs)
                offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
                flat = rng.integers(2, 30000, size=int(offsets[-1]), dtype=np.int32)
                column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
                pq.write_table(pa.table({"input_ids": column}), folder / f"{name}-{f:03d}.parquet",
                               row_group_size=row_group)
        entries.append({"name": name, "path": str(folder / "*.parquet"), "tokens_field": "input_ids", "eos": 1,
                        "weight": weight})
    return entries


def mixed_spec(root: Path, *, dp: int = 8, seq_len: int = 256, microbatches: int = 2, seed: int = 7,
               shadows: int = 0, **extra):
    """A loaded Spec over `mixed_sources(root)` with an explicit cost model."""
    from plait.spec import load_spec

    sources = mixed_sources(root)
    if shadows:
        sources = [{**s, "shadows": shadows} for s in sources]
    return load_spec({"seed": seed, "sources": sources, "packing": {"seq_len": seq_len, "microbatches": microbatches},
                      "topology": {"dp": dp}, "cost": {"linear": 1.0, "quadratic": 0.001}, **extra})


def compare_streams(reference: list[np.ndarray], observed: list[np.ndarray]) -> dict:
    """lost / duplicated / same order between two streams of sample-id arrays ([n, 5] each)."""
    ref = np.concatenate(reference) if reference else np.zeros((0, 5), np.int64)
    got = np.concatenate(observed) if observed else np.zeros((0, 5), np.int64)
    ref_set = {tuple(r) for r in ref.tolist()}
    got_list = [tuple(r) for r in got.tolist()]
    got_set = set(got_list)
    return {"delivered": len(got_list), "lost": len(ref_set - got_set),
            "duplicated": len(got_list) - len(got_set) + len(got_set - ref_set),
            "same_order": bool(ref.shape == got.shape and np.array_equal(ref, got))}


def kill_points(steps: int, failures: int, seed: int, num_loaders: int) -> dict[int, int]:
    """step -> loader index to kill at that step: seeded, distinct steps, not the first two."""
    rng = np.random.default_rng(seed)
    at = sorted(rng.choice(np.arange(2, max(3, steps - 1)), size=min(failures, max(1, steps - 3)), replace=False).tolist())
    first = int(rng.integers(num_loaders))
    return {int(s): (first + j) % num_loaders for j, s in enumerate(at)}


# Document length distributions, in stream order: (median, sigma, shortest, longest) of a clipped lognormal.
LENGTHS = {"web": (350, 1.5, 16, 1_000_000), "longctx": (2000, 1.3, 64, 1_000_000)}


def step_chunks(dist: str, budget: int, seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """Chunk lengths of one step: documents that start before `budget` tokens, cut at `seq_len`."""
    median, sigma, lo, hi = LENGTHS[dist]
    parts, total = [], 0
    while total < budget:
        lengths = np.clip(rng.lognormal(np.log(median), sigma, size=max(1024, int((budget - total) / 500))),
                          lo, hi).astype(np.int64)
        starts = total + np.cumsum(lengths) - lengths
        k = int(np.searchsorted(starts, budget, side="left"))
        parts.append(lengths[:k])
        total += int(lengths[:k].sum())
        if k < len(lengths):
            break
    docs = np.concatenate(parts)
    nchunks = -(-docs // seq_len)
    doc = np.repeat(np.arange(len(docs)), nchunks)
    chunk = np.arange(len(doc)) - np.repeat(np.cumsum(nchunks) - nchunks, nchunks)
    return np.minimum(seq_len, docs[doc] - chunk * seq_len).astype(np.int64)
