"""Dynamic CP payload: a group micro-batch cut for each member (plait.context_parallel.shard_for_group)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.batch import MicroBatch
from plait.context_parallel import causal_work, shard_for_group, unshard_group
from plait.packing import IGNORE_INDEX, multi_token_labels, pack_fields


def group_mb(lengths, seed=0, horizon=1) -> MicroBatch:
    lengths = np.asarray(lengths, dtype=np.int64)
    ids = np.random.default_rng(seed).integers(1, 1000, int(lengths.sum())).astype(np.int32)
    n = len(lengths)
    sample_ids = np.stack([np.zeros(n), np.zeros(n), np.zeros(n), np.arange(n), np.zeros(n)], axis=1).astype(np.int64)
    fields = pack_fields(ids, lengths)
    mtp = multi_token_labels(ids, fields["cu_seqlens"], horizon) if horizon > 1 else None
    return MicroBatch(step=3, microbatch=1, num_microbatches=2, dp_rank=5, input_ids=ids, sample_ids=sample_ids,
                      source_ids=np.zeros(n, np.int32), stats={"step": 3, "global_label_tokens": 7},
                      mtp_labels=mtp, **fields)


def same(a: MicroBatch, b: MicroBatch) -> None:
    for f in ("input_ids", "labels", "position_ids", "cu_seqlens", "sample_ids", "source_ids", "mtp_labels"):
        x, y = getattr(a, f), getattr(b, f)
        if x is None or y is None:
            assert x is None and y is None, f
            continue
        assert x.dtype == y.dtype and np.array_equal(x, y), f
    assert a.stats == b.stats and (a.step, a.microbatch, a.dp_rank) == (b.step, b.microbatch, b.dp_rank)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=0, max_size=10), st.sampled_from([1, 2, 3, 4, 8]),
       st.integers(0, 2**16), st.sampled_from([1, 3]))
def test_every_token_on_exactly_one_member_and_unshard_is_exact(lengths, k, seed, horizon):
    mb = group_mb(lengths, seed, horizon)
    shards = [shard_for_group(mb, k, m, group=[10 + m for m in range(k)], group_id=4) for m in range(k)]
    same(unshard_group(shards), mb)
    real = [s.labels != IGNORE_INDEX for s in shards]
    # labels: each member holds only those of its chunks, and together exactly the micro-batch's
    assert sum(int(r.sum()) for r in real) == int((mb.labels != IGNORE_INDEX).sum())
    # every (document, position) of the micro-batch on exactly one member: padding aside, positions cover 0..L-1
    lengths = np.asarray(lengths, dtype=np.int64)
    seen = np.zeros(int(lengths.sum()), dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    for s in shards:
        local = np.diff(s.cu_seqlens)
        assert np.array_equal(local, np.diff(shards[0].cu_seqlens))  # equal local sizes on every member
        doc = np.repeat(np.arange(len(lengths)), local)
        real = s.position_ids < lengths[doc]
        np.add.at(seen, starts[doc[real]] + s.position_ids[real], 1)
        assert (s.labels[~real] == IGNORE_INDEX).all()
        info = s.stats["cp"]
        assert info["size"] == k and info["group"] == [10 + m for m in range(k)] and info["group_id"] == 4
        assert np.array_equal(info["cu_seqlens"], mb.cu_seqlens)
        padded = np.diff(info["cu_seqlens_padded"])
        if k > 1:  # degree 1: the micro-batch as built, no padding
            assert (padded % (2 * k) == 0).all() and (padded >= lengths).all() and (padded - lengths < 2 * k).all()
        else:
            assert np.array_equal(padded, lengths)
        assert int(local.sum()) * k == int(info["cu_seqlens_padded"][-1])
        assert s.stats["global_label_tokens"] == 7  # the step's, untouched
    assert (seen == 1).all()


def test_zigzag_chunks_padding_and_balance():
    mb = group_mb([10, 4096])
    shards = [shard_for_group(mb, 2, m) for m in range(2)]
    # doc 0: 10 tokens padded to 12, chunks of 3: member 0 holds 0..2 and 9..11 (10, 11 are padding)
    s0 = shards[0]
    assert s0.position_ids[:6].tolist() == [0, 1, 2, 9, 10, 11]
    assert s0.input_ids[4:6].tolist() == [0, 0] and s0.labels[3:6].tolist() == [IGNORE_INDEX] * 3
    assert s0.stats["cp"]["padding"] == 2 and shards[1].stats["cp"]["padding"] == 0
    assert s0.cu_seqlens.tolist() == [0, 6, 6 + 2048] and s0.max_seqlen == 2048
    assert s0.stats["cp"]["cu_seqlens_padded"].tolist() == [0, 12, 12 + 4096]
    work = [causal_work(s) for s in shards]
    assert max(work) / min(work) < 1.01


def test_degree_one_is_the_micro_batch_itself():
    mb = group_mb([5, 9])
    shard = shard_for_group(mb, 1, 0, group=[3], group_id=11)
    assert shard.input_ids is mb.input_ids and shard.stats["cp"]["size"] == 1
    assert shard.stats["cp"]["group"] == [3] and shard.stats["cp"]["cu_seqlens_padded"].tolist() == [0, 5, 14]
    assert "cp" not in mb.stats  # the build's own stats are not touched


def test_a_shard_or_a_media_batch_is_not_cut():
    mb = group_mb([40, 7])
    with pytest.raises(ValueError, match="already"):
        shard_for_group(shard_for_group(mb, 2, 0), 2, 1)
    with pytest.raises(ValueError, match="outside"):
        shard_for_group(mb, 2, 2)
    import dataclasses

    with_image = dataclasses.replace(mb, image_grid=np.array([[1, 2, 2]]), pixel_values=np.zeros((4, 12), np.uint8))
    with pytest.raises(ValueError, match="degree 1"):
        shard_for_group(with_image, 2, 0)
    assert shard_for_group(with_image, 1, 0).stats["cp"]["size"] == 1
