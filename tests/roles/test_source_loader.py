"""The SourceLoader's own contract: announce block metadata that matches the decoded payloads, serve
exact token spans by (block, position, offset, length), keep a bounded cache that `retain` trims, count
skipped records, and decode the same key to the same block in any process, in any order."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    Dataset,
    expected_tokens,
    make_spec,
    text_source,
    token_parquet,
    write_jsonl,
)

import plait
from plait.errors import SourceError
from plait.roles.source_loader import SourceLoader


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    a = token_parquet(root / "a", name="a", files=3, docs_per_file=20, row_group_size=5, lo=1, hi=150, bos=1, eos=2)
    b = text_source(root / "b", fmt="jsonl", name="b", files=2, docs_per_file=9, hi=30, eos=256)
    spec = plait.load_spec(make_spec([a, b], seq_len=64))
    return spec, [a, b], [expected_tokens(a), expected_tokens(b)]


def epoch_blocks(loader: SourceLoader, source: int, epoch: int = 0, limit: int | None = None) -> list:
    """Metadata of the blocks of one epoch of a source (the first `limit`), following next_key from
    first_key (earlier epochs are walked through, not returned)."""
    out = []
    key = loader.first_key(source)
    while key[0] <= epoch and (limit is None or len(out) < limit):
        meta = loader.block_meta(source, key)
        if key[0] == epoch:
            out.append(meta)
        key = tuple(meta.next_key)
    return out


def whole_docs(meta):
    """gather() arguments for every document of one block, in the block's order."""
    n = len(meta.positions)
    zeros = np.zeros(n, dtype=np.int64)
    return [(meta.source, *meta.key)], zeros, meta.positions, zeros, meta.lengths


def test_block_meta_matches_the_decoded_documents(data):
    spec, datasets, expected = data
    loader = SourceLoader(spec)
    for s, ds in enumerate(datasets):
        seen = []
        for meta in epoch_blocks(loader, s):
            assert meta.source == s and meta.shard in range(len(ds.files))
            assert np.all(np.diff(meta.positions) > 0) and meta.num_positions >= len(meta.positions)
            ids = [(meta.shard, int(r)) for r in meta.rows]
            seen += ids
            np.testing.assert_array_equal(meta.lengths, [len(expected[s][i]) for i in ids])
            keys, block_index, positions, offsets, lengths = whole_docs(meta)
            got = loader.gather(np.full(len(ids), s), keys, block_index, positions, offsets, lengths)
            assert got.dtype == np.int32
            np.testing.assert_array_equal(got, np.concatenate([expected[s][i] for i in ids]))
        # One epoch of a source is every document once.
        assert sorted(seen) == sorted(expected[s])
    loader.close()


def test_gather_serves_exact_spans_in_request_order(data):
    """Partial spans (chunks) from several blocks of both sources, requested interleaved."""
    spec, _, expected = data
    loader = SourceLoader(spec)
    metas = epoch_blocks(loader, 0, limit=4) + epoch_blocks(loader, 1)
    keys = [(m.source, *m.key) for m in metas]
    rng = np.random.default_rng(3)
    req = []
    for b, m in enumerate(metas):
        for d in range(len(m.positions)):
            L = int(m.lengths[d])
            off = int(rng.integers(0, L))
            req.append((b, int(m.positions[d]), off, int(rng.integers(1, L - off + 1)), (m.shard, int(m.rows[d]))))
    order = rng.permutation(len(req))
    req = [req[i] for i in order]
    block_index, position, offset, length = (np.array([r[i] for r in req], dtype=np.int64) for i in range(4))
    source = np.array([keys[b][0] for b in block_index])
    got = loader.gather(source, keys, block_index, position, offset, length)
    want = np.concatenate([expected[keys[b][0]][doc][off:off + n] for b, _, off, n, doc in req])
    np.testing.assert_array_equal(got, want)
    assert len(got) == int(length.sum())
    loader.close()


def test_retain_drops_what_is_not_live_and_dropped_blocks_decode_again(data):
    spec, _, expected = data
    loader = SourceLoader(spec)
    metas = epoch_blocks(loader, 0, limit=5)
    keys = [(0, *m.key) for m in metas]
    assert loader.buffered_keys() == keys and loader.blocks_read == 5
    full = loader.cached_bytes
    live = {keys[1], keys[3]}
    loader.retain(live)
    assert set(loader.buffered_keys()) == live
    assert 0 < loader.cached_bytes < full
    # Asking again for a live block is served from the cache; a dropped one is read again, identically.
    loader.block_meta(0, metas[1].key)
    assert loader.blocks_read == 5
    args = whole_docs(metas[0])
    again = loader.gather(np.zeros(len(metas[0].positions), dtype=np.int64), *args)
    assert loader.blocks_read == 6
    np.testing.assert_array_equal(again, np.concatenate([expected[0][(metas[0].shard, int(r))] for r in metas[0].rows]))
    loader.retain(set())
    assert loader.buffered_keys() == [] and loader.cached_bytes == 0
    loader.close()


def test_cache_is_bounded(data):
    spec, _, _ = data
    loader = SourceLoader(spec, max_cached_blocks=3)
    keys = []
    for meta in epoch_blocks(loader, 0):
        keys.append((0, *meta.key))
        assert len(loader.buffered_keys()) <= 3
    assert len(keys) == 12  # 3 files x 4 row groups
    assert loader.buffered_keys() == keys[-3:], "the least recently used blocks go first"
    # Using a block again makes it the most recent: the next new block evicts another one.
    loader.block_meta(0, keys[-3][1:])
    loader.block_meta(0, loader.first_key(0))
    assert set(loader.buffered_keys()) == {keys[-3], keys[-1], keys[0]}
    loader.close()


def test_same_key_same_block_in_any_loader_and_any_order(data):
    spec, _, _ = data
    first = SourceLoader(spec)
    forward = epoch_blocks(first, 0)
    second = SourceLoader(spec)  # a fresh process's loader, reading the blocks backwards
    for meta in reversed(forward):
        other = second.block_meta(0, meta.key)
        assert tuple(other.next_key) == tuple(meta.next_key) and other.shard == meta.shard
        for field in ("positions", "rows", "lengths"):
            np.testing.assert_array_equal(getattr(other, field), getattr(meta, field))
        args = whole_docs(meta)
        src = np.zeros(len(meta.positions), dtype=np.int64)
        np.testing.assert_array_equal(second.gather(src, *args), first.gather(src, *args))
    # The next epoch is another order of the same documents.
    later = epoch_blocks(first, 0, epoch=1)
    ids = lambda metas: [(m.shard, int(r)) for m in metas for r in m.rows]
    assert sorted(ids(later)) == sorted(ids(forward)) and ids(later) != ids(forward)
    first.close()
    second.close()


@pytest.fixture
def messy(tmp_path) -> Dataset:
    records = [{"text": "good one"}, '{"text": "unterminated', {"text": "good two"}, {"text": None},
               {"other": 1}, {"text": 5}, {"text": "good three"}]
    write_jsonl(tmp_path / "a.jsonl", records)
    docs = {(0, i): r["text"] for i, r in enumerate(records) if isinstance(r, dict) and isinstance(r.get("text"), str)}
    return Dataset({"name": "messy", "path": str(tmp_path / "*.jsonl"), "text_field": "text"},
                   [str(tmp_path / "a.jsonl")], docs)


def test_skipped_records_are_counted_once_and_absent_from_the_metadata(messy):
    spec = plait.load_spec(make_spec([messy.with_options(on_error="skip")]))
    loader = SourceLoader(spec)
    key = loader.first_key(0)
    meta = loader.block_meta(0, key)
    assert sorted(int(r) for r in meta.rows) == [0, 2, 6]
    assert meta.num_positions == 7, "bad records keep their positions: the order never depends on them"
    expected = expected_tokens(messy)
    np.testing.assert_array_equal(meta.lengths, [len(expected[(0, int(r))]) for r in meta.rows])
    report = loader.error_report()["messy"]
    assert report["skipped"] == 4 and len(report["messages"]) == 4
    for record, m in zip(("1", "3", "4", "5"), sorted(report["messages"])):
        assert "messy" in m and messy.files[0] in m and f"record {record}:" in m, m
    # Decoding the block again in its epoch (evicted) does not count the same records again; the next
    # epoch counts them again (each bad sample once per epoch), as the same four bad records.
    loader.retain(set())
    loader.block_meta(0, key)
    assert loader.error_report()["messy"]["skipped"] == 4
    loader.block_meta(0, tuple(meta.next_key))
    report = loader.error_report()["messy"]
    assert report["skipped"] == 8 and report["bad_records"] == 4 and len(report["messages"]) == 4
    loader.close()
    strict = SourceLoader(plait.load_spec(make_spec([messy])))
    with pytest.raises(SourceError) as info:
        strict.block_meta(0, strict.first_key(0))
    assert info.value.source == "messy" and info.value.record == "1"
    strict.close()


def test_partitions_split_a_source_between_loaders(data):
    spec, _, _ = data
    whole = SourceLoader(spec)
    halves = [SourceLoader(spec, partitions={0: (2, {p})}) for p in (0, 1)]
    owned = [0, 0]
    for meta in epoch_blocks(whole, 0):
        owners = [h.owns(0, meta.key) for h in halves]
        assert sum(owners) == 1, "every block has exactly one owner"
        mine, other = halves[owners.index(True)], halves[owners.index(False)]
        owned[owners.index(True)] += 1
        np.testing.assert_array_equal(mine.block_meta(0, meta.key).rows, meta.rows)
        with pytest.raises(ValueError, match="partition"):
            other.block_meta(0, meta.key)
        assert not mine.owns(1, whole.first_key(1)), "a loader owns only the sources it was given"
    assert min(owned) > 0
    only_b = SourceLoader(spec, source_indices=[1])
    assert only_b.owns(1, whole.first_key(1)) and not only_b.owns(0, whole.first_key(0))
    for loader in (whole, *halves, only_b):
        loader.close()
