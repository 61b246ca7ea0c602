"""Padding-free packing: one concatenated sequence per micro-batch, labels that never cross documents,
positions that restart, consistent cu_seqlens, ids, and long documents cut into chunks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import plait
from plait.packing import IGNORE_INDEX, pack_fields, ragged_arange, ragged_gather
from helpers import (
    docs_in_batch,
    encode_expected,
    expected_tokens,
    make_spec,
    read_back,
    run_all_ranks,
    text_source,
    token_jsonl,
    token_parquet,
)


def check_microbatch(mb, seq_len: int) -> None:
    """Every structural promise of one packed micro-batch."""
    T = len(mb.input_ids)
    cu = mb.cu_seqlens.astype(np.int64)
    lengths = np.diff(cu)
    assert T <= seq_len
    assert cu[0] == 0 and cu[-1] == T, "no padding: the documents fill the sequence exactly"
    assert np.all(lengths > 0)
    assert len(mb.sample_ids) == len(mb.source_ids) == len(lengths)
    assert mb.sample_ids.shape[1] == 5
    np.testing.assert_array_equal(mb.source_ids, mb.sample_ids[:, 0])
    assert len(mb.labels) == len(mb.position_ids) == T
    for d in range(len(lengths)):
        a, b = cu[d], cu[d + 1]
        np.testing.assert_array_equal(mb.position_ids[a:b], np.arange(b - a))
        np.testing.assert_array_equal(mb.labels[a : b - 1], mb.input_ids[a + 1 : b])
        assert mb.labels[b - 1] == IGNORE_INDEX
    assert int((mb.labels == IGNORE_INDEX).sum()) == len(lengths)
    if T:
        assert mb.max_seqlen == int(lengths.max())


# ----- the packing arithmetic (property) --------------------------------------------------------
@given(st.lists(st.lists(st.integers(0, 50_000), min_size=1, max_size=30), max_size=20))
def test_pack_fields_property(docs):
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    input_ids = np.array([t for d in docs for t in d], dtype=np.int32)
    f = pack_fields(input_ids, lengths)
    cu = f["cu_seqlens"]
    assert cu.dtype == np.int32 and cu.tolist() == [0, *np.cumsum(lengths).tolist()]
    assert f["position_ids"].tolist() == [i for d in docs for i in range(len(d))]
    labels = [t for d in docs for t in (d[1:] + [IGNORE_INDEX])]
    assert f["labels"].tolist() == labels


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 10)), max_size=15))
def test_ragged_arange_and_gather(spans):
    flat = np.arange(100, dtype=np.int32) * 3
    starts = np.array([s for s, _ in spans], dtype=np.int64)
    lengths = np.array([n for _, n in spans], dtype=np.int64)
    expected = [i for s, n in spans for i in range(s, s + n)]
    assert ragged_arange(starts, lengths).tolist() == expected
    if spans:
        assert ragged_gather(flat, starts, lengths).tolist() == [3 * i for i in expected]


# ----- packed batches from real files ----------------------------------------------------------
@given(
    seq_len=st.sampled_from([16, 40, 64, 100]),
    microbatches=st.integers(1, 3),
    dp=st.integers(1, 3),
    bos=st.none() | st.just(5000),
    seed=st.integers(0, 3),
)
def test_packed_batches_property(tiny_sources, seq_len, microbatches, dp, bos, seed):
    """Any layout: batches are well formed, and every chunk is the right slice of its source document."""
    tok, txt = tiny_sources
    tok = tok.with_options(bos=bos, eos=5001)
    spec = plait.load_spec(make_spec([tok, txt], seq_len=seq_len, microbatches=microbatches, dp=dp, seed=seed))
    expected = {0: expected_tokens(tok), 1: expected_tokens(txt)}
    batches, rt, _ = run_all_ranks(spec, 3)
    rt.close()
    assert len(batches) == 3 * dp * microbatches
    for mb in batches:
        check_microbatch(mb, seq_len)
        for (source, epoch, shard, row, chunk), toks in docs_in_batch(mb):
            doc = expected[source][(shard, row)]
            np.testing.assert_array_equal(toks, doc[chunk * seq_len : chunk * seq_len + len(toks)])
            # every chunk but the document's last one is exactly seq_len long
            assert len(toks) == min(seq_len, len(doc) - chunk * seq_len)


@pytest.fixture(scope="module")
def tiny_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    tok = token_parquet(root / "tok", files=2, docs_per_file=10, row_group_size=4, lo=1, hi=150)
    txt = text_source(root / "txt", fmt="jsonl.gz", files=2, docs_per_file=10, hi=30)
    return tok, txt


def test_long_documents_reassemble_from_chunks(tmp_path):
    """Documents longer than seq_len arrive as chunks 0..n-1 that concatenate to the source document."""
    ds = token_jsonl(tmp_path, files=2, docs_per_file=6, lo=100, hi=700, eos=9999)
    seq_len = 64
    spec = plait.load_spec(make_spec([ds], seq_len=seq_len, microbatches=4, dp=2))
    from_file = read_back(ds)  # the documents as the file holds them, read without plait
    assert from_file.keys() == ds.docs.keys()
    expected = {k: encode_expected(v, ds.source) for k, v in from_file.items()}
    total = sum(len(v) for v in expected.values())
    batches, rt, _ = run_all_ranks(spec, total // (seq_len * 8) + 3)
    carried = rt.planner.carry
    rt.close()
    pieces: dict[tuple, dict[int, np.ndarray]] = {}
    for mb in batches:
        check_microbatch(mb, seq_len)
        for (source, epoch, shard, row, chunk), toks in docs_in_batch(mb):
            assert chunk not in pieces.setdefault((epoch, shard, row), {})
            pieces[(epoch, shard, row)][chunk] = toks
    in_carry = {(int(e), int(s), int(r)) for e, s, r in zip(carried.epoch, carried.shard, carried.row)}
    complete = [k for k in pieces if k[0] == 0 and k not in in_carry]
    assert len(complete) >= len(expected) - len(in_carry) and len(complete) > 0
    assert all(len(expected[k[1:]]) > seq_len for k in complete), "the test needs long documents"
    for key in complete:
        chunks = pieces[key]
        assert sorted(chunks) == list(range(len(chunks)))
        np.testing.assert_array_equal(np.concatenate([chunks[c] for c in sorted(chunks)]), expected[key[1:]])


def test_no_padding_and_fill(tmp_path):
    """Short documents fill micro-batches: tokens delivered ≈ capacity (no padding, little waste)."""
    ds = token_parquet(tmp_path, files=2, docs_per_file=50, row_group_size=10, lo=1, hi=20)
    spec = plait.load_spec(make_spec([ds], seq_len=128, microbatches=2, dp=2))
    batches, rt, _ = run_all_ranks(spec, 6)
    rt.close()
    for mb in batches:
        check_microbatch(mb, 128)
    fill = sum(len(mb.input_ids) for mb in batches) / (len(batches) * 128)
    assert fill > 0.85


def test_to_torch(tmp_path):
    torch = pytest.importorskip("torch")
    ds = token_parquet(tmp_path, files=1, docs_per_file=10, row_group_size=5)
    mb = next(iter(plait.Loader(make_spec([ds], seq_len=64), steps=1, read_ahead=0)))
    t = mb.to_torch()
    assert t["input_ids"].dtype == torch.long and t["cu_seqlens"].dtype == torch.int32
    assert t["input_ids"].tolist() == mb.input_ids.tolist()
    assert t["labels"].tolist() == mb.labels.tolist()
    assert t.max_seqlen == mb.max_seqlen and "max_seqlen" not in t
    assert all(isinstance(v, torch.Tensor) for v in t.values())  # tensors only


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 20)), max_size=30), st.integers(0, 2**32 - 1))
def test_numpy_and_compiled_kernels_write_the_same(spans, seed):
    # Ray's loader and Constructor actors use the numpy kernels, the local runtime the compiled ones:
    # batches are the same bit for bit only if both write the same values.
    from plait import kernels

    compiled = kernels.compiled_kernels()
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 1000, 80, dtype=np.int32)
    starts = np.array([a for a, _ in spans], dtype=np.int64)
    lengths = np.array([min(n, 80 - a) for a, n in spans], dtype=np.int64)
    out_starts = np.cumsum(lengths) - lengths
    a = np.full(int(lengths.sum()), -1, dtype=np.int32)
    b = a.copy()
    kernels.numpy_kernels()[0](src, starts, lengths, a, out_starts)
    compiled[0](src, starts, lengths, b, out_starts)
    assert np.array_equal(a, b) and np.array_equal(a, ragged_gather(src, starts, lengths) if len(spans) else a)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    pa, la, pb, lb = (np.empty(len(a), np.int32) for _ in range(4))
    kernels.numpy_kernels()[1](a, cu, pa, la, IGNORE_INDEX)
    compiled[1](a, cu, pb, lb, IGNORE_INDEX)
    assert np.array_equal(pa, pb) and np.array_equal(la, lb)


def test_padding_is_unfilled_capacity_per_microbatch_and_step(tmp_path):
    """A micro-batch of 3 tokens in seq_len 8 is 62.5% padding; the step's figure is 1 - fill."""
    from plait.client import Loader
    from helpers import make_spec, token_parquet

    src = token_parquet(tmp_path / "a", name="a", files=1, docs_per_file=40, row_group_size=8, lo=3, hi=6)
    spec = make_spec([src], seq_len=16, microbatches=2, dp=1)
    loader = Loader(spec, steps=3)
    batches = list(loader)
    for mb in batches:
        assert mb.fill == pytest.approx(mb.num_tokens / 16)
        assert mb.padding_fraction == pytest.approx(1 - mb.num_tokens / 16)
        assert mb.stats["padding_fraction"] == pytest.approx(1 - mb.stats["fill"])
    assert any(mb.padding_fraction > 0 for mb in batches)  # documents of 3-6 tokens never fill 16 exactly
    step0 = [mb for mb in batches if mb.step == 0]
    assert step0[0].stats["fill"] == pytest.approx(sum(mb.num_tokens for mb in step0) / (2 * 16))
