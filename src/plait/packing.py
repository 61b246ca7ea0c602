"""Padding-free packing: documents -> one concatenated sequence per micro-batch.

For a micro-batch of documents d_1..d_k (lengths L_1..L_k):
  input_ids    = d_1 ++ ... ++ d_k                         (no padding, ever)
  cu_seqlens   = [0, L_1, L_1+L_2, ..., sum L]             (int32, FlashAttention varlen layout)
  position_ids = 0..L_1-1, 0..L_2-1, ...                   (restart at each document)
  labels       = input_ids shifted left by one, with IGNORE at the last token of every document, so no
                 label ever crosses a document boundary.
Everything is computed with whole-array numpy operations.
"""

from __future__ import annotations

import numpy as np

IGNORE_INDEX = -100


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


def pack_fields(input_ids: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
    """cu_seqlens, position_ids and labels for an already concatenated sequence of documents."""
    from plait.kernels import fill_positions_labels

    lengths = np.asarray(lengths, dtype=np.int64)
    cu = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    position_ids = np.empty(len(input_ids), dtype=np.int32)
    labels = np.empty(len(input_ids), dtype=np.int32)
    fill_positions_labels(input_ids, cu, position_ids, labels, IGNORE_INDEX)
    return {"cu_seqlens": cu, "position_ids": position_ids, "labels": labels}
