"""Read-only formats: Megatron-Core indexed datasets, Hugging Face Arrow shards, MosaicML MDS shards.

Files are written by the layout writers of tests/helpers.py (write_megatron, write_arrow_stream,
write_mds); where the reference writer is installed (megatron-core, datasets, mosaicml-streaming)
the tests at the end check that it writes the same bytes and that plait reads its files.
"""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import plait
import plait.sources.mds as mds_format
import plait.sources.megatron as megatron_format
from plait.errors import SourceError, SpecError
from plait.sources import Source
from helpers import (
    arrow_source, assert_batches_equal, encode_expected, make_spec, mds_source, megatron_source, token_docs,
    write_arrow_stream, write_mds, write_megatron,
)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks of a few records, so that small files hold several blocks (order, resume across blocks)."""
    monkeypatch.setattr(megatron_format, "BLOCK", 7)
    monkeypatch.setattr(mds_format, "BLOCK", 6)


def source_of(ds, **options) -> Source:
    spec = plait.load_spec(make_spec([ds.with_options(**options) if options else ds]))
    return Source(spec.sources[0], 0, spec.seed, vocab_size=spec.vocab_size)


def epoch_docs(src: Source) -> dict[tuple[int, int], np.ndarray]:
    """(shard, row) -> tokens of every document of epoch 0, read block by block in the source's order."""
    out = {}
    key = src.first_key()
    while key[0] == 0:
        block = src.read_block(key)
        for i in range(len(block.rows)):
            out[(block.shard, int(block.rows[i]))] = block.tokens[block.starts[i] : block.starts[i] + block.lengths[i]]
        key = src.next_key(key)
    return out


def check_reads_all(ds, **options) -> Source:
    src = source_of(ds, **options)
    got = epoch_docs(src)
    source = {**ds.source, **options}
    assert set(got) == set(ds.docs) - ds.bad
    for k, v in got.items():
        np.testing.assert_array_equal(v, encode_expected(ds.docs[k], source), err_msg=str(k))
    return src


SOURCES = {
    "megatron": lambda root: megatron_source(root, files=2, docs_per_file=30),
    "megatron-uint16": lambda root: megatron_source(root, files=2, docs_per_file=20, dtype=np.uint16),
    "arrow": lambda root: arrow_source(root, files=2, docs_per_file=30, batch_rows=8),
    "mds": lambda root: mds_source(root, docs=40, per_shard=15),
    "mds-zstd": lambda root: mds_source(root, docs=40, per_shard=15, compression="zstd"),
    "mds-ndarray-dtype": lambda root: mds_source(root, docs=20, per_shard=9, encoding="ndarray"),
    "mds-uint16": lambda root: mds_source(root, docs=20, per_shard=9, encoding="ndarray:uint16", text=False),
}


@pytest.mark.parametrize("kind", list(SOURCES))
def test_reads_every_document(tmp_path, kind):
    ds = SOURCES[kind](tmp_path / kind)
    check_reads_all(ds)
    check_reads_all(ds, bos=1, eos=2)


@pytest.mark.parametrize("kind", ["megatron", "arrow", "mds", "mds-zstd"])
def test_lengths_for_planning_equal_the_decoded_ones(tmp_path, kind):
    ds = SOURCES[kind](tmp_path / kind)
    src = source_of(ds, eos=2)
    key = src.first_key()
    while key[0] == 0:
        block = src.read_block(key)
        if src.reads_lengths(key):
            meta = src.read_lengths(key)
            for f in ("positions", "rows", "lengths"):
                np.testing.assert_array_equal(getattr(meta, f), getattr(block, f))
        key = src.next_key(key)
    assert src.errors["skipped"] == 0


def test_megatron_and_mds_plan_from_their_index(tmp_path):
    assert source_of(megatron_source(tmp_path / "m")).reads_lengths((0, 0, 0))
    ds = mds_source(tmp_path / "d", text=False)  # the token column is the only variable one
    assert source_of(ds).reads_lengths((0, 0, 0))
    ds = mds_source(tmp_path / "t", text=True)  # a str column too: sizes alone do not tell
    assert not source_of(ds).reads_lengths((0, 0, 0))
    assert source_of(ds, length_field="n_tokens").reads_lengths((0, 0, 0))


def test_text_columns(tmp_path):
    ds = mds_source(tmp_path / "d", docs=12, per_shard=5)
    got = epoch_docs(source_of(ds.with_options(tokens_field=None, text_field="text")))
    assert {k: bytes(v.astype(np.uint8)).decode() for k, v in got.items()} == \
        {(i // 5, i % 5): f"sample {i}" for i in range(12)}
    ds = arrow_source(tmp_path / "a", files=1, docs_per_file=10)
    got = epoch_docs(source_of(ds.with_options(tokens_field=None, text_field="text")))
    assert {k: bytes(v.astype(np.uint8)).decode() for k, v in got.items()} == {(0, i): f"doc 0-{i}" for i in range(10)}


def test_megatron_paths(tmp_path):
    ds = megatron_source(tmp_path / "m", files=3, docs_per_file=5)
    for path in (ds.files, str(tmp_path / "m"), str(tmp_path / "m" / "corpus*_text_document"),
                 [f + ".idx" for f in ds.files]):
        assert source_of(ds.with_options(path=path)).files == ds.files, path
    spec = {"name": "m", "path": ds.files[0]}  # a bare prefix says megatron by itself
    assert source_of(ds.with_options(**spec, format=None, tokens_field="tokens")).files == ds.files[:1]


def test_megatron_spec_fields():
    ok = plait.load_spec(make_spec([{"name": "m", "path": "p", "format": "megatron"}]))
    assert ok.sources[0].tokens_field == "tokens"
    with pytest.raises(SpecError, match="not text"):
        plait.load_spec(make_spec([{"name": "m", "path": "p", "format": "megatron", "text_field": "t"}]))
    with pytest.raises(SpecError, match="length_field does not apply"):
        plait.load_spec(make_spec([{"name": "m", "path": "p", "format": "megatron", "length_field": "n"}]))
    with pytest.raises(SpecError) as info:
        plait.load_spec(make_spec([{"name": "m", "path": "p", "format": "csv", "tokens_field": "t"}]))
    assert all(f in str(info.value) for f in ("parquet", "jsonl", "megatron", "arrow", "mds"))


def test_arrow_file_format_and_hub_cache_names(tmp_path):
    docs = token_docs(12, seed=5)
    table = pa.table({"input_ids": pa.array([d.tolist() for d in docs], pa.list_(pa.int32()))})
    with pa.OSFile(str(tmp_path / "wiki-train-00000-of-00002.arrow"), "wb") as sink:
        with pa.ipc.new_file(sink, table.schema) as w:  # the IPC file format is read too
            w.write_table(table, max_chunksize=5)
    write_arrow_stream(tmp_path / "wiki-train-00001-of-00002.arrow", {"input_ids": table.column(0)}, batch_rows=4)
    src = source_of(plait_dataset(tmp_path, "input_ids"))
    got = epoch_docs(src)
    assert len(got) == 24 and src.num_blocks(0) == 3 and src.num_blocks(1) == 3
    np.testing.assert_array_equal(got[(1, 5)], docs[5])


def plait_dataset(path, field):
    from helpers import Dataset

    return Dataset({"name": "x", "path": str(path), "tokens_field": field}, [], {})


# ----- exact resume --------------------------------------------------------------------------------
STEPS, M, DP = 6, 2, 2


@pytest.mark.parametrize("kind", ["megatron", "arrow", "mds-zstd"])
def test_resume_continues_with_the_same_samples(tmp_path, kind):
    ds = SOURCES[kind](tmp_path / kind)
    spec = plait.load_spec(make_spec([ds.with_options(eos=3)], seq_len=48, microbatches=M, dp=DP))
    for rank in range(DP):
        reference = list(plait.Loader(spec, dp_rank=rank, steps=STEPS, read_ahead=0))
        for n in (1, M + 1, 2 * M + 1):
            first = plait.Loader(spec, dp_rank=rank, steps=STEPS, read_ahead=0)
            it = iter(first)
            head = list(islice(it, n))
            it.close()
            state = json.loads(json.dumps(first.state_dict()))
            first.close()
            resumed = plait.Loader(spec, dp_rank=rank, steps=STEPS, read_ahead=0)
            resumed.load_state_dict(state)
            tail = list(resumed)
            resumed.close()
            assert_batches_equal(head + tail, reference)
        ids = np.concatenate([mb.sample_ids for mb in reference])
        assert len(ids) > 0


# ----- bad input -----------------------------------------------------------------------------------
def errors_of(ds, **options):
    src = source_of(ds, on_error="skip", **options)
    got = epoch_docs(src)
    return src, got


def test_megatron_truncated_bin_names_the_records(tmp_path):
    ds = megatron_source(tmp_path / "m", files=2, docs_per_file=20)
    lengths = [len(ds.docs[(0, r)]) for r in range(20)]
    bin_path = Path(ds.files[0] + ".bin")
    bin_path.write_bytes(bin_path.read_bytes()[: 4 * sum(lengths[:17]) + 2])  # cut inside sequence 17
    with pytest.raises(SourceError) as info:
        epoch_docs(source_of(ds))
    assert info.value.shard == ds.files[0] and info.value.record == "17" and "disagrees" in info.value.reason
    src, got = errors_of(ds)
    assert src.errors["skipped"] == 3 and set(got) == set(ds.docs) - {(0, 17), (0, 18), (0, 19)}


@pytest.mark.parametrize("damage", ["truncated-idx", "magic", "float-dtype", "unknown-dtype", "version"])
def test_megatron_bad_index_is_a_bad_file(tmp_path, damage):
    ds = megatron_source(tmp_path / "m", files=2, docs_per_file=10)
    idx = Path(ds.files[1] + ".idx")
    data = bytearray(idx.read_bytes())
    if damage == "truncated-idx":
        data = data[:-5]
    elif damage == "magic":
        data[0:4] = b"NOPE"
    elif damage == "float-dtype":
        data[17] = 6
    elif damage == "unknown-dtype":
        data[17] = 42
    else:
        data[9] = 2
    idx.write_bytes(bytes(data))
    with pytest.raises(SourceError) as info:
        epoch_docs(source_of(ds))
    assert info.value.shard == ds.files[1]
    src, got = errors_of(ds)
    assert len(src.bad.distinct) == 1 and set(got) == {k for k in ds.docs if k[0] == 0}


def test_arrow_truncated_and_missing_column(tmp_path):
    ds = arrow_source(tmp_path / "a", files=3, docs_per_file=20)
    p = Path(ds.files[1])
    p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])
    with pytest.raises(SourceError) as info:
        epoch_docs(source_of(ds))
    assert info.value.shard == ds.files[1] and "truncated" in info.value.reason
    src, got = errors_of(ds)
    assert len(src.bad.distinct) == 1 and set(got) == {k for k in ds.docs if k[0] != 1}
    with pytest.raises(SourceError, match="no column 'nope'"):
        epoch_docs(source_of(ds.with_options(tokens_field="nope")))


def test_mds_damage(tmp_path):
    ds = mds_source(tmp_path / "d", docs=30, per_shard=10, text=False)
    shard = Path(ds.files[2])
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 20])  # a truncated raw shard: its last samples are bad records
    with pytest.raises(SourceError) as info:
        epoch_docs(source_of(ds))
    assert info.value.shard == str(shard) and info.value.record is not None and "truncated" in info.value.reason
    src, got = errors_of(ds)
    assert 1 <= src.errors["skipped"] <= 2 and len(got) == 30 - src.errors["skipped"]
    shard.write_bytes(data)
    # the index disagrees with the data: another sample count
    index = json.loads((tmp_path / "d" / "index.json").read_text())
    index["shards"][0]["samples"] = 11
    (tmp_path / "d" / "index.json").write_text(json.dumps(index))
    with pytest.raises(SourceError, match="index.json says 11"):
        epoch_docs(source_of(ds))


def test_mds_corrupt_sample_and_wrong_dtype(tmp_path):
    ds = mds_source(tmp_path / "d", docs=12, per_shard=12, text=True)
    shard = Path(ds.files[0])
    data = bytearray(shard.read_bytes())
    n = int(np.frombuffer(data[:4], "<u4")[0])
    ends = np.frombuffer(bytes(data[4 : 4 * (n + 2)]), "<u4")
    data[ends[4] : ends[4] + 4] = np.uint32(10**6).tobytes()  # sample 4's first column size: nonsense
    shard.write_bytes(bytes(data))
    with pytest.raises(SourceError) as info:
        epoch_docs(source_of(ds))
    assert info.value.record == "4" and "column sizes" in info.value.reason
    src, got = errors_of(ds)
    assert src.errors["skipped"] == 1 and (0, 4) not in got and len(got) == 11
    write_mds(tmp_path / "f", [{"ids": np.ones(3, np.float32)}], {"ids": "ndarray:float32"})
    with pytest.raises(SourceError, match="not token ids"):
        epoch_docs(source_of(plait_dataset(tmp_path / "f", "ids").with_options(format="mds")))


def test_mds_corrupt_zstd_is_a_bad_file(tmp_path):
    ds = mds_source(tmp_path / "d", docs=30, per_shard=10, compression="zstd")
    p = Path(ds.files[1])
    p.write_bytes(p.read_bytes()[:-7])
    with pytest.raises(SourceError, match="cannot decompress"):
        epoch_docs(source_of(ds))
    src, got = errors_of(ds)
    assert len(src.bad.distinct) == 1 and set(got) == {k for k in ds.docs if k[0] != 1}


def test_out_of_vocab_found_on_decode_under_index_lengths(tmp_path):
    """Megatron plans from its index; a record found bad only when its tokens are read is still named."""
    ds = megatron_source(tmp_path / "m", files=1, docs_per_file=10, vocab=1000)
    spec = plait.load_spec(make_spec([ds], vocab_size=500))
    src = Source(spec.sources[0], 0, spec.seed, vocab_size=500)
    with pytest.raises(SourceError, match="outside the vocabulary"):
        epoch_docs(src)


# ----- reference writers (when installed) ---------------------------------------------------------
def test_megatron_reference_writer(tmp_path):
    torch = pytest.importorskip("torch")
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    docs = token_docs(25, seed=4)
    builder = indexed.IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.uint16)
    for d in docs:
        builder.add_item(torch.from_numpy(d.astype(np.int64)))
        builder.end_document()
    builder.finalize(str(tmp_path / "ref.idx"))
    write_megatron(tmp_path / "mine", docs, dtype=np.uint16)
    for ext in (".bin", ".idx"):
        assert (tmp_path / ("ref" + ext)).read_bytes() == (tmp_path / ("mine" + ext)).read_bytes()
    got = epoch_docs(source_of(plait_dataset(tmp_path / "ref", "tokens").with_options(format="megatron")))
    assert all(np.array_equal(got[(0, i)], d) for i, d in enumerate(docs))


def test_datasets_save_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    docs = token_docs(30, seed=6)
    ds = datasets.Dataset.from_dict({"input_ids": [d.tolist() for d in docs], "n": [len(d) for d in docs]})
    ds.save_to_disk(str(tmp_path / "hf"), num_shards=2)
    src = source_of(plait_dataset(tmp_path / "hf", "input_ids").with_options(format="arrow", length_field="n"))
    got = epoch_docs(src)
    flat = [got[k] for k in sorted(got)]
    assert len(flat) == 30 and all(np.array_equal(a, b) for a, b in zip(flat, docs))


def test_streaming_mds_writer(tmp_path):
    streaming = pytest.importorskip("streaming")
    docs = token_docs(25, seed=8)
    samples = [{"ids": d, "n_tokens": len(d), "text": f"s{i}"} for i, d in enumerate(docs)]
    columns = {"ids": "ndarray:int32", "n_tokens": "int32", "text": "str"}
    for compression in (None, "zstd"):
        out = tmp_path / f"ref-{compression}"
        with streaming.MDSWriter(out=str(out), columns=columns, compression=compression, size_limit=None) as w:
            for s in samples:
                w.write(s)
        mine = write_mds(tmp_path / f"mine-{compression}", samples, columns, compression=compression)
        ref_index = json.loads((out / "index.json").read_text())
        my_index = json.loads((tmp_path / f"mine-{compression}" / "index.json").read_text())
        assert ref_index["shards"][0]["raw_data"] == my_index["shards"][0]["raw_data"]
        if compression is None:
            assert (out / "shard.00000.mds").read_bytes() == Path(mine[0]).read_bytes()
        got = epoch_docs(source_of(plait_dataset(out, "ids").with_options(format="mds", length_field="n_tokens")))
        assert all(np.array_equal(got[(0, i)], d) for i, d in enumerate(docs))
