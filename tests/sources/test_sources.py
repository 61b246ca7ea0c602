"""Sources: Parquet and JSONL readers, deterministic per-epoch order, cursors, epoch rollover."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import plait
from plait.sources import Source
from helpers import expected_tokens, make_spec, run_all_ranks, text_source, token_jsonl, token_parquet, write_jsonl


def source_of(ds, seed: int = 0, index: int = 0) -> Source:
    spec = plait.load_spec(make_spec([ds], seed=seed))
    return Source(spec.sources[0], index, seed)


def walk(src: Source, epochs: int) -> dict[int, list[tuple[int, int]]]:
    """(shard, row) of every kept document in the source's order, per epoch."""
    out: dict[int, list] = {}
    key = src.first_key()
    while key[0] < epochs:
        block = src.read_block(key)
        out.setdefault(key[0], []).extend(zip(np.full(len(block.rows), block.shard).tolist(), block.rows.tolist()))
        assert np.all(np.diff(block.positions) > 0)
        key = src.next_key(key)
    return out


def doc_tokens(block, i) -> np.ndarray:
    return block.tokens[block.starts[i] : block.starts[i] + block.lengths[i]]


def check_all_docs(src: Source, ds) -> None:
    """Reading every block of epoch 0 yields exactly the expected documents."""
    expected = expected_tokens(ds)
    seen = {}
    key = src.first_key()
    while key[0] == 0:
        block = src.read_block(key)
        for i in range(len(block.rows)):
            seen[(block.shard, int(block.rows[i]))] = doc_tokens(block, i)
        key = src.next_key(key)
    assert seen.keys() == expected.keys()
    for k, v in expected.items():
        np.testing.assert_array_equal(seen[k], v, err_msg=str(k))


# ----- Parquet ----------------------------------------------------------------------------------
def test_parquet_blocks_are_row_groups(tmp_path):
    ds = token_parquet(tmp_path, files=3, docs_per_file=23, row_group_size=5)
    src = source_of(ds)
    assert src.files == ds.files
    for f in range(3):
        assert src.num_blocks(f) == pq.ParquetFile(ds.files[f]).num_row_groups == 5
    key = src.first_key()
    block = src.read_block(key)
    f = int(src.file_order(0)[key[1]])
    b = int(src.block_order(0, f)[key[2]])
    rg_rows = pq.ParquetFile(ds.files[f]).metadata.row_group(b).num_rows
    assert block.num_positions == rg_rows
    assert sorted(block.rows.tolist()) == list(range(5 * b, 5 * b + rg_rows))


def test_parquet_reads_only_the_needed_column(tmp_path, monkeypatch):
    ds = token_parquet(tmp_path, files=2, docs_per_file=10, row_group_size=4)
    calls = []
    original = pq.ParquetFile.read_row_group

    def spy(self, i, columns=None, **kw):
        calls.append(columns)
        return original(self, i, columns=columns, **kw)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    monkeypatch.setattr(pq.ParquetFile, "read", lambda *a, **k: pytest.fail("whole-file read"))
    check_all_docs(source_of(ds), ds)
    assert calls and all(c == ["input_ids"] for c in calls)
    assert len(calls) == 2 * 3  # one call per row group, each read once


def test_parquet_int32_tokens_are_zero_copy(tmp_path):
    """list<int32> token ids are handed over as a view of the Arrow buffer: no per-token Python work."""
    ds = token_parquet(tmp_path, files=1, docs_per_file=30, row_group_size=30)
    block = source_of(ds).read_block((0, 0, 0))
    assert block.tokens.dtype == np.int32
    assert not block.tokens.flags.owndata
    check_all_docs(source_of(ds), ds)


@pytest.mark.parametrize("value_type", [pa.int64(), pa.uint16(), pa.uint32()])
def test_parquet_other_int_tokens_and_bos_eos(tmp_path, value_type):
    ds = token_parquet(tmp_path, files=2, docs_per_file=12, row_group_size=5, value_type=value_type, bos=1001, eos=1002)
    src = source_of(ds)
    assert src.read_block(src.first_key()).tokens.dtype == np.int32
    check_all_docs(src, ds)


def test_parquet_text_bytes(tmp_path):
    ds = text_source(tmp_path, fmt="parquet", files=2, docs_per_file=11, row_group_size=4)
    check_all_docs(source_of(ds), ds)


# ----- JSONL ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "jsonl.zst"])
def test_jsonl_text(tmp_path, fmt):
    ds = text_source(tmp_path, fmt=fmt, files=3, docs_per_file=9, eos=300)
    src = source_of(ds)
    assert all(src.num_blocks(f) == 1 for f in range(3))
    check_all_docs(src, ds)


@pytest.mark.parametrize("compression", ["", "gz", "zst"])
def test_jsonl_tokens(tmp_path, compression):
    ds = token_jsonl(tmp_path, files=2, docs_per_file=10, compression=compression, bos=5000)
    check_all_docs(source_of(ds), ds)


def test_explicit_format_overrides_extension(tmp_path):
    ds = text_source(tmp_path, fmt="jsonl", files=1, docs_per_file=5)
    (tmp_path / "part-000.jsonl").rename(tmp_path / "part-000.data")
    ds = ds.with_options(path=str(tmp_path / "*.data"), format="jsonl")
    ds.files = [str(tmp_path / "part-000.data")]
    check_all_docs(source_of(ds), ds)
    with pytest.raises(plait.SourceError, match="cannot infer the format"):
        source_of(ds.with_options(format=None))


def test_directory_and_list_paths(tmp_path):
    ds = token_parquet(tmp_path / "d", files=2, docs_per_file=4, row_group_size=4)
    assert source_of(ds.with_options(path=str(tmp_path / "d"))).files == ds.files
    assert source_of(ds.with_options(path=list(reversed(ds.files)))).files == ds.files


# ----- order, cursor, epochs --------------------------------------------------------------------
def test_each_epoch_is_a_new_permutation_of_all_documents(tmp_path):
    ds = token_parquet(tmp_path / "p", files=3, docs_per_file=9, row_group_size=4)
    js = text_source(tmp_path / "j", fmt="jsonl.gz", files=3, docs_per_file=7)
    for d in (ds, js):
        orders = walk(source_of(d), epochs=3)
        assert sorted(orders) == [0, 1, 2]
        for epoch, order in orders.items():
            assert len(order) == len(set(order)) == len(d.docs), f"epoch {epoch}: every document exactly once"
            assert set(order) == set(d.docs)
        assert orders[0] != orders[1] != orders[2] != orders[0], "the order must differ between epochs"
        again = walk(source_of(d), epochs=3)
        assert again == orders, "the order must be the same in every run"
        assert walk(source_of(d, seed=1), epochs=1)[0] != orders[0], "the seed must change the order"
    # shards and blocks are shuffled too, not only rows: the first document does not always come from file 0
    firsts = {walk(source_of(ds, seed=s), epochs=1)[0][0][0] for s in range(8)}
    assert len(firsts) > 1


def test_source_order_depends_on_its_index(tmp_path):
    ds = token_parquet(tmp_path, files=2, docs_per_file=10, row_group_size=5)
    assert walk(source_of(ds, index=0), 1) != walk(source_of(ds, index=1), 1)


def test_cursor_is_small_and_serialisable(tmp_path):
    ds = token_parquet(tmp_path, files=2, docs_per_file=10, row_group_size=5)
    loader = plait.Loader(make_spec([ds], seq_len=32), steps=3, read_ahead=0)
    list(loader)
    state = loader.state_dict()
    cursor = state["data"]["sources"]["tok"]["cursor"]
    assert len(cursor) == 5 and all(isinstance(x, int) for x in cursor)
    assert json.loads(json.dumps(state)) == state


def test_epochs_roll_over_in_the_stream(tmp_path):
    """Streaming past the end of a small source: each epoch delivers each document exactly once."""
    ds = token_parquet(tmp_path, files=2, docs_per_file=8, row_group_size=3, lo=5, hi=40)
    spec = plait.load_spec(make_spec([ds], seq_len=64, microbatches=2, dp=2))
    total = sum(len(v) for v in expected_tokens(ds).values())
    steps = 3 * total // (2 * 2 * 64) + 2
    batches, rt, drawn = run_all_ranks(spec, steps, record_drawn=True)
    # delivered, plus what the Planner still carries to the next step
    ids = np.concatenate([mb.sample_ids for mb in batches] + [rt.planner.carry.sample_ids()])
    rt.close()
    first_chunks = ids[ids[:, 4] == 0]
    epochs = sorted(set(first_chunks[:, 1].tolist()))
    assert len(epochs) >= 3, "the run must cover two full epochs"
    for e in epochs[:-1]:  # the last epoch may be partial
        docs = [tuple(r) for r in first_chunks[first_chunks[:, 1] == e][:, 2:4].tolist()]
        assert len(docs) == len(set(docs)) == len(ds.docs), f"epoch {e}"


def test_jsonl_other_keys_do_not_matter(tmp_path, monkeypatch):
    """Only the needed key is parsed: messy other keys neither fail nor push reading to the slow path."""
    import plait.sources.jsonl as jsonl_mod
    from helpers import Dataset, write_jsonl

    records = [{"text": "one", "meta": 1}, {"text": "two", "meta": "x"}, {"text": "three", "meta": {"a": [1, "b"]}}]
    write_jsonl(tmp_path / "a.jsonl.gz", records)

    class NoSlowPath:
        @staticmethod
        def loads(*a, **k):
            raise AssertionError("the line-by-line slow path was used")

    monkeypatch.setattr(jsonl_mod, "json", NoSlowPath)
    path = str(tmp_path / "a.jsonl.gz")
    ds = Dataset({"name": "m", "path": path, "text_field": "text"}, [path], {(0, i): r["text"] for i, r in enumerate(records)})
    check_all_docs(source_of(ds), ds)


def test_folder_with_several_formats(tmp_path):
    tok = token_parquet(tmp_path, files=2, docs_per_file=4, row_group_size=4)
    txt = text_source(tmp_path, fmt="ndjson", files=1, docs_per_file=4)
    (tmp_path / "_SUCCESS").write_text("")
    with pytest.raises(plait.SourceError, match="several formats"):
        source_of(tok.with_options(path=str(tmp_path)))
    assert source_of(tok.with_options(path=str(tmp_path), format="parquet")).files == tok.files
    assert source_of(txt.with_options(path=str(tmp_path), format="jsonl")).files == txt.files


def test_blocks_and_rows_are_shuffled_too(tmp_path):
    ds = token_parquet(tmp_path, files=3, docs_per_file=12, row_group_size=4)
    src = source_of(ds)
    per_epoch = {}
    key = src.first_key()
    while key[0] < 2:
        block = src.read_block(key)
        rg = int(block.rows.min()) // 4
        per_epoch.setdefault(key[0], []).append((block.shard, rg, tuple(block.rows.tolist())))
        key = src.next_key(key)
    for epoch, blocks in per_epoch.items():
        assert len(blocks) == 9 and len({b[:2] for b in blocks}) == 9
        within_file = [[b[1] for b in blocks if b[0] == f] for f in range(3)]
        rows_sorted = [list(b[2]) == sorted(b[2]) for b in blocks]
        assert not all(order == sorted(order) for order in within_file), "row groups are visited in a shuffled order"
        assert not all(rows_sorted), "rows inside a row group are shuffled"
    assert [b[:2] for b in per_epoch[0]] != [b[:2] for b in per_epoch[1]]


def test_empty_documents_are_counted_and_reported_not_silently_dropped(tmp_path):
    """A record whose text is "" (no bos/eos) has no tokens: nothing to train on, but it is counted."""
    from plait.spec import load_spec
    from plait.cli.stream import stream

    records = [{"text": "" if i % 5 == 0 else f"document number {i}"} for i in range(40)]
    write_jsonl(tmp_path / "a.jsonl", records)
    spec = load_spec(make_spec([{"name": "t", "path": str(tmp_path / "a.jsonl"), "text_field": "text"}],
                               seq_len=64, microbatches=2))
    summary = stream(spec, steps=12, progress=False)
    # 40 records (~18 byte tokens each), 8 of them empty: 12 steps of 128 tokens go through the file
    # more than twice, so every empty record was drawn at least twice.
    assert summary["empty_documents"] >= 16
