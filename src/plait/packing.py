"""Padding-free packing: documents -> one concatenated sequence per micro-batch.

For a micro-batch of documents d_1..d_k (lengths L_1..L_k):
  input_ids    = d_1 ++ ... ++ d_k                         (no padding, ever)
  cu_seqlens   = [0, L_1, L_1+L_2, ..., sum L]             (int32, FlashAttention varlen layout)
  position_ids = 0..L_1-1, 0..L_2-1, ...                   (restart at each document)
  labels       = input_ids shifted left by one, with IGNORE at the last token of every document, so no
                 label ever crosses a document boundary.
The per-token passes run in kernels.py (compiled, with numpy equivalents).
"""

from __future__ import annotations

import numpy as np

from plait.kernels import fill_positions_labels
from plait.ragged import ragged_arange, ragged_gather

__all__ = ["IGNORE_INDEX", "multi_token_labels", "pack_fields", "ragged_arange", "ragged_gather"]

IGNORE_INDEX = -100


def pack_fields(input_ids: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
    """cu_seqlens, position_ids and labels for an already concatenated sequence of documents."""
    lengths = np.asarray(lengths, dtype=np.int64)
    cu = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    position_ids = np.empty(len(input_ids), dtype=np.int32)
    labels = np.empty(len(input_ids), dtype=np.int32)
    fill_positions_labels(input_ids, cu, position_ids, labels, IGNORE_INDEX)
    return {"cu_seqlens": cu, "position_ids": position_ids, "labels": labels}


def multi_token_labels(input_ids: np.ndarray, cu_seqlens: np.ndarray, horizon: int) -> np.ndarray:
    """Labels for multi-token prediction: `[horizon, tokens]`, row j the token j+1 positions ahead.

    Row 0 equals the ordinary `labels`. A target that would lie past the end of its document (or chunk:
    a chunk is a document of its own in the packed layout) is IGNORE_INDEX, so no label crosses a
    boundary. Vectorised: one gather per row, no loop over tokens.
    """
    n = len(input_ids)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lengths = np.diff(cu)
    end = np.repeat(cu[1:], lengths)  # one past the last token of each token's document
    pos = np.arange(n, dtype=np.int64)
    out = np.full((horizon, n), IGNORE_INDEX, dtype=np.int32)
    for j in range(horizon):  # horizon is small (a few rows), tokens are many
        target = pos + j + 1
        ok = target < end
        out[j, ok] = input_ids[target[ok]]
    return out
