"""Bad input in the sources layer: corrupt/truncated/empty files whatever the codec, a bad file next to a
good one under `skip` across epochs, messages that name formats and files, and the module layout."""

from __future__ import annotations

import ast
import gzip
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
import zstandard

import plait
from plait import cli
from plait.errors import SourceError, SpecError
from helpers import Dataset, docs_in_batch, expected_tokens, make_spec, token_jsonl, token_parquet, write_jsonl

SEQ = 4096
SOURCES_DIR = Path(plait.__file__).parent / "sources"


def run(ds: Dataset, steps: int = 4, seq_len: int = SEQ, seed: int = 0):
    """Stream `steps` steps: (epoch-0 docs delivered {(shard,row): tokens}, error report)."""
    loader = plait.Loader(make_spec([ds], seq_len=seq_len, microbatches=1, seed=seed), steps=steps, read_ahead=0)
    got = {}
    try:
        for mb in loader:
            for (source, epoch, shard, row, *_), toks in docs_in_batch(mb):
                if epoch == 0 and (shard, row) not in got:
                    got[(shard, row)] = toks
        return got, loader.error_report()
    finally:
        loader.close()


def raises(ds: Dataset, steps: int = 4, seed: int = 0) -> SourceError:
    with pytest.raises(SourceError) as info:
        run(ds, steps=steps, seed=seed)
    return info.value


# ----- 1. corrupt, truncated and empty files, whatever the codec ---------------------------------------
def _corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        path.write_bytes(np.random.default_rng(7).integers(0, 256, 300, dtype=np.uint8).tobytes())
    else:
        raise ValueError(how)


CODECS = [("zst", "truncated"), ("zst", "garbage"), ("gz", "truncated"), ("gz", "garbage")]


@pytest.fixture(params=CODECS, ids=[f"{c}-{h}" for c, h in CODECS])
def corrupt_compressed(request, tmp_path) -> Dataset:
    """Two compressed JSONL files; file 1 corrupt (its codec cannot decompress it)."""
    codec, how = request.param
    ds = token_jsonl(tmp_path, files=2, docs_per_file=200, lo=5, hi=20, compression=codec)
    _corrupt(Path(ds.files[1]), how)
    ds.bad = {k for k in ds.docs if k[0] == 1}
    return ds


def test_corrupt_compressed_file_raises_naming_source_and_file(corrupt_compressed):
    err = raises(corrupt_compressed, steps=40)
    assert err.source == "tokj" and err.shard == corrupt_compressed.files[1]
    assert "cannot decompress" in err.reason or "cannot read" in err.reason
    assert "part-001" in str(err)


def test_corrupt_compressed_file_is_a_named_skip(corrupt_compressed):
    ds = corrupt_compressed.with_options(on_error="skip")
    got, report = run(ds, steps=8)  # ~2,400 good tokens an epoch: ~14 epochs, each meeting the corrupt file
    expected = expected_tokens(ds)
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        np.testing.assert_array_equal(got[k], v)
    assert report["tokj"]["bad_records"] == 1
    [msg] = report["tokj"]["messages"]
    assert "part-001" in msg and "cannot decompress" in msg


@pytest.mark.parametrize("codec,how", CODECS + [("", "truncated")])
def test_corrupt_file_alone_names_the_file(tmp_path, codec, how):
    ds = token_jsonl(tmp_path, files=1, docs_per_file=200, lo=5, hi=20, compression=codec)
    _corrupt(Path(ds.files[0]), how)
    err = raises(ds)
    assert err.source == "tokj" and err.shard == ds.files[0] and "part-000" in str(err), str(err)
    if codec:  # the file as a whole cannot be decompressed: under skip the source has nothing
        assert "cannot decompress" in err.reason
        err = raises(ds.with_options(on_error="skip"))
        assert err.source == "tokj" and "no readable" in err.reason and "part-000" in str(err), str(err)
    else:  # a plain file cut in the middle of a line: that record is malformed, the rest streams
        assert err.record is not None and "malformed JSON" in err.reason
        got, report = run(ds.with_options(on_error="skip"), steps=4)
        assert got and report["tokj"]["bad_records"] == 1
        assert f"record {err.record}: malformed JSON" in report["tokj"]["messages"][0]


def test_inspect_fails_on_a_corrupt_zst_file(tmp_path, capsys):
    ds = token_jsonl(tmp_path / "d", files=2, docs_per_file=200, lo=5, hi=20, compression="zst")
    _corrupt(Path(ds.files[0]), "truncated")
    _corrupt(Path(ds.files[1]), "truncated")
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(make_spec([ds], seq_len=128)))
    assert cli.main(["inspect", str(spec_path)]) != 0
    err = capsys.readouterr().err
    assert "cannot decompress" in err and "part-00" in err and "Traceback" not in err


def _write_empty(root: Path, kind: str) -> Path:
    if kind == "plain":
        path = root / "z-empty.jsonl"
        path.write_bytes(b"")
    elif kind == "blank-lines":
        path = root / "z-empty.jsonl"
        path.write_bytes(b"\n\n  \n")
    elif kind == "zst":
        path = root / "z-empty.jsonl.zst"
        path.write_bytes(zstandard.ZstdCompressor().compress(b""))
    elif kind == "gz":
        path = root / "z-empty.jsonl.gz"
        path.write_bytes(gzip.compress(b""))
    elif kind == "parquet":
        path = root / "z-empty.parquet"
        pq.write_table(pa.table({"ids": pa.array([], pa.list_(pa.int32()))}), str(path))
    return path


EMPTY_KINDS = ["plain", "blank-lines", "zst", "gz", "parquet"]


@pytest.mark.parametrize("kind", EMPTY_KINDS)
def test_empty_file_is_reported(tmp_path, kind):
    """A file that holds no records is not corrupt, but (probably a user mistake) not silent either:
    an error under raise, a counted, named skip under skip."""
    good = token_jsonl(tmp_path, files=1, docs_per_file=10, lo=2, hi=9)
    empty = _write_empty(tmp_path, kind)
    fmt = "parquet" if kind == "parquet" else "jsonl"
    ds = Dataset({"name": "e", "path": [good.files[0], str(empty)], "tokens_field": "ids", "format": fmt},
                 [good.files[0], str(empty)], dict(good.docs))
    if fmt == "parquet":  # keep one format per source: the good file as Parquet too
        good_pq = tmp_path / "good.parquet"
        pq.write_table(pa.table({"ids": pa.array([d.tolist() for d in good.docs.values()], pa.list_(pa.int32()))}),
                       str(good_pq))
        ds = Dataset({**ds.source, "path": [str(good_pq), str(empty)]}, [str(good_pq), str(empty)], dict(good.docs))
    # ~60 tokens a source epoch, 4096 a step: 2 steps are already ~140 epochs, each reading the empty file
    err = raises(ds, steps=2)
    assert err.source == "e" and err.shard == str(empty) and "no records" in err.reason
    got, report = run(ds.with_options(on_error="skip"), steps=2)
    assert {row for (_, row) in got} == set(range(10))
    assert report["e"]["bad_records"] == 1
    [msg] = report["e"]["messages"]
    assert empty.name in msg and "no records" in msg


@pytest.mark.parametrize("kind", EMPTY_KINDS)
def test_empty_file_alone_names_the_file(tmp_path, kind):
    empty = _write_empty(tmp_path, kind)
    ds = Dataset({"name": "e", "path": str(empty), "tokens_field": "ids"}, [str(empty)], {})
    for on_error in ("raise", "skip"):
        err = raises(ds.with_options(on_error=on_error))
        assert err.source == "e" and empty.name in str(err) and "no records" in str(err), str(err)


# ----- 2. a bad file next to a good one, under skip, over many epochs --------------------------------
def _bad_parquet(root: Path, kind: str) -> Path:
    path = root / "part-bad.parquet"
    if kind == "wrong-column":
        pq.write_table(pa.table({"other": pa.array([[1, 2], [3]], pa.list_(pa.int32()))}), str(path))
    else:  # truncated
        token_parquet(root / "tmp", files=1, docs_per_file=20, row_group_size=5)
        data = (root / "tmp" / "part-000.parquet").read_bytes()
        path.write_bytes(data[: len(data) // 2])
    return path


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["wrong-column", "truncated"])
def test_skip_keeps_going_across_epochs_with_one_bad_file(tmp_path, kind, seed):
    good = token_parquet(tmp_path / "good", files=1, docs_per_file=4, row_group_size=2, lo=2, hi=20)
    bad = _bad_parquet(tmp_path, kind)
    files = sorted([good.files[0], str(bad)])
    ds = Dataset({"name": "tok", "path": files, "tokens_field": "input_ids", "on_error": "skip"}, files)
    loader = plait.Loader(make_spec([ds], seq_len=32, microbatches=1, seed=seed), steps=30, read_ahead=0)
    epochs = set()
    for mb in loader:
        epochs.update(int(e) for e in mb.sample_ids[:, 1])
    report = loader.error_report()
    loader.close()
    assert len(epochs) > 3, "the run must cover several epochs"
    assert report["tok"]["bad_records"] == 1 and "part-bad.parquet" in report["tok"]["messages"][0]
    # counted in every epoch whose order passed it (the last epoch's order may stop before it)
    assert report["tok"]["skipped"] >= len(epochs) - 1


def test_all_files_bad_under_skip_names_them(tmp_path):
    bad = _bad_parquet(tmp_path, "truncated")
    other = tmp_path / "part-bad2.parquet"
    other.write_bytes(b"nope" * 50)
    ds = Dataset({"name": "tok", "path": str(tmp_path / "*.parquet"), "tokens_field": "input_ids",
                  "on_error": "skip"}, [])
    err = raises(ds)
    assert "no readable" in err.reason and bad.name in err.reason and other.name in err.reason


# ----- 3. messages ---------------------------------------------------------------------------------------
def test_unknown_extension_lists_the_formats(tmp_path):
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(SourceError) as info:
        plait.Loader(make_spec([{"name": "c", "path": str(tmp_path / "data.csv"), "tokens_field": "t"}]))
    msg = str(info.value)
    assert "set `format`" in msg and "parquet" in msg and "jsonl" in msg and ".jsonl.zst" in msg
    with pytest.raises(SourceError) as info:  # a folder of such files
        plait.Loader(make_spec([{"name": "c", "path": str(tmp_path), "tokens_field": "t"}]))
    assert "parquet" in str(info.value) and "jsonl" in str(info.value)


def test_invalid_format_in_spec_lists_the_formats(tmp_path):
    with pytest.raises(SpecError) as info:
        plait.load_spec(make_spec([{"name": "c", "path": "x.csv", "tokens_field": "t", "format": "csv"}]))
    [(where, reason)] = info.value.problems
    assert where == "sources[0](c).format"
    assert reason == "unknown format 'csv'; supported formats: parquet, jsonl, megatron, arrow, mds, webdataset"


def test_format_set_reads_any_extension(tmp_path):
    write_jsonl(tmp_path / "data.txt", [{"ids": [1, 2, 3]}, {"ids": [4]}])
    ds = Dataset({"name": "t", "path": str(tmp_path / "data.txt"), "tokens_field": "ids", "format": "jsonl"},
                 [str(tmp_path / "data.txt")], {(0, 0): [1, 2, 3], (0, 1): [4]})
    got, _ = run(ds, steps=2, seq_len=16)
    assert got.keys() == {(0, 0), (0, 1)}


# ----- 4. the sources package imports in a line, never in a circle -------------------------------------
def test_no_function_level_imports_in_sources():
    offenders = []
    for path in sorted(SOURCES_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        offenders.append(f"{path.name}:{inner.lineno}")
    assert not offenders, f"imports inside functions: {offenders}"


@pytest.mark.parametrize("module", ["plait.sources.base", "plait.sources.formats", "plait.sources.jsonl",
                                    "plait.sources.parquet", "plait.sources.reader", "plait.sources"])
@pytest.mark.subprocess
def test_each_sources_module_imports_first(module):
    code = (f"import {module}; import plait.sources as s; "
            "assert {'BlockKey', 'DocBlock', 'Source', 'infer_format', 'reader_for'} <= set(s.__all__); "
            "from plait.sources.base import reader_for, infer_format")
    env = {**os.environ, "PYTHONPATH": str(SOURCES_DIR.parent.parent)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
