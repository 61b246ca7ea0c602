"""Compiled inner loops (numba) for the per-token work of packing, with numpy fallbacks.

Each kernel makes one pass over the tokens it writes. numba compiles them on first use and caches the
machine code next to this file, so later processes start fast.
"""

from __future__ import annotations

import numpy as np

try:
    import numba

    _njit = numba.njit(cache=True, nogil=True)
except ImportError:  # pragma: no cover - numba is a core dependency; kept for odd platforms
    numba = None


def _copy_spans_py(src, src_starts, lengths, out, out_starts):
    from plait.packing import ragged_arange

    out[ragged_arange(out_starts, lengths)] = src[ragged_arange(src_starts, lengths)]


def _fill_positions_labels_py(input_ids, cu, position_ids, labels, ignore):
    lengths = np.diff(cu)
    position_ids[:] = np.arange(len(input_ids), dtype=position_ids.dtype) - np.repeat(cu[:-1], lengths)
    labels[:-1] = input_ids[1:]
    if len(input_ids):
        labels[cu[1:][lengths > 0] - 1] = ignore


if numba is not None:

    @_njit
    def copy_spans(src, src_starts, lengths, out, out_starts):
        for i in range(len(lengths)):
            s = src_starts[i]
            d = out_starts[i]
            n = lengths[i]
            out[d : d + n] = src[s : s + n]

    @_njit
    def fill_positions_labels(input_ids, cu, position_ids, labels, ignore):
        for d in range(len(cu) - 1):
            a = cu[d]
            b = cu[d + 1]
            if b <= a:
                continue
            for t in range(a, b - 1):  # one pass: read each id once, write both outputs
                position_ids[t] = t - a
                labels[t] = input_ids[t + 1]
            position_ids[b - 1] = b - 1 - a
            labels[b - 1] = ignore

else:  # pragma: no cover
    copy_spans = _copy_spans_py
    fill_positions_labels = _fill_positions_labels_py


def warm_up() -> None:
    """Compile (or load from cache) the kernels now, so the first batch is not slowed by it."""
    tokens = np.arange(8, dtype=np.int32)
    out = np.empty(4, dtype=np.int32)
    copy_spans(tokens, np.array([2], np.int64), np.array([4], np.int64), out, np.array([0], np.int64))
    cu = np.array([0, 4], dtype=np.int32)
    fill_positions_labels(out, cu, np.empty(4, np.int32), np.empty(4, np.int32), -100)
