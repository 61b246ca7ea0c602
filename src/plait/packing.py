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

__all__ = ["IGNORE_INDEX", "pack_fields", "ragged_arange", "ragged_gather"]

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
