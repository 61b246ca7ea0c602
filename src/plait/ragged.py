"""Ragged-array helpers: many (start, length) spans handled as one numpy operation, no loop per span."""

from __future__ import annotations

import numpy as np


def ragged_arange(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + l) for each (s, l), without a Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    out_starts = np.cumsum(lengths) - lengths
    return np.arange(total, dtype=np.int64) + np.repeat(np.asarray(starts, dtype=np.int64) - out_starts, lengths)


def ragged_gather(flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """flat[s:s+l] for each (s, l), concatenated."""
    if len(starts) == 1:
        s = int(starts[0])
        return flat[s : s + int(lengths[0])]
    return flat[ragged_arange(starts, lengths)]
