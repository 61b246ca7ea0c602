"""Context parallelism: each CP rank's share of a packed micro-batch, balanced for causal attention.

Layout (per-document head-tail, "zigzag", chunking). A document of length L is cut into 2·cp chunks
at the boundaries

    b_j = floor(j · L / (2·cp)),   j = 0 .. 2·cp

(sizes differ by at most one token; no padding). CP rank i takes chunks i and 2·cp−1−i. Under a causal
mask a token's attention work grows with its position, so pairing an early chunk with the mirror late
chunk gives every rank the same work per document, up to one token per chunk.

Documents shorter than 2·cp tokens follow the same formula, so some of their chunks are empty (pad-free
uneven split): e.g. L=3, cp=2 gives boundaries 0, 0, 1, 2, 3, i.e. chunks of 0, 1, 1, 1 tokens, so
rank 0 (chunks 0 and 3) holds 1 token and rank 1 (chunks 1 and 2) holds 2. Such documents cost almost nothing, and no rank ever gets padding.

A CP shard is a MicroBatch whose
  input_ids, labels   the tokens of the rank's chunks, document by document: head chunk, then tail chunk.
                      labels are the full batch's labels (next token, IGNORE at each document's end), so
                      the loss summed over CP ranks equals the unsharded loss.
  position_ids        each token's position in its document (global, not local): RoPE stays correct and,
                      with the chunk rule above, tells where every local token sits in its document.
  cu_seqlens          local boundaries, one segment per document of the micro-batch (empty segments
                      kept), each segment = the document's head chunk ++ tail chunk on this rank.
  sample_ids, source_ids   the whole micro-batch's, unchanged (documents align across CP ranks).
  stats["cp"]         {"size": cp, "rank": i, "cu_seqlens": the unsharded cu_seqlens}: a CP attention
                      kernel (ring / all-gather KV) reassembles document d's keys from the ranks' chunks
                      using the global lengths; `unshard` does exactly that for the tokens.

Where. Runtimes cut shards where they serve a rank, through `shard_for_rank` (the local runtime's
`iter_rank`; on Ray the Constructor actor, so one build serves every CP rank and only the shard travels).
A shard is never cut again: sharding one is an error.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from plait.packing import ragged_arange
from plait.batch import MicroBatch


def chunk_bounds(lengths: np.ndarray, cp: int) -> np.ndarray:
    """[docs, 2cp+1] chunk boundaries inside each document (offsets from the document's start)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    j = np.arange(2 * cp + 1, dtype=np.int64)
    return (lengths[:, None] * j[None, :]) // (2 * cp)


def _pieces(lengths: np.ndarray, cp: int, cp_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Start (within the document) and length of the rank's head and tail chunks: two arrays [docs, 2]."""
    b = chunk_bounds(lengths, cp)
    h, t = cp_rank, 2 * cp - 1 - cp_rank
    starts = np.stack([b[:, h], b[:, t]], axis=1)
    sizes = np.stack([b[:, h + 1] - b[:, h], b[:, t + 1] - b[:, t]], axis=1)
    return starts, sizes


def shard_for_cp(mb: MicroBatch, cp: int, cp_rank: int) -> MicroBatch:
    """The CP rank's shard of a packed micro-batch (layout in the module docstring)."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank {cp_rank} outside 0..{cp - 1}")
    if cp == 1:
        return mb
    if "cp" in mb.stats:
        done = mb.stats["cp"]
        raise ValueError(f"micro-batch is CP shard {done['rank']} of {done['size']} already: shard a whole one")
    cu = np.asarray(mb.cu_seqlens, dtype=np.int64)
    if int(cu[-1]) != len(mb.input_ids):
        raise ValueError("context parallelism needs a packed micro-batch whose documents cover every token")
    lengths = np.diff(cu)
    starts, sizes = _pieces(lengths, cp, cp_rank)
    index = ragged_arange((starts + cu[:-1, None]).reshape(-1), sizes.reshape(-1))
    local = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(sizes.sum(axis=1), out=local[1:])
    stats = dict(mb.stats)
    stats["cp"] = {"size": cp, "rank": cp_rank, "cu_seqlens": np.asarray(mb.cu_seqlens).copy()}
    return dataclasses.replace(
        mb, input_ids=mb.input_ids[index], labels=mb.labels[index], position_ids=mb.position_ids[index],
        cu_seqlens=local, stats=stats, mtp_labels=None if mb.mtp_labels is None else mb.mtp_labels[:, index],
    )


def shard_for_rank(batches: list[MicroBatch], cp: int, cp_rank: int) -> list[MicroBatch]:
    """What CP rank `cp_rank` of `cp` is served of a DP rank's micro-batches: each one's shard (the
    batches themselves when cp == 1). The one call every runtime makes to cut CP shards, where it serves
    a rank (`iter_rank`): locally in the trainer's process, on Ray in the Constructor actor.

    A shard is cut once per built micro-batch and CP rank: the TP/PP ranks that ask for the same shard get
    the same arrays, not a copy each (kept while the micro-batch lives)."""
    if cp == 1:
        return list(batches)
    return [cut_once(mb, cp, cp_rank) for mb in batches]


_CUTS: dict[tuple[int, int, int], MicroBatch] = {}  # (id of a live micro-batch, cp, cp_rank) -> its shard


def cut_once(mb: MicroBatch, cp: int, cp_rank: int) -> MicroBatch:
    """`shard_for_cp(mb, cp, cp_rank)`, cut at the first call and handed out again while `mb` lives."""
    key = (id(mb), cp, cp_rank)
    shard = _CUTS.get(key)
    if shard is None:
        shard = _CUTS[key] = shard_for_cp(mb, cp, cp_rank)
        weakref.finalize(mb, _CUTS.pop, key, None)  # before `id(mb)` can name another micro-batch
    return shard


def unshard(shards: list[MicroBatch]) -> MicroBatch:
    """The micro-batch the CP shards (in cp_rank order) were cut from, exactly."""
    cp = len(shards)
    if cp == 1 and "cp" not in shards[0].stats:
        return shards[0]
    first = shards[0]
    per_rank = np.stack([np.diff(np.asarray(s.cu_seqlens, dtype=np.int64)) for s in shards])  # [cp, docs]
    lengths = per_rank.sum(axis=0)
    cu = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    total = int(cu[-1])
    input_ids = np.empty(total, dtype=first.input_ids.dtype)
    labels = np.empty(total, dtype=first.labels.dtype)
    position_ids = np.empty(total, dtype=first.position_ids.dtype)
    for rank, s in enumerate(shards):
        starts, sizes = _pieces(lengths, cp, rank)
        index = ragged_arange((starts + cu[:-1, None]).reshape(-1), sizes.reshape(-1))
        input_ids[index] = s.input_ids
        labels[index] = s.labels
        position_ids[index] = s.position_ids
    stats = {k: v for k, v in first.stats.items() if k != "cp"}
    return dataclasses.replace(first, input_ids=input_ids, labels=labels, position_ids=position_ids,
                               cu_seqlens=cu, stats=stats)


def causal_work(mb: MicroBatch) -> int:
    """Attention score count of a (sharded) micro-batch under a per-document causal mask: each token
    attends to the position_ids[t] + 1 tokens at or before it in its document."""
    return int((np.asarray(mb.position_ids, dtype=np.int64) + 1).sum())
