"""Object storage: sources on S3 through fsspec/s3fs, against a real S3-compatible HTTP server.

The server is moto's standalone server (`moto.server.ThreadedMotoServer`) listening on loopback: it
speaks the S3 REST protocol over HTTP, so requests go through s3fs -> aiobotocore -> HTTP exactly as
they would to S3 or MinIO (no in-process mocking of boto).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import plait
from plait.errors import SourceError
from helpers import assert_batches_equal, make_spec, text_source, token_jsonl, token_parquet, train_tokenizer

moto_server = pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")

BUCKET = "plait-test"
KEY, SECRET = "testing", "testing"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """(endpoint_url, storage_options, local root) with datasets uploaded under s3://BUCKET/."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        import boto3

        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                     region_name="us-east-1").create_bucket(Bucket=BUCKET)
        root = tmp_path_factory.mktemp("s3data")
        datasets = {
            "tok": token_parquet(root / "tok", name="tok", files=3, docs_per_file=12, row_group_size=5, lo=5, hi=150),
            "web": text_source(root / "web", fmt="parquet", name="web", files=2, docs_per_file=10, eos=1),
            "chat": text_source(root / "chat", fmt="jsonl.gz", name="chat", files=2, docs_per_file=10, eos=1),
            "code": text_source(root / "code", fmt="jsonl.zst", name="code", files=2, docs_per_file=8, eos=1),
            "ids": token_jsonl(root / "ids", name="ids", files=2, docs_per_file=8, bos=0),
        }
        tokenizer = train_tokenizer(root / "tokenizer.json")
        options = {"endpoint_url": endpoint, "key": KEY, "secret": SECRET,
                   "client_kwargs": {"region_name": "us-east-1"}}
        fs = s3fs.S3FileSystem(**options)
        fs.put(str(root) + "/", f"{BUCKET}/data/", recursive=True)
        yield {"endpoint": endpoint, "options": options, "root": root, "datasets": datasets, "tokenizer": tokenizer, "fs": fs}
    finally:
        server.stop()


def to_s3(s3, ds, **extra) -> dict:
    """The dataset's spec entry with its path (and tokenizer) moved to the bucket."""
    root = str(s3["root"])
    src = {**ds.source, **extra}
    src["path"] = src["path"].replace(root, f"s3://{BUCKET}/data")
    if src.get("tokenizer"):
        src["tokenizer"] = src["tokenizer"].replace(root, f"s3://{BUCKET}/data")
    src["storage_options"] = s3["options"]
    return src


def test_objects_are_on_the_server(s3):
    listed = s3["fs"].find(f"{BUCKET}/data")
    assert any(p.endswith("tok/part-002.parquet") for p in listed)
    assert any(p.endswith("code/part-001.jsonl.zst") for p in listed)


def test_s3_files_listed_like_local(s3):
    from plait.sources import Source

    ds = s3["datasets"]["tok"]
    spec = plait.load_spec(make_spec([to_s3(s3, ds)]))
    src = Source(spec.sources[0], 0, 0)
    assert [f.rsplit("/", 1)[1] for f in src.files] == [f.rsplit("/", 1)[1] for f in ds.files]
    assert all(f.startswith(f"s3://{BUCKET}/data/tok/") for f in src.files)
    src.close()


def test_s3_stream_equals_local_stream(s3):
    """Same files on S3 and on disk: the same sample ids and tokens, batch for batch."""
    d = s3["datasets"]
    tok = s3["tokenizer"]
    local = [d["tok"].source, d["web"].with_options(tokenizer=tok).source, d["chat"].source, d["code"].source, d["ids"].source]
    remote = [to_s3(s3, d["tok"]), to_s3(s3, d["web"], tokenizer=tok), to_s3(s3, d["chat"]), to_s3(s3, d["code"]),
              to_s3(s3, d["ids"])]
    layout = {"seq_len": 96, "microbatches": 2, "dp": 2, "seed": 3}
    remote_all = []
    for rank in range(2):
        a = list(plait.Loader(make_spec(local, **layout), dp_rank=rank, steps=6, read_ahead=0))
        b = list(plait.Loader(make_spec(remote, **layout), dp_rank=rank, steps=6, read_ahead=2))
        assert_batches_equal(a, b)
        assert len({int(s) for mb in b for s in mb.source_ids}) == 5, "every source must be exercised"
        remote_all += b
    assert any(int(mb.sample_ids[:, 4].max()) > 0 for mb in remote_all), "long documents (chunks) must be exercised"


def test_s3_resume(s3):
    spec = make_spec([to_s3(s3, s3["datasets"]["tok"]), to_s3(s3, s3["datasets"]["chat"])], seq_len=64)
    full = list(plait.Loader(spec, steps=4, read_ahead=0))
    first = plait.Loader(spec, steps=4, read_ahead=0)
    it = iter(first)
    head = [next(it) for _ in range(3)]
    it.close()
    state = json.loads(json.dumps(first.state_dict()))
    assert "storage_options" not in json.dumps(state) and SECRET not in json.dumps(state)
    resumed = plait.Loader(spec, steps=4, read_ahead=0)
    resumed.load_state_dict(state)
    assert_batches_equal(head + list(resumed), full)


def test_s3_missing_objects(s3):
    missing = {**to_s3(s3, s3["datasets"]["tok"]), "path": f"s3://{BUCKET}/data/nothing/*.parquet"}
    with pytest.raises(SourceError) as info:
        plait.Loader(make_spec([missing]))
    assert info.value.source == "tok" and "matches no files" in info.value.reason


def test_s3_corrupt_object_skipped(s3):
    s3["fs"].pipe(f"{BUCKET}/bad/part-000.parquet", b"garbage" * 50)
    s3["fs"].put(s3["datasets"]["tok"].files[0], f"{BUCKET}/bad/part-001.parquet")
    src = {**to_s3(s3, s3["datasets"]["tok"]), "path": f"s3://{BUCKET}/bad/*.parquet", "on_error": "skip"}
    loader = plait.Loader(make_spec([src], seq_len=64), steps=4, read_ahead=0)
    shards = np.concatenate([mb.sample_ids[:, 2] for mb in loader])
    assert set(shards.tolist()) == {1}
    report = loader.error_report()["tok"]
    assert report["skipped"] == 1 and "part-000.parquet" in report["messages"][0]


def test_s3_read_ahead_is_bounded_by_the_sources_buffer(s3, tmp_path, monkeypatch):
    """s3fs reads ahead in 50 MiB blocks per open file by default: 64 sources would hold GiBs. A source
    streaming a large row group in pieces keeps its remote handle's read-ahead within STREAM_BLOCK."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from plait.sources import Source
    from plait.sources.reader import STREAM_BLOCK, FormatReader

    handles = []
    real_open = FormatReader.open_stream
    monkeypatch.setattr(FormatReader, "open_stream", lambda self, path: handles.append(real_open(self, path)) or handles[-1])

    rng = np.random.default_rng(0)
    lengths = rng.integers(500, 3000, size=6000)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(2, 30000, offsets[-1], dtype=np.int32)))
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"input_ids": ids}), path, row_group_size=len(lengths), compression="none")  # ~40 MiB
    s3["fs"].put(str(path), f"{BUCKET}/big/part-000.parquet")
    spec = plait.load_spec(make_spec([{"name": "big", "path": f"s3://{BUCKET}/big/*.parquet", "tokens_field": "input_ids",
                                        "buffer_mb": 2, "storage_options": s3["options"]}]))
    src = Source(spec.sources[0], 0, 0)
    key, held = src.first_key(), []
    for _ in range(6):
        block = src.read_block(key)
        assert block.nbytes <= 2 << 20  # a piece, not the ~40 MiB row group
        (handle,) = handles  # the remote file, opened once
        held.append(len(handle.cache.cache))  # fsspec's ReadAheadCache: the bytes it holds
        key = src.next_key(key)
    assert 0 < max(held) <= STREAM_BLOCK[0] + (1 << 20), held  # a block plus one read, never s3fs's 50 MiB
