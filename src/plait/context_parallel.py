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

from plait.packing import IGNORE_INDEX, ragged_arange
from plait.batch import MicroBatch


# Per-build counts that the loss recipe sums over every rank (docs/multimodal-correctness.md): a build's
# shards carry them on their first member only, so the sum counts each dropped sample once.
BUILD_COUNTS = ("dropped_samples", "dropped_label_tokens")


def member_stats(stats: dict, member: int) -> dict:
    """A shard's copy of its build's stats: the per-build counts kept on member 0, zero on the others."""
    out = dict(stats)
    if member:
        out.update({k: 0 for k in BUILD_COUNTS if k in out})
    return out


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
    stats = member_stats(mb.stats, cp_rank)
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


# ----- dynamic CP: a group micro-batch cut for one member ----------------------------------------------------
#
# In `context_parallel.mode: dynamic` the Planner gives each document a degree k and plans the step in waves
# of groups (plait.plan.CPGroups). A group's micro-batch is built once and each of its k members receives
# only its shard. Unlike the fixed layout above, every document is padded to a multiple of 2k so that all
# members hold the same local sizes (what an all-gather of keys and values, or a ring, needs, and what
# Megatron-Core's THD path with `cu_seqlens_padded` expects): padded length P = ceil(L / 2k) * 2k, chunk
# j = [j*P/2k, (j+1)*P/2k), member i takes chunks i and 2k-1-i. Padding sits at each document's end (input
# id `pad_id`, label IGNORE_INDEX, positions continuing the document's), so under a causal mask no real
# token ever attends to it. A document with images or videos may take a larger P (more end padding) so that
# no chunk boundary falls inside a placeholder run: each medium's embeddings land on one member, in one
# piece; every member keeps the micro-batch's media fields (the encoder's input) as they are.


def shard_for_group(mb: MicroBatch, k: int, member: int, *, group: list[int] | None = None,
                    group_id: int = 0, pad_id: int = 0) -> MicroBatch:
    """Member `member`'s shard of a group micro-batch sharded over `k` ranks (layout above): its tokens
    document by document (head chunk, then tail chunk, padding included), global `position_ids`, local
    `cu_seqlens` (equal on every member) and stats["cp"] = {size, rank, group, group_id, cu_seqlens (the
    group's view, unpadded), cu_seqlens_padded (the group's view), padding (pad tokens of this shard)}.
    `group`: the members' global ranks (default 0..k-1). k = 1 gives the micro-batch itself with
    stats["cp"] set. An image's or video's placeholder run is never cut: a document with media gets the
    smallest chunk size whose boundaries all fall outside its runs (`uncut_chunks`; more end padding)."""
    if not 0 <= member < k:
        raise ValueError(f"member {member} outside 0..{k - 1}")
    if "cp" in mb.stats:
        raise ValueError("micro-batch is a CP shard already: cut a whole group micro-batch")
    cu = np.asarray(mb.cu_seqlens, dtype=np.int64)
    if int(cu[-1]) != len(mb.input_ids):
        raise ValueError("context parallelism needs a packed micro-batch whose documents cover every token")
    info = {"size": k, "rank": member, "group": list(range(k)) if group is None else [int(g) for g in group],
            "group_id": int(group_id), "cu_seqlens": cu.astype(np.int32)}
    stats = member_stats(mb.stats, member)
    if k == 1:
        stats["cp"] = {**info, "cu_seqlens_padded": info["cu_seqlens"], "padding": 0}
        return dataclasses.replace(mb, stats=stats)
    lengths = np.diff(cu)
    chunk = uncut_chunks(mb, lengths, k)  # per document: P / 2k
    padded = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(chunk * 2 * k, out=padded[1:])
    starts = np.stack([member * chunk, (2 * k - 1 - member) * chunk], axis=1)
    position = ragged_arange(starts.reshape(-1), np.repeat(chunk, 2))  # within the padded document
    doc = np.repeat(np.arange(len(lengths)), 2 * chunk)
    real = position < lengths[doc]
    source = (cu[:-1][doc] + position)[real]

    def local(values: np.ndarray, fill: int) -> np.ndarray:
        out = np.full(values.shape[:-1] + (len(position),), fill, dtype=values.dtype)
        out[..., real] = values[..., source]
        return out

    # a piece of a longer document may start past position 0: positions continue from its first token's
    first = np.asarray(mb.position_ids)[np.minimum(cu[:-1], max(len(mb.position_ids) - 1, 0))] if len(doc) else cu[:-1]
    first = np.where(lengths > 0, first, 0).astype(np.int64)
    cu_local = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(2 * chunk, out=cu_local[1:])
    stats["cp"] = {**info, "cu_seqlens_padded": padded, "padding": int(len(position) - real.sum())}
    return dataclasses.replace(
        mb, input_ids=local(mb.input_ids, pad_id), labels=local(mb.labels, IGNORE_INDEX),
        position_ids=(first[doc] + position).astype(mb.position_ids.dtype), cu_seqlens=cu_local, stats=stats,
        mtp_labels=None if mb.mtp_labels is None else local(mb.mtp_labels, IGNORE_INDEX),
    )


def uncut_chunks(mb: MicroBatch, lengths: np.ndarray, k: int) -> np.ndarray:
    """Chunk size per document for a cut over k ranks: ceil(L / 2k), or for a document with images or
    videos the smallest size from there up to twice it whose 2k - 1 boundaries cut none of its
    placeholder runs (the boundary moves by padding the document's end more)."""
    chunk = -(-lengths // (2 * k))
    media = [d for d in (mb.image_document, mb.video_document) if d is not None and len(d)]
    ids = [mb.stats.get(key) for key in ("image_token_id", "video_token_id")]
    ids = [int(i) for i in ids if i is not None and int(i) >= 0]
    if k == 1 or not media or not ids:
        return chunk
    cu = np.asarray(mb.cu_seqlens, dtype=np.int64)
    placeholder = np.isin(mb.input_ids, ids)
    for d in np.unique(np.concatenate(media)).tolist():  # the few documents with media of a micro-batch
        chunk[d] = uncut_chunk(placeholder[cu[d]:cu[d + 1]], int(chunk[d]), k, mb.sample_ids[d])
    return chunk


def uncut_chunk(placeholder: np.ndarray, smallest: int, k: int, sample_id: np.ndarray) -> int:
    """The smallest chunk size c >= `smallest` (up to twice it) whose boundaries c, 2c, .. (2k - 1)c fall
    outside every run of True in `placeholder` (a document's placeholder tokens)."""
    edges = np.diff(np.concatenate([[0], placeholder.astype(np.int8), [0]]))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    if not len(starts):
        return smallest
    sizes = np.arange(smallest, 2 * smallest + 1, dtype=np.int64)
    bounds = sizes[:, None] * np.arange(1, 2 * k, dtype=np.int64)[None, :]
    run = np.maximum(np.searchsorted(starts, bounds, side="right") - 1, 0)
    cuts = (bounds > starts[run]) & (bounds < ends[run])
    fits = np.flatnonzero(~cuts.any(axis=1))
    if not len(fits):
        raise ValueError(f"document {sample_id.tolist()} (source, epoch, shard, row, chunk): its image/video "
                         f"placeholder runs leave no chunk boundary over {k} ranks within twice the padding")
    return int(sizes[fits[0]])


def unshard_group(shards: list[MicroBatch]) -> MicroBatch:
    """The group micro-batch the shards of `shard_for_group` (in member order) were cut from, exactly."""
    first = shards[0]
    info = first.stats["cp"]
    stats = {key: v for key, v in first.stats.items() if key != "cp"}
    if info["size"] == 1:
        return dataclasses.replace(first, stats=stats)
    k = len(shards)
    cu = np.asarray(info["cu_seqlens"], dtype=np.int64)
    lengths = np.diff(cu)
    chunk = np.diff(np.asarray(first.cu_seqlens, dtype=np.int64)) // 2
    columns = {"input_ids": [], "labels": [], "position_ids": [], "mtp_labels": []}
    order = []
    for member, s in enumerate(shards):  # k shards, each a handful of arrays
        starts = np.stack([member * chunk, (2 * k - 1 - member) * chunk], axis=1)
        position = ragged_arange(starts.reshape(-1), np.repeat(chunk, 2))
        doc = np.repeat(np.arange(len(lengths)), 2 * chunk)
        real = position < lengths[doc]
        order.append((cu[:-1][doc] + position)[real])
        for name, values in columns.items():
            field_values = getattr(s, name)
            if field_values is not None:
                values.append(field_values[..., real])
    index = np.argsort(np.concatenate(order), kind="stable")
    whole = {name: np.concatenate(v, axis=-1)[..., index] if v else None for name, v in columns.items()}
    return dataclasses.replace(first, **whole, cu_seqlens=cu.astype(np.int32), stats=stats)


def causal_work(mb: MicroBatch) -> int:
    """Attention score count of a (sharded) micro-batch under a per-document causal mask: each token
    attends to the position_ids[t] + 1 tokens at or before it in its document."""
    return int((np.asarray(mb.position_ids, dtype=np.int64) + 1).sum())
