"""Compact cursor blocks (sources/blocks.compact, applied by buffer_budget.retain_blocks): a block kept while
no planned step draws from it holds its ids as uint16 where they fit -- half the bytes of what a job of
many sources buffers -- and the batches stay the same."""

from __future__ import annotations

import numpy as np

import plait
import plait.sources.buffer_budget as buffer_budget
from plait.sources.blocks import DocBlock, compact
from helpers import batch_digest, make_spec, run_all_ranks, token_parquet


def block_of(tokens) -> DocBlock:
    tokens = np.asarray(tokens, np.int32)
    one = np.zeros(1, np.int64)
    return DocBlock(0, (0, 0, 0), 0, one, one, tokens, one, np.array([len(tokens)]), 1)


def test_compact_keeps_the_values_and_leaves_wide_ids_alone():
    small = block_of([0, 5, 65535])
    out = compact(small)
    assert out.tokens.dtype == np.uint16 and out.nbytes < small.nbytes
    np.testing.assert_array_equal(out.tokens, small.tokens)
    wide = block_of([1, 65536])
    assert compact(wide) is wide and wide.tokens.dtype == np.int32 and wide.wide


def test_cursor_blocks_are_compact_and_the_batches_unchanged(tmp_path, monkeypatch):
    sources = [token_parquet(tmp_path / f"s{i}", files=2, docs_per_file=40, row_group_size=20, name=f"s{i}", eos=1,
                             seed=i)
               for i in range(6)]
    spec = plait.load_spec(make_spec(sources, seq_len=64, microbatches=2, dp=2))
    batches, rt, _ = run_all_ranks(spec, steps=6)
    held = [rt.loader.block(k[0], k[1:]) for k in rt.loader.buffered_keys()]
    rt.close()
    assert sum(b.tokens.dtype == np.uint16 for b in held) >= 3  # the sources' cursor blocks, at least

    monkeypatch.setattr(buffer_budget, "compact", lambda block: block)
    wide, rt, _ = run_all_ranks(spec, steps=6)
    wide_bytes = rt.loader.cached_bytes
    rt.close()
    assert batch_digest(batches) == batch_digest(wide)
    assert sum(b.nbytes for b in held) < wide_bytes
