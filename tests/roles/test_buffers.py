"""Bounded buffers per source: a SourceLoader holds at most `buffer_mb` of decoded data per source (and
its share of `loading.max_buffer_mb`), reads Parquet row groups too large for that in row ranges, and
neither the stream nor exactly-once delivery depends on the budget when row groups fit."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import batch_digest, expected_tokens, make_spec, text_source, token_parquet
from prometheus_client import generate_latest

import plait
from plait.errors import SpecError
from plait.roles.source_loader import SourceLoader
from plait.runtime.local import LocalRuntime

MIB = 2**20


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """Two sources whose row groups decode to about 1 MiB (200 documents of 200-2400 tokens)."""
    root = tmp_path_factory.mktemp("buffers")
    return [token_parquet(root / n, name=n, files=2, docs_per_file=400, row_group_size=200, lo=200, hi=2400,
                          seed=s, eos=1) for s, n in enumerate(("a", "b"))]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Four sources whose row groups decode to about 50 KiB: under a quarter of the budgets used here."""
    root = tmp_path_factory.mktemp("buffers-small")
    return [token_parquet(root / n, name=n, files=3, docs_per_file=60, row_group_size=30, lo=400, hi=450,
                          seed=10 + s, eos=1) for s, n in enumerate(("w", "x", "y", "z"))]


def spec_of(sources, buffer_mb=None, cap=None, **extra):
    entries = [s.with_options(**({} if buffer_mb is None else {"buffer_mb": buffer_mb})) for s in sources]
    loading = {} if cap is None else {"loading": {"max_buffer_mb": cap}}
    return plait.load_spec(make_spec(entries, seq_len=2048, microbatches=2, dp=2, **loading, **extra))


def stream(spec, steps: int, watch=None) -> tuple[list, LocalRuntime]:
    """Every rank's micro-batches of `steps` steps on the local runtime; `watch(loader)` after each step."""
    rt = LocalRuntime(spec)
    out = []
    for _ in range(steps):
        plan = rt.plan()
        for r in range(plan.ranks):
            out.extend(rt.build(plan, r))
        if watch is not None:
            watch(rt.loader)
        rt.release()
    return out, rt


def test_buffers_stay_within_buffer_mb_on_the_local_runtime(big):
    budget = 0.25  # a quarter of a row group: every row group must be read in row ranges
    spec = spec_of(big, buffer_mb=budget)
    peaks = {0: 0, 1: 0}

    def watch(loader):
        for s, peak in list(peaks.items()):
            held = loader.source_bytes(s)
            assert held <= budget * MIB, f"source {s} holds {held} bytes, over buffer_mb"
            peaks[s] = max(peak, held)
        assert loader.telemetry()["buffer_bytes"] == loader.cached_bytes <= 2 * budget * MIB

    batches, rt = stream(spec, 40, watch)
    try:
        assert rt.loader.buffer_over_budget == 0
        assert rt.loader.telemetry()["buffer_over_budget"] == 0
        assert all(p > 0 for p in peaks.values())
        src = rt.loader.sources[0]
        assert src.num_blocks(0) > 2, "the 2 row groups of a file must be read in several row ranges"
        ids = np.concatenate([mb.sample_ids for mb in batches])
        assert len(np.unique(ids, axis=0)) == len(ids)  # nothing delivered twice
    finally:
        rt.close()
    # The same data at the default budget (16 MiB) keeps whole row groups: over the quarter MiB above.
    _, whole = stream(spec_of(big), 3)
    try:
        assert whole.loader.sources[0].num_blocks(0) == 2
        assert max(whole.loader.source_bytes(0), whole.loader.source_bytes(1)) > budget * MIB
    finally:
        whole.close()


def walk_epoch(loader: SourceLoader, source: int, order=lambda keys: keys) -> dict:
    """Every document of epoch 0 of `source` that `loader` owns, read whole: (shard, row) -> tokens.
    Asserts the buffer within budget after every block. `order` permutes the keys before reading."""
    keys, key = [], loader.first_key(source)
    while key[0] == 0:
        keys.append(key)
        key = loader.sources[source].next_key(key)
    out, budget = {}, loader.source_budget[source]
    for key in order([k for k in keys if loader.owns(source, k)]):
        meta = loader.block_meta(source, key)
        n = len(meta.positions)
        tokens = loader.gather(np.full(n, source), [(source, *key)], np.zeros(n, np.int64), meta.positions,
                               np.zeros(n, np.int64), meta.lengths)
        for row, (start, length) in zip(meta.rows, zip(np.cumsum(meta.lengths) - meta.lengths, meta.lengths)):
            doc = (meta.shard, int(row))
            assert doc not in out, f"document {doc} delivered twice"
            out[doc] = tokens[start:start + length]
        assert loader.source_bytes(source) <= budget
    return out


def test_row_ranges_deliver_every_record_once_in_a_partitioned_loader(big):
    spec = spec_of(big, buffer_mb=0.25)
    expected = expected_tokens(big[0])
    for owned in ({0}, {1}):
        loader = SourceLoader(spec, partitions={0: (2, owned)})
        try:
            got = walk_epoch(loader, 0)
            mine = {k: v for k, v in expected.items() if k[0] % 2 in owned}
            assert set(got) == set(mine)
            for doc, tokens in mine.items():
                np.testing.assert_array_equal(got[doc], tokens, err_msg=str(doc))
            # Out of order (each piece found again by restarting its row group's reader): the same blocks.
            again = SourceLoader(spec, partitions={0: (2, owned)})
            backwards = walk_epoch(again, 0, order=lambda keys: keys[::-1])
            assert set(backwards) == set(got)
            for doc in got:
                np.testing.assert_array_equal(backwards[doc], got[doc])
            again.close()
            assert loader.buffer_over_budget == 0 and loader.blocks_read > 4
        finally:
            loader.close()


def test_the_stream_does_not_depend_on_the_budget_when_row_groups_fit(small):
    large_batches, large = stream(spec_of(small, buffer_mb=64, cap=None), 30)
    # a job-wide cap of a quarter MiB over four sources: blocks the plans still need are dropped and read again
    tight_batches, tight = stream(spec_of(small, buffer_mb=0.25, cap=0.25), 30)
    try:
        assert batch_digest(tight_batches) == batch_digest(large_batches)
        assert tight.loader.sources[0].num_blocks(0) == large.loader.sources[0].num_blocks(0) == 2
        assert tight.loader.blocks_read > large.loader.blocks_read, "the tight budget never had to drop a block"
        assert tight.loader.cached_bytes <= 0.25 * MIB
    finally:
        large.close()
        tight.close()
    default_batches, default = stream(spec_of(small), 30)  # no buffer fields at all: the same stream too
    default.close()
    assert batch_digest(default_batches) == batch_digest(large_batches)


def test_exact_resume_with_row_ranges(big):
    spec = spec_of(big, buffer_mb=0.25)
    rt = LocalRuntime(spec)
    whole, state = [], None
    for step in range(16):
        if step == 7:
            state = rt.state_dict()
        plan = rt.plan()
        for r in range(plan.ranks):
            whole.extend(rt.build(plan, r))
        rt.release()
    rt.close()
    resumed = LocalRuntime(spec)
    resumed.load_state_dict(state)
    tail = []
    for _ in range(9):
        plan = resumed.plan()
        for r in range(plan.ranks):
            tail.extend(resumed.build(plan, r))
        resumed.release()
    resumed.close()
    assert batch_digest(tail) == batch_digest([mb for mb in whole if mb.step >= 7])


def test_a_document_larger_than_the_budget_is_kept_and_counted(tmp_path):
    giant = token_parquet(tmp_path / "g", name="g", files=1, docs_per_file=3, row_group_size=3, lo=150_000,
                          hi=160_000, eos=1)  # ~0.6 MiB each
    spec = spec_of([giant], buffer_mb=0.25)
    batches, rt = stream(spec, 12)
    try:
        assert rt.loader.buffer_over_budget > 0
        assert rt.loader.telemetry()["buffer_over_budget"] == rt.loader.buffer_over_budget
        scraped = generate_latest(rt.telemetry.registry).decode()
        assert f"plait_loader_buffer_over_budget_total {float(rt.loader.buffer_over_budget)}" in scraped
        ids = np.concatenate([mb.sample_ids for mb in batches])
        assert len(np.unique(ids, axis=0)) == len(ids)
        delivered = sum(len(mb.input_ids) for mb in batches)
        assert delivered == 12 * 2 * 2 * 2048  # the budget never stalls the stream: every step is full
    finally:
        rt.close()


def test_budget_fields_are_validated(big):
    with pytest.raises(SpecError, match=r"buffer_mb"):
        spec_of(big, buffer_mb=0)
    with pytest.raises(SpecError, match=r"loading.*max_buffer_mb 1 is below source 'a'"):
        spec_of(big, buffer_mb=4, cap=1)
    spec = spec_of(big, buffer_mb=2, cap=8)
    assert spec.sources[0].buffer_bytes == 2 * MIB and spec.loading.max_buffer_mb == 8
    assert SourceLoader(spec, partitions={0: (4, {1})}).loader_budget == 2 * MIB  # never under a source's budget
    assert SourceLoader(spec).loader_budget == 8 * MIB


def test_length_field_planning_reads_the_same_row_ranges(tmp_path):
    """Planning from a stored length column cut to each row range agrees with the decoded pieces: the
    stream equals the one planned from the tokens, and no record is found to disagree."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(3)
    (tmp_path / "l").mkdir()
    for f in range(2):
        lengths = rng.integers(200, 2400, size=400)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(2, 1000, int(offsets[-1]), dtype=np.int32)))
        pq.write_table(pa.table({"input_ids": ids, "n": pa.array(lengths)}), tmp_path / "l" / f"p{f}.parquet",
                       row_group_size=200)
    entry = {"name": "l", "path": str(tmp_path / "l" / "*.parquet"), "tokens_field": "input_ids", "eos": 1,
             "buffer_mb": 0.25}
    planned = plait.load_spec(make_spec([{**entry, "length_field": "n"}], seq_len=2048, microbatches=2, dp=2))
    decoded = plait.load_spec(make_spec([entry], seq_len=2048, microbatches=2, dp=2))
    a, rt_a = stream(planned, 20)
    b, rt_b = stream(decoded, 20)
    try:
        assert rt_a.loader.sources[0].num_blocks(0) > 2  # read in row ranges
        assert rt_a.loader.error_report()["l"]["skipped"] == 0
        assert batch_digest(a) == batch_digest(b)
    finally:
        rt_a.close()
        rt_b.close()


def test_text_row_groups_read_in_ranges_deliver_every_record_once(tmp_path):
    """Raw text tokenized to bytes (four bytes of tokens per text byte): the estimate splits the row
    group, and every record comes back once, tokenized as when it is read whole."""
    ds = text_source(tmp_path / "t", name="t", files=2, docs_per_file=400, row_group_size=400, lo=100, hi=300, eos=256)
    loader = SourceLoader(spec_of([ds], buffer_mb=0.25))
    try:
        got = walk_epoch(loader, 0)
        assert loader.sources[0].num_blocks(0) > 4 and loader.buffer_over_budget == 0
        expected = expected_tokens(ds)
        assert set(got) == set(expected)
        for doc, tokens in expected.items():
            np.testing.assert_array_equal(got[doc], tokens, err_msg=str(doc))
    finally:
        loader.close()


def test_dropped_blocks_trim_the_heap_once_enough_is_freed(big, monkeypatch):
    """glibc keeps freed blocks resident: after TRIM_EVERY bytes of dropped blocks, a step's release
    gives the heap back (plait.heap.HEAP_TRIM.now), and not on every step."""
    import plait.roles.source_loader as loader_module
    from plait.heap import HeapTrim

    calls = []

    class Counting:
        def now(self):
            calls.append(1)
            return True

    monkeypatch.setattr(loader_module, "TRIM_EVERY", 100_000)
    monkeypatch.setattr(loader_module, "HEAP_TRIM", Counting())
    dropped = []
    _, rt = stream(spec_of(big, buffer_mb=0.25), steps=30, watch=lambda ld: dropped.append(ld.dropped_bytes))
    assert calls  # blocks were dropped and the heap trimmed
    assert len(calls) < 30  # only after enough was freed, not every step
    assert max(dropped) > 0 and rt.loader.dropped_bytes < 100_000  # the count restarts after each trim
    HeapTrim(60).now()  # the real trim runs without error


def test_open_row_range_readers_are_capped_without_changing_the_stream(big):
    """Row groups read in pieces keep a reader open between pieces; with max_open_streams 1 the two
    sources take turns closing each other's, which are read up to their piece again: more decoding, the
    same batches, and never more than one open reader."""
    entries = [s.with_options(buffer_mb=0.25) for s in big]
    spec_for = lambda cap: plait.load_spec(make_spec(entries, seq_len=2048, microbatches=2, dp=2,  # noqa: E731
                                                     loading={"max_open_streams": cap}))
    most_open = []
    capped, rt = stream(spec_for(1), 6, watch=lambda loader: most_open.append(len(loader.open_streams.open)))
    free, rt_free = stream(spec_for(None), 6)
    assert batch_digest(capped) == batch_digest(free)
    assert max(most_open) == 1
    assert rt.loader.open_streams.reopened > 0 and rt.loader.open_streams.rows_reread > 0
    assert rt_free.loader.open_streams.reopened == 0  # unlimited: every piece follows its predecessor
