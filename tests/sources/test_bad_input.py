"""Bad input: errors name source, shard and record; on_error: raise | skip; skips are counted, never silent."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import plait
from plait import cli
from plait.errors import SourceError
from helpers import (
    Dataset,
    docs_in_batch,
    expected_tokens,
    make_spec,
    text_source,
    token_parquet,
    write_jsonl,
    write_text_parquet,
)

SEQ = 4096  # every document fits: one chunk each


def stream_epoch0(ds: Dataset, steps: int = 4, read_ahead: int = 0, seq_len: int = SEQ) -> tuple[dict, dict]:
    """(shard, row) -> tokens of every epoch-0 document delivered, and the error report."""
    loader = plait.Loader(make_spec([ds], seq_len=seq_len, microbatches=1), steps=steps, read_ahead=read_ahead)
    got = {}
    for mb in loader:
        for (source, epoch, shard, row, chunk), toks in docs_in_batch(mb):
            if epoch == 0:
                assert (shard, row) not in got
                got[(shard, row)] = toks
    report = loader.error_report()
    loader.close()
    return got, report


def assert_streams_the_rest(ds: Dataset, got: dict) -> None:
    expected = expected_tokens(ds)  # without ds.bad
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        np.testing.assert_array_equal(got[k], v)


def raises_source_error(ds: Dataset, steps: int = 4, read_ahead: int = 0) -> SourceError:
    with pytest.raises(SourceError) as info:
        loader = plait.Loader(make_spec([ds], seq_len=SEQ, microbatches=1), steps=steps, read_ahead=read_ahead)
        list(loader)
    return info.value


# ----- corrupt Parquet ----------------------------------------------------------------------------
@pytest.fixture
def garbage_parquet(tmp_path) -> Dataset:
    ds = token_parquet(tmp_path, files=3, docs_per_file=6, row_group_size=3, lo=2, hi=30)
    Path(ds.files[1]).write_bytes(b"not a parquet file " * 40)
    ds.bad = {k for k in ds.docs if k[0] == 1}
    return ds


@pytest.mark.parametrize("prefetch", [0, 2])
def test_corrupt_parquet_raises_naming_source_and_shard(garbage_parquet, prefetch):
    err = raises_source_error(garbage_parquet, read_ahead=prefetch)
    assert err.source == "tok"
    assert err.shard == garbage_parquet.files[1]
    assert "cannot open" in err.reason and "tok" in str(err) and "part-001.parquet" in str(err)


def test_corrupt_parquet_skipped_and_counted(garbage_parquet):
    got, report = stream_epoch0(garbage_parquet.with_options(on_error="skip"))
    assert_streams_the_rest(garbage_parquet, got)
    assert report["tok"]["bad_records"] == 1
    [msg] = report["tok"]["messages"]
    assert "part-001.parquet" in msg and "cannot open" in msg


@pytest.fixture
def corrupt_row_group(tmp_path) -> Dataset:
    """A file whose footer is fine but whose first row group's pages are garbage."""
    ds = token_parquet(tmp_path, files=2, docs_per_file=6, row_group_size=3, lo=2, hi=30)
    data = bytearray(Path(ds.files[0]).read_bytes())
    data[8:120] = b"\xff" * 112  # inside row group 0's token column chunk (it starts at byte 4)
    Path(ds.files[0]).write_bytes(bytes(data))
    ds.bad = {(0, r) for r in range(3)}
    return ds


def test_corrupt_row_group_names_the_block(corrupt_row_group):
    err = raises_source_error(corrupt_row_group)
    assert (err.source, err.shard, err.record) == ("tok", corrupt_row_group.files[0], "block 0")
    assert "cannot read" in err.reason


def test_corrupt_row_group_skipped(corrupt_row_group):
    got, report = stream_epoch0(corrupt_row_group.with_options(on_error="skip"))
    assert_streams_the_rest(corrupt_row_group, got)
    assert report["tok"]["bad_records"] == 1 and "block 0" in report["tok"]["messages"][0]


def test_missing_column(tmp_path):
    ds = token_parquet(tmp_path, files=2, docs_per_file=4, row_group_size=4).with_options(tokens_field="ids")
    err = raises_source_error(ds)
    assert err.source == "tok" and err.shard in ds.files and "no column 'ids'" in err.reason
    # skip: every shard is bad, so the source has nothing at all: still an error, with the cause
    err = raises_source_error(ds.with_options(on_error="skip"))
    assert err.source == "tok" and "no readable" in err.reason and "no column 'ids'" in err.reason


def test_wrong_column_type(tmp_path):
    ds = text_source(tmp_path, fmt="parquet", files=1, docs_per_file=4).with_options(text_field=None, tokens_field="text")
    err = raises_source_error(ds)
    assert err.source == "txt" and err.shard == ds.files[0] and "not a list of ints" in err.reason


# ----- bad records -------------------------------------------------------------------------------
@pytest.fixture
def messy_jsonl(tmp_path) -> Dataset:
    """Good records mixed with a malformed line, a null, a missing field and a wrong type."""
    records = [
        {"text": "first good"},
        '{"text": "unterminated',
        {"text": "second good"},
        {"text": None},
        {"other": "no text here"},
        {"text": 12345},
        {"text": "last good"},
    ]
    write_jsonl(tmp_path / "a.jsonl", records)
    write_jsonl(tmp_path / "b.jsonl.gz", [{"text": f"clean {i}"} for i in range(5)])
    files = sorted(str(p) for p in tmp_path.glob("*.jsonl*"))
    docs = {(0, i): r["text"] for i, r in enumerate(records) if isinstance(r, dict) and isinstance(r.get("text"), str)}
    docs.update({(1, i): f"clean {i}" for i in range(5)})
    return Dataset({"name": "chat", "path": str(tmp_path / "*.jsonl*"), "text_field": "text", "eos": 256}, files, docs)


def test_malformed_json_line_raises_naming_the_record(messy_jsonl):
    err = raises_source_error(messy_jsonl)
    assert (err.source, err.shard, err.record) == ("chat", messy_jsonl.files[0], "1")
    assert "malformed JSON" in err.reason
    assert "record 1" in str(err)


def test_bad_records_skipped_counted_and_the_rest_streams(messy_jsonl):
    got, report = stream_epoch0(messy_jsonl.with_options(on_error="skip"), read_ahead=2)
    assert_streams_the_rest(messy_jsonl, got)
    rep = report["chat"]
    assert rep["bad_records"] == 4, "each bad record once, however many epochs re-read it"
    assert rep["skipped"] >= 4 and rep["skipped"] % 4 == 0, "and counted in every epoch that met them"
    text = "\n".join(rep["messages"])
    for record, reason in (("1", "malformed JSON"), ("3", "missing"), ("4", "missing"), ("5", "not a string")):
        assert any(f"record {record}:" in m and reason in m for m in rep["messages"]), text


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_null_field_raises_naming_the_record(tmp_path, fmt):
    values = ["aa", "bb", None, "dd"]
    if fmt == "parquet":
        write_text_parquet(tmp_path / "x.parquet", values, row_group_size=2)
    else:
        write_jsonl(tmp_path / "x.jsonl", [{"text": v} for v in values])
    path = str(tmp_path / f"x.{fmt}")
    ds = Dataset({"name": "n", "path": path, "text_field": "text"}, [path],
                 {(0, i): v for i, v in enumerate(values) if v is not None})
    err = raises_source_error(ds, steps=1)
    assert (err.source, err.shard, err.record) == ("n", path, "2")
    assert "null or missing" in err.reason
    got, report = stream_epoch0(ds.with_options(on_error="skip"), steps=2, seq_len=16)
    assert_streams_the_rest(ds, got)
    assert report["n"]["bad_records"] == 1


def test_missing_file_and_empty_glob(tmp_path):
    """Configuration errors fail at once whatever the policy: a missing path is not 'bad data'."""
    for on_error in ("raise", "skip"):
        src = {"name": "gone", "path": str(tmp_path / "nope.parquet"), "tokens_field": "t", "on_error": on_error}
        with pytest.raises(SourceError) as info:
            plait.Loader(make_spec([src]))
        assert info.value.source == "gone" and info.value.shard == src["path"] and "no such file" in info.value.reason
        src = {**src, "path": str(tmp_path / "*.parquet")}
        with pytest.raises(SourceError) as info:
            plait.Loader(make_spec([src]))
        assert info.value.source == "gone" and "matches no files" in info.value.reason


def test_source_with_only_bad_records(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["{broken", "{also broken"])
    ds = Dataset({"name": "junk", "path": str(tmp_path / "*.jsonl"), "text_field": "text", "on_error": "skip"}, [], {})
    err = raises_source_error(ds)
    assert err.source == "junk" and "no readable" in err.reason


def test_source_with_only_empty_documents(tmp_path):
    """Empty documents carry no tokens: a source of only those must fail, not hang."""
    write_jsonl(tmp_path / "a.jsonl", [{"text": ""}] * 3)
    ds = Dataset({"name": "void", "path": str(tmp_path / "*.jsonl"), "text_field": "text"}, [], {})
    err = raises_source_error(ds)
    assert err.source == "void" and "no readable" in err.reason


def test_one_bad_source_does_not_stop_the_others(messy_jsonl, tmp_path):
    good = token_parquet(tmp_path / "good", files=1, docs_per_file=6, row_group_size=3)
    spec = make_spec([good, messy_jsonl.with_options(on_error="skip")], seq_len=128)
    loader = plait.Loader(spec, steps=6, read_ahead=0)
    sources = {int(s) for mb in loader for s in mb.source_ids}
    assert sources == {0, 1}
    report = loader.error_report()
    assert report["tok"] == {"skipped": 0, "bad_records": 0, "messages": []} and report["chat"]["bad_records"] == 4


# ----- reported by `plait run` --------------------------------------------------------------------
def test_plait_run_reports_skips(messy_jsonl, tmp_path, capsys):
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(make_spec([messy_jsonl.with_options(on_error="skip")], seq_len=128)))
    out_json = tmp_path / "summary.json"
    assert cli.main(["run", str(spec_path), "--steps", "3", "--json", str(out_json)]) == 0
    summary = json.loads(out_json.read_text())
    assert summary["bad_records"] == {"chat": 4} and summary["errors"]["chat"] % 4 == 0  # once per epoch each
    assert len(summary["error_messages"]["chat"]) == 4
    printed = capsys.readouterr()
    assert "bad records skipped" in printed.out and "4 bad record(s) skipped" in printed.out
    assert "record 1: malformed JSON" in printed.out
    # with raise, the run stops with the error and exit status 2, no stack trace
    spec_path.write_text(yaml.safe_dump(make_spec([messy_jsonl], seq_len=128)))
    assert cli.main(["run", str(spec_path), "--steps", "3", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "source 'chat'" in err and "record 1" in err and "Traceback" not in err


def test_bad_token_ids_are_per_record(tmp_path):
    """A null inside a token list, or an id outside 0..2^31-1, is that record's problem, not silent garbage."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    lists = [[1, 2], [3, None, 5], [6], [7, -1], [8, 2**31], [9, 10]]
    path = str(tmp_path / "ids.parquet")
    pq.write_table(pa.table({"ids": pa.array(lists, pa.list_(pa.int64()))}), path, row_group_size=3)
    ds = Dataset({"name": "ids", "path": path, "tokens_field": "ids"}, [path],
                 {(0, 0): [1, 2], (0, 2): [6], (0, 5): [9, 10]})
    err = raises_source_error(ds, steps=1)
    assert (err.source, err.shard, err.record) == ("ids", path, "1") and "null" in err.reason
    got, report = stream_epoch0(ds.with_options(on_error="skip"), steps=2, seq_len=16)
    assert_streams_the_rest(ds, got)
    assert report["ids"]["bad_records"] == 3
    assert sorted(m.split("record ")[1].split(":")[0] for m in report["ids"]["messages"]) == ["1", "3", "4"]


def test_unusable_tokenizer_or_filesystem_names_the_source(tmp_path):
    ds = text_source(tmp_path / "t", files=1, docs_per_file=3)
    (tmp_path / "broken.json").write_text("{not json")
    for tok, reason in ((tmp_path / "none.json", "FileNotFoundError"), (tmp_path / "broken.json", "cannot load tokenizer")):
        with pytest.raises(SourceError) as info:
            plait.Loader(make_spec([ds.with_options(tokenizer=str(tok))]))
        assert info.value.source == "txt" and reason in str(info.value) and str(tok) in str(info.value)
    with pytest.raises(SourceError) as info:
        plait.Loader(make_spec([ds.with_options(path="nosuchproto://bucket/*.jsonl")]))
    assert info.value.source == "txt" and "Protocol not known" in info.value.reason


_KINDS = {
    "good": lambda i: json.dumps({"text": f"doc {i}", "n": i}),
    "malformed": lambda i: '{"text": "cut',
    "null": lambda i: json.dumps({"text": None}),
    "missing": lambda i: json.dumps({"body": "x"}),
    "number": lambda i: json.dumps({"text": i}),
    "list": lambda i: '["not", "an", "object"]',
}


@settings(max_examples=25)
@given(kinds=st.lists(st.sampled_from(sorted(_KINDS)), min_size=1, max_size=12), blank_every=st.integers(0, 4))
def test_any_mix_of_bad_lines(tmp_path_factory, kinds, blank_every):
    """Whatever the mix: with skip, exactly the good records arrive and each bad one is counted once,
    with its record index (blank lines do not count as records)."""
    if "good" not in kinds:
        kinds = [*kinds, "good"]
    root = tmp_path_factory.mktemp("mix")
    lines = []
    for i, kind in enumerate(kinds):
        if blank_every and i % blank_every == 0:
            lines.append("")
        lines.append(_KINDS[kind](i))
    (root / "a.jsonl").write_text("\n".join(lines) + "\n")
    path = str(root / "a.jsonl")
    ds = Dataset({"name": "mix", "path": path, "text_field": "text", "on_error": "skip"}, [path],
                 {(0, i): f"doc {i}" for i, k in enumerate(kinds) if k == "good"})
    got, report = stream_epoch0(ds, steps=2, seq_len=max(16, 8 * len(kinds)))  # step 2 delivers any carry
    assert_streams_the_rest(ds, got)
    bad = [i for i, k in enumerate(kinds) if k != "good"]
    assert report["mix"]["bad_records"] == len(bad)
    assert sorted(int(m.split("record ")[1].split(":")[0]) for m in report["mix"]["messages"]) == bad
