"""Megatron-Core's packed-sequence fields of a micro-batch (`to_torch(layout="megatron_thd")`).

The names are those of `PackedSeqParams` in megatron/core/packed_seq_params.py (NVIDIA/Megatron-LM):
qkv_format, cu_seqlens_q / cu_seqlens_kv, their `_padded` forms, max_seqlen_q / max_seqlen_kv and
local_cp_size (its cp_group is the trainer's: plait.torch_cp.CPGroups.group_of). `to_torch` puts them, as
one dict, under "packed_seq_params", so `PackedSeqParams(**batch["packed_seq_params"], cp_group=...)`.

Under context parallelism Transformer Engine's THD attention takes the sequences of the whole CP group,
not the rank's shard: `cu_seqlens_*` bound each document's real tokens, `cu_seqlens_*_padded` each
document padded to a multiple of 2 x cp, which is how a rank finds its head and tail chunks in its local
tokens (cu_seqlens_padded[-1] / cp of them). A dynamic-CP shard (plait.context_parallel.shard_for_group)
carries both in stats["cp"]; max_seqlen_* is the longest padded document. A micro-batch that is not a CP
shard is its own group of one: both forms are its cu_seqlens. Fixed-mode shards (`shard_for_cp`) are cut
pad-free and unevenly, which this layout cannot describe: they are refused.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

PACKED_SEQ_FIELDS = ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                     "max_seqlen_q", "max_seqlen_kv", "local_cp_size")


def megatron_thd(stats: dict, cu_seqlens: np.ndarray, tensor: Callable) -> dict:
    """PackedSeqParams' fields (PACKED_SEQ_FIELDS) of a micro-batch with these `stats` and `cu_seqlens`;
    `tensor(array)` makes an int32 tensor where the batch's tensors go."""
    info = stats.get("cp")
    if info is None:
        cu, padded, size = cu_seqlens, cu_seqlens, 1
    elif "cu_seqlens_padded" in info:
        cu, padded, size = info["cu_seqlens"], info["cu_seqlens_padded"], int(info["size"])
    else:
        raise ValueError("the megatron_thd layout needs dynamic-CP shards (context_parallel.mode: dynamic), whose "
                         "documents are padded to a multiple of 2 x cp; fixed-mode CP shards are cut unpadded")
    cu, padded = np.asarray(cu, dtype=np.int32), np.asarray(padded, dtype=np.int32)
    longest = int(np.diff(padded).max()) if len(padded) > 1 else 0
    q, q_padded = tensor(cu), tensor(padded)
    return {"qkv_format": "thd", "cu_seqlens_q": q, "cu_seqlens_kv": q, "cu_seqlens_q_padded": q_padded,
            "cu_seqlens_kv_padded": q_padded, "max_seqlen_q": longest, "max_seqlen_kv": longest,
            "local_cp_size": size}
