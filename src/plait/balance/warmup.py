"""Compile warm-up: run every kernel once on tiny inputs, so the first real step is not the one that
waits for numba (or for loading its on-disk cache).

The inputs are chosen to reach every code path that compiles something: both modes, urgent items, the
round phase of LPT, the equal-mode rebalance (swaps, exchanges, carries), the sort by length, and the
snapshots of a capped pass with the passes resumed from them; all of it once more with encoder
capacities (loads beside tokens).
"""

from __future__ import annotations

import time

import numpy as np

from plait import jit

from .baselines import first_fit
from .driver import assign
from .microbatches import middle_heavy_order


WARMED: list[bool] = []  # this process has run the warm-up: its kernels are loaded, compiled, for good


def warmup() -> float:
    """Compile (or load from numba's on-disk cache) the kernels; returns the seconds it took (0 after the
    first call of a process: the inputs below cost ~0.3 s to place even compiled). The process runs
    compiled kernels from now on (plait.jit)."""
    if WARMED:
        return 0.0
    t = time.perf_counter()
    jit.compile_now()
    lengths = np.array([5, 3, 3, 2, 9], dtype=np.int64)
    for mode in ("equal", "variable"):
        assign(lengths, lengths * 1.5, ranks=2, microbatches=2, capacity=10, mode=mode,
               priority=np.array([0, 2, 0, 1, 0]))
    middle_heavy_order(np.ones((2, 3)))
    many = np.tile(lengths, 8)  # enough small items for the round phase of LPT
    assign(many, many * 1.5, ranks=2, microbatches=8, capacity=10)
    # Tokens binding with long chunks: the equal-mode rebalance (swaps, exchanges, carries).
    bound = np.concatenate([np.full(4, 100), np.full(80, 5), np.full(20, 3)]).astype(np.int64)
    assign(bound, bound + bound**2 / 10.0, ranks=3, microbatches=2, capacity=100)
    # Enough items for the length-order sort, the rounds (>= ROUND_RANKS ranks) and the snapshots of a
    # capped pass that carries (tokens bind), with the passes resumed from them.
    C, R = 1024, 512
    docs = np.clip(np.random.default_rng(0).lognormal(np.log(C / 20), 1.5, size=40000), 4, 10 * C).astype(np.int64)
    docs = docs[: int(np.searchsorted(np.cumsum(docs), R * 4 * C)) + 1]
    pieces = -(-docs // C)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    chunks = np.minimum(C, np.repeat(docs, pieces) - (np.arange(int(pieces.sum())) - first) * C).astype(np.int64)
    for mode in ("equal", "variable"):
        assign(chunks, chunks + chunks**2 / (C / 2.65), ranks=R, microbatches=4, capacity=C, mode=mode)
    # Encoder capacities (tokens and, say, image patches and audio frames): the same paths with loads.
    pat = np.stack([(chunks * 3) % (2 * C), chunks % 5], axis=1)
    for mode in ("equal", "variable"):
        assign(chunks, chunks + chunks**2 / (C / 2.65) + 2.0 * pat[:, 0], ranks=R, microbatches=4, capacity=C,
               mode=mode, loads=pat, load_capacity=[2 * C, C])
        assign(bound, bound + bound**2 / 10.0, ranks=3, microbatches=2, capacity=100, mode=mode,
               loads=bound % 7, load_capacity=12)
    first_fit(np.zeros(2, dtype=np.int64), lengths[:2], 2, 10, np.empty(2, dtype=np.int64))
    WARMED.append(True)
    return time.perf_counter() - t
