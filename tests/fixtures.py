"""Test fixtures that several test modules share: a three-source pre-tokenized corpus and its spec, the
exactly-once comparison of two sample-id streams, seeded kill points, and synthetic document lengths.

The corpus and the exactly-once checks come from the package (plait.cli.mixed_corpus,
plait.exactly_once), which the benchmarks (benchmarks/) use too: tests never import from the
measurement suite, so a change to a benchmark cannot change what a test checks.
"""

from __future__ import annotations

import numpy as np

from plait.cli.mixed_corpus import MIXED_SOURCES, mixed_sources, mixed_spec
from plait.exactly_once import compare_streams, kill_points

__all__ = ["LENGTHS", "MIXED_SOURCES", "compare_streams", "kill_points", "mixed_sources", "mixed_spec", "step_chunks"]

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
