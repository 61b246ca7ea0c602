"""CP shards: reassemble exactly, balance causal work, pad-free rule for short documents."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import plait
from plait.context_parallel import causal_work, chunk_bounds, shard_for_cp, shard_for_rank, unshard
from plait.packing import pack_fields
from plait.batch import MicroBatch


def _mb(lengths, seed=0) -> MicroBatch:
    lengths = np.asarray(lengths, dtype=np.int64)
    ids = np.random.default_rng(seed).integers(0, 1000, int(lengths.sum())).astype(np.int32)
    n = len(lengths)
    sample_ids = np.stack([np.zeros(n), np.zeros(n), np.zeros(n), np.arange(n), np.zeros(n)], axis=1).astype(np.int64)
    return MicroBatch(step=3, microbatch=1, num_microbatches=2, dp_rank=0, input_ids=ids,
                      sample_ids=sample_ids, source_ids=np.zeros(n, np.int32), stats={"step": 3},
                      **pack_fields(ids, lengths))


def _same(a: MicroBatch, b: MicroBatch) -> None:
    for f in ("input_ids", "labels", "position_ids", "cu_seqlens", "sample_ids", "source_ids"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and np.array_equal(x, y), f
    assert a.stats == b.stats and (a.step, a.microbatch, a.dp_rank) == (b.step, b.microbatch, b.dp_rank)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=0, max_size=12), st.integers(1, 6), st.integers(0, 2**16))
def test_shards_reassemble_exactly(lengths, cp, seed):
    mb = _mb(lengths, seed)
    shards = [shard_for_cp(mb, cp, r) for r in range(cp)]
    _same(unshard(shards), mb)
    # Every token lands on exactly one rank; documents stay aligned across ranks.
    assert sum(s.num_tokens for s in shards) == mb.num_tokens
    for s in shards:
        assert len(s.cu_seqlens) == len(mb.cu_seqlens) and s.cu_seqlens[-1] == s.num_tokens
        assert np.array_equal(s.sample_ids, mb.sample_ids)


def test_zigzag_layout_and_balance():
    mb = _mb([4096, 1000, 37])
    cp = 4
    shards = [shard_for_cp(mb, cp, r) for r in range(cp)]
    # Rank 0 holds chunks 0 and 7 of the first document: positions 0..511 then 3584..4095.
    first = shards[0].position_ids[: shards[0].cu_seqlens[1]]
    assert first.tolist() == list(range(0, 512)) + list(range(3584, 4096))
    assert shards[0].stats["cp"]["cu_seqlens"].tolist() == mb.cu_seqlens.tolist()
    work = [causal_work(s) for s in shards]
    assert max(work) / min(work) < 1.001  # contiguous split would be 7x apart
    tokens = [s.num_tokens for s in shards]
    assert max(tokens) - min(tokens) <= 2 * 3


def test_short_documents_uneven_pad_free():
    # L < 2cp: chunk j = [floor(jL/2cp), floor((j+1)L/2cp)); some chunks empty, none padded.
    assert chunk_bounds(np.array([3]), 2).tolist() == [[0, 0, 1, 2, 3]]
    mb = _mb([3, 1, 2])
    shards = [shard_for_cp(mb, 2, r) for r in range(2)]
    assert [np.diff(s.cu_seqlens).tolist() for s in shards] == [[1, 1, 1], [2, 0, 1]]
    assert shards[1].position_ids.tolist() == [0, 1, 0]  # chunks 1 and 2: doc 0's first two, doc 2's first
    _same(unshard(shards), mb)


def test_shards_are_cut_once():
    """`shard_for_rank` is where runtimes cut CP shards: cp=1 passes batches through, a shard is never cut again."""
    mb = _mb([40, 7])
    assert shard_for_rank([mb], 1, 0)[0] is mb
    shard = shard_for_rank([mb], 2, 1)[0]
    assert np.array_equal(shard.input_ids, shard_for_cp(mb, 2, 1).input_ids) and shard.stats["cp"]["rank"] == 1
    try:
        shard_for_cp(shard, 2, 1)
    except ValueError as e:
        assert "already" in str(e)
    else:
        raise AssertionError("a CP shard must not be sharded again")


def test_loader_hands_each_cp_rank_its_shard(demo_spec_path):
    spec = plait.load_spec(demo_spec_path).with_overrides(
        topology={"dp": 2, "cp": 2}, packing={"seq_len": 4096, "microbatches": 1}, steps=2)
    from plait.runtime.local import LocalRuntime

    rt = LocalRuntime(spec)
    full = [mb for _ in range(spec.steps) for mb in rt.build(rt.plan(), 1)]
    per_rank = [list(plait.Loader(spec, dp_rank=1, cp_rank=r, read_ahead=0)) for r in range(2)]
    for i, mb in enumerate(full):
        _same(unshard([per_rank[0][i], per_rank[1][i]]), mb)


@pytest.mark.subprocess
def test_local_runtime_and_cp_work_without_ray(demo_spec_path):
    """Ray is an optional extra: with `import ray` failing, the local runtime and CP sharding still work."""
    import subprocess
    import sys

    spec_path = demo_spec_path
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "import plait\n"
        f"spec = plait.load_spec({str(spec_path)!r}).with_overrides(topology={{'dp': 2, 'cp': 2}}, steps=1)\n"
        "batches = list(plait.Loader(spec, dp_rank=1, cp_rank=1, read_ahead=0))\n"
        "assert batches and all(b.stats['cp']['rank'] == 1 for b in batches)\n"
        "try:\n"
        "    plait.Loader(spec, runtime='ray')\n"
        "except plait.PlaitError as e:\n"
        "    assert 'plait[ray]' in str(e)\n"
        "else:\n"
        "    raise AssertionError('the ray runtime should need plait[ray]')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
