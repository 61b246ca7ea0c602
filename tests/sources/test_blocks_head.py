"""A cursor block cut to its head (blocks.head, applied by buffer_budget.CursorHeads): a block the Planner
will draw from later, but no planned step draws from now, keeps only the documents its next draws need;
a draw past the head reads the block again. The stream stays the same (reading is deterministic), exactly
once, and a resume goes on exactly: only what is held changes."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import batch_digest, make_spec, run_all_ranks, token_parquet

import plait
import plait.sources.buffer_budget as buffer_budget
from plait.runtime.local import LocalRuntime
from plait.sources.blocks import DocBlock, head


def block_of(lengths, positions=None) -> DocBlock:
    lengths = np.asarray(lengths, np.int64)
    starts = np.cumsum(lengths) - lengths
    n = len(lengths)
    positions = np.arange(n, dtype=np.int64) if positions is None else np.asarray(positions, np.int64)
    tokens = np.arange(int(lengths.sum()), dtype=np.int32)
    return DocBlock(0, (0, 0, 0), 0, positions, np.arange(n, dtype=np.int64) + 100, tokens, starts, lengths,
                    int(positions[-1]) + 1)


def doc(block: DocBlock, position: int) -> np.ndarray:
    i = int(np.searchsorted(block.positions, position))
    return block.tokens[block.starts[i]:block.starts[i] + block.lengths[i]]


def test_a_head_holds_the_next_documents_with_their_tokens():
    whole = block_of([5, 3, 7, 2, 4], positions=[0, 1, 3, 4, 6])  # position 2 and 5: dropped records
    cut = head(whole, 1, 10)  # from position 1: 3 + 7 tokens
    assert cut.positions.tolist() == [1, 3] and cut.rows.tolist() == [101, 102] and cut.span == (1, 4)
    for p in (1, 3):
        np.testing.assert_array_equal(doc(cut, p), doc(whole, p))
    assert cut.nbytes < whole.nbytes
    assert cut.holds(np.array([1, 3])) and cut.holds(np.array([2]))  # 2 is in its span (a dropped record)
    assert not cut.holds(np.array([0])) and not cut.holds(np.array([4])) and not cut.holds(None)
    assert head(cut, 3, 1) is cut  # a head is not cut again
    assert head(whole, 3, 1).positions.tolist() == [3]  # at least one document, however small `tokens`
    assert head(whole, 1, 10**6) is whole  # the rest of the block is its head: kept as it is


def test_heads_keep_the_stream_and_read_past_them_again(tmp_path, monkeypatch):
    sources = [token_parquet(tmp_path / f"s{i}", files=2, docs_per_file=40, row_group_size=40, name=f"s{i}", eos=1,
                             lo=20, hi=60, seed=i) for i in range(6)]
    spec = plait.load_spec(make_spec(sources, seq_len=64, microbatches=2, dp=2))
    whole, rt, _ = run_all_ranks(spec, steps=24)
    reads, held = rt.loader.blocks_read, rt.loader.cached_bytes
    rt.close()
    monkeypatch.setattr(buffer_budget, "HEAD_STEPS", 1)  # heads of a few documents: most draws go past one
    cut, rt, _ = run_all_ranks(spec, steps=24)
    try:
        assert rt.loader.heads.tokens < 64
        rt.release()
        assert rt.loader.cached_bytes < held / 2  # the sources' cursor blocks held as heads
        assert rt.loader.blocks_read > reads  # ... and read again to go on past them
    finally:
        rt.close()
    assert batch_digest(cut) == batch_digest(whole)  # the same samples, in the same order: exactly once as before


@pytest.mark.parametrize("at", [5, 11])
def test_a_resume_from_a_head_goes_on_exactly(tmp_path, monkeypatch, at):
    sources = [token_parquet(tmp_path / f"s{i}", files=2, docs_per_file=40, row_group_size=40, name=f"s{i}", eos=1,
                             lo=20, hi=60, seed=i) for i in range(4)]
    spec = plait.load_spec(make_spec(sources, seq_len=64, microbatches=2, dp=1))
    monkeypatch.setattr(buffer_budget, "HEAD_STEPS", 1)
    expected = list(plait.Loader(spec, dp_rank=0, steps=16, read_ahead=0, share="process"))
    with plait.Loader(spec, dp_rank=0, steps=16, read_ahead=0, share="process") as loader:
        it = iter(loader)
        first = [next(it) for _ in range(at * 2)]
        state = loader.state_dict()
    with plait.Loader(spec, dp_rank=0, steps=16, read_ahead=0, share="process") as again:
        again.load_state_dict(state)
        rest = list(again)
    assert batch_digest(first + rest) == batch_digest(expected)


def test_a_loader_counts_heads_out_of_its_block_limit(tmp_path, monkeypatch):
    """max_cached_blocks counts whole blocks: one small head per source does not push whole blocks out."""
    sources = [token_parquet(tmp_path / f"s{i}", files=1, docs_per_file=40, row_group_size=40, name=f"s{i}", eos=1,
                             lo=20, hi=60, seed=i) for i in range(6)]
    spec = plait.load_spec(make_spec(sources, seq_len=64, microbatches=2, dp=1))
    monkeypatch.setattr(buffer_budget, "HEAD_STEPS", 1)
    rt = LocalRuntime(spec)
    rt.loader.max_cached_blocks = 2
    try:
        for _ in range(8):
            plan = rt.plan()
            rt.build(plan, 0)
            rt.release()
        assert len(rt.loader.buffered_keys()) > 2  # whole blocks (at most 2) and the other sources' heads
    finally:
        rt.close()
