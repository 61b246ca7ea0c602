"""Property: over generated sources with corrupt files and malformed records, no good record is ever
silently lost.

A source of a few small files (JSONL plain/.gz/.zst, or Parquet) whose records carry unique ids; some
files are corrupted as a whole (truncated, garbage bytes, the wrong column, empty) and some records are
malformed (a bad JSON line, a null, a wrong type, a missing key, an id out of range). Streaming one
epoch and more:

- on_error: skip -- every good record of an intact file arrives exactly once in epoch 0, with its
  tokens; every malformed record is reported with its source, shard and record index; every file
  corrupted as a whole is named in the report and nothing of it arrives; and if nothing is readable at
  all, the run stops with a PlaitError.
- on_error: raise -- with anything bad, the run stops with a SourceError naming the source and a bad
  shard (and, for a malformed record in an intact file, that record); with nothing bad, every record
  arrives exactly once in epoch 0.

(A plain .jsonl file cut exactly at a line boundary cannot be told from a shorter file, so plain files
are corrupted with garbage bytes, not truncated.)
"""

from __future__ import annotations

import gzip
import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import plait
from plait.errors import PlaitError, SourceError
from helpers import docs_in_batch, make_spec

NAME = "prop"
SEQ = 256
STEPS = 3  # at most 4 files x 8 records x 7 tokens (<= 224 < SEQ): epoch 0 is over within step 0

RECORD_KINDS = {
    "jsonl": ["good"] * 6 + ["bad-json", "null", "wrong-type", "missing"],
    "parquet": ["good"] * 6 + ["null", "out-of-range"],
}
FILE_KINDS = {
    "": ["intact"] * 4 + ["garbage", "empty", "wrong-column"],
    "gz": ["intact"] * 4 + ["truncated", "garbage", "empty"],
    "zst": ["intact"] * 4 + ["truncated", "garbage", "empty"],
    "parquet": ["intact"] * 4 + ["truncated", "garbage", "empty", "wrong-column"],
}
WHOLE_FILE = {"truncated", "garbage", "empty"}  # kinds that leave no record of the file readable


@dataclass
class File:
    codec: str  # "", "gz", "zst" (JSONL) or "parquet"
    corruption: str
    kinds: list[str]
    tokens: list[list[int]]
    path: str = ""

    @property
    def whole_file_bad(self) -> bool:
        return self.corruption in WHOLE_FILE or (self.codec == "parquet" and self.corruption == "wrong-column")

    def bad_records(self) -> set[int]:
        if self.whole_file_bad:
            return set()
        if self.corruption == "wrong-column":  # JSONL: every record lacks the key
            return set(range(len(self.kinds)))
        return {i for i, k in enumerate(self.kinds) if k != "good"}

    def good_records(self) -> dict[int, list[int]]:
        if self.whole_file_bad:
            return {}
        bad = self.bad_records()
        return {i: t for i, t in enumerate(self.tokens) if i not in bad}


@dataclass
class Case:
    fmt: str
    files: list[File]
    on_error: str
    seed: int
    paths: list[str] = field(default_factory=list)


@st.composite
def cases(draw) -> Case:
    fmt = draw(st.sampled_from(["jsonl", "parquet"]))
    files = []
    uid = 1
    for _ in range(draw(st.integers(1, 4))):
        codec = draw(st.sampled_from(["", "gz", "zst"])) if fmt == "jsonl" else "parquet"
        n = draw(st.integers(1, 8))
        kinds = draw(st.lists(st.sampled_from(RECORD_KINDS[fmt]), min_size=n, max_size=n))
        tokens = []
        for _ in range(n):
            rest = draw(st.lists(st.integers(0, 999), max_size=6))
            tokens.append([uid, *rest])  # the first token is the record's unique id
            uid += 1
        files.append(File(codec, draw(st.sampled_from(FILE_KINDS[codec])), kinds, tokens))
    return Case(fmt, files, draw(st.sampled_from(["skip", "raise"])), draw(st.integers(0, 3)))


def _jsonl_line(kind: str, tokens: list[int], key: str) -> str:
    if kind == "good":
        return json.dumps({key: tokens, "n": tokens[0]})
    if kind == "bad-json":
        return f'{{"{key}": [{tokens[0]}, '
    if kind == "null":
        return json.dumps({key: None})
    if kind == "wrong-type":
        return json.dumps({key: f"id {tokens[0]}"})
    if kind == "missing":
        return json.dumps({"not_" + key: tokens})
    raise ValueError(kind)


def _compress(data: bytes, codec: str) -> bytes:
    if codec == "gz":
        return gzip.compress(data)
    if codec == "zst":
        return zstandard.ZstdCompressor().compress(data)
    return data


def write(case: Case, root: Path) -> None:
    rng = np.random.default_rng(case.seed)
    for i, f in enumerate(case.files):
        path = root / (f"part-{i:02d}.parquet" if f.codec == "parquet" else f"part-{i:02d}.jsonl" + (f".{f.codec}" if f.codec else ""))
        f.path = str(path)
        key = "other" if f.corruption == "wrong-column" else "ids"
        if f.codec == "parquet":
            values = []
            for kind, toks in zip(f.kinds, f.tokens):
                values.append(None if kind == "null" else [toks[0], -1] if kind == "out-of-range" else toks)
            if f.corruption == "empty":
                values = []
            pq.write_table(pa.table({key: pa.array(values, pa.list_(pa.int64()))}), str(path), row_group_size=3)
            data = path.read_bytes()
        else:
            lines = [_jsonl_line(k, t, key) for k, t in zip(f.kinds, f.tokens)]
            text = b"" if f.corruption == "empty" else ("\n".join(lines) + "\n").encode()
            data = _compress(text, f.codec)
        if f.corruption == "truncated":
            data = data[: len(data) // 2]
        elif f.corruption == "garbage":
            data = bytes(rng.integers(0, 256, 200, dtype=np.uint8)).replace(b"\n", b" ")
        path.write_bytes(data)
    case.paths = [f.path for f in case.files]


_MESSAGE = re.compile(r"^source '(?P<source>[^']*)', shard '(?P<shard>[^']*)'(?:, record (?P<record>block \d+|\d+))?: ")


def _reported(messages: list[str]) -> tuple[set[str], set[tuple[str, int]]]:
    """(files named at all, (file, record index) named) in an error report's messages."""
    files, records = set(), set()
    for m in messages:
        match = _MESSAGE.match(m)
        assert match, f"a skip message must name source and shard: {m!r}"
        assert match["source"] == NAME
        files.add(match["shard"])
        if match["record"] and match["record"].isdigit():
            records.add((match["shard"], int(match["record"])))
    return files, records


def stream(case: Case):
    """(deliveries of epoch 0 as {(shard,row): [tokens, ...]}, error report)."""
    src = {"name": NAME, "path": case.paths, "tokens_field": "ids", "format": case.fmt, "on_error": case.on_error}
    loader = plait.Loader(make_spec([src], seq_len=SEQ, microbatches=1, seed=case.seed), steps=STEPS, read_ahead=0)
    got: dict[tuple[int, int], list] = {}
    try:
        for mb in loader:
            for (source, epoch, shard, row, chunk), toks in docs_in_batch(mb):
                assert chunk == 0, "every document fits one sequence"
                if epoch == 0:
                    got.setdefault((shard, row), []).append(toks.tolist())
        return got, loader.error_report()
    finally:
        loader.close()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_no_good_record_is_silently_lost(case: Case):
    with tempfile.TemporaryDirectory() as tmp:
        write(case, Path(tmp))
        good = {(s, r): t for s, f in enumerate(case.files) for r, t in f.good_records().items()}
        anything_bad = any(f.corruption != "intact" or f.bad_records() for f in case.files)

        if case.on_error == "raise" and anything_bad:
            with pytest.raises(SourceError) as info:
                stream(case)
            err = info.value
            assert err.source == NAME and err.shard in case.paths, str(err)
            f = case.files[case.paths.index(err.shard)]
            assert f.corruption != "intact" or f.bad_records(), f"{err} names a file with nothing bad"
            if f.corruption == "intact" and err.record is not None:
                assert int(err.record) in f.bad_records(), str(err)
            return

        if case.on_error == "skip" and not good:  # nothing readable: an error, not an endless or empty run
            with pytest.raises(PlaitError) as info:
                stream(case)
            assert NAME in str(info.value)
            return

        got, report = stream(case)
        # every good record exactly once in epoch 0, with its own tokens; nothing else from any file
        assert got.keys() == good.keys(), f"missing {sorted(good.keys() - got.keys())}, extra {sorted(got.keys() - good.keys())}"
        for key, deliveries in got.items():
            assert deliveries == [good[key]], f"record {key} delivered {len(deliveries)} times or altered"
        # every bad thing reported, with source, shard and record
        rep = report[NAME]
        files_named, records_named = _reported(rep["messages"])
        assert rep["bad_records"] == len(rep["messages"])
        for f in case.files:
            if f.whole_file_bad:
                assert f.path in files_named, f"corrupt file {f.path} ({f.corruption}) not reported"
            else:
                assert {r for (p, r) in records_named if p == f.path} == f.bad_records()
        if case.on_error == "raise":
            assert rep["skipped"] == 0
