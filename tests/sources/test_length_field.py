"""length_field: planning reads a stored token count instead of the tokens; the batches do not change."""

from __future__ import annotations

import json
from itertools import islice

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import plait
from plait.errors import SourceError
from plait.runtime.local import LocalRuntime
from helpers import (
    Dataset, assert_batches_equal, batch_digest, make_spec, run_all_ranks, texts, token_docs, write_jsonl,
)


def parquet_with_lengths(root, *, files: int = 3, docs: int = 40, row_group_size: int = 6, text: bool = False,
                         wrong: dict | None = None) -> Dataset:
    """Parquet files holding input_ids (or text) and n_tokens; `wrong`: {(file, row): stored length}."""
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for f in range(files):
        if text:
            values = texts(docs, seed=f)
            n = [len(v.encode()) for v in values]
            column = pa.array(values)
        else:
            values = token_docs(docs, lo=1, hi=90, seed=f)
            n = [len(v) for v in values]
            column = pa.array([v.tolist() for v in values], pa.list_(pa.int32()))
        for (wf, row), length in (wrong or {}).items():
            if wf == f:
                n[row] = length
        table = pa.table({"doc": column, "n_tokens": pa.array(n, pa.int32())})
        pq.write_table(table, str(root / f"part-{f}.parquet"), row_group_size=row_group_size)
        out.update({(f, r): v for r, v in enumerate(values)})
    field = {"text_field": "doc"} if text else {"tokens_field": "doc"}
    return Dataset({"name": "p", "path": str(root / "*.parquet"), **field}, sorted(map(str, root.glob("*.parquet"))), out)


class Counter:
    """Counts a reader's calls: read_block reads the token column, read_lengths only the lengths."""

    def __init__(self, runtime: LocalRuntime):
        self.calls = {"read_block": 0, "read_lengths": 0}
        for src in runtime.loader.sources.values():
            for name in self.calls:
                setattr(src.reader, name, self._wrap(name, getattr(src.reader, name)))

    def _wrap(self, name, method):
        def counted(*args, **kwargs):
            self.calls[name] += 1
            return method(*args, **kwargs)
        return counted


@pytest.mark.parametrize("text", [False, True])
def test_same_batches_with_and_without(tmp_path, text):
    ds = parquet_with_lengths(tmp_path / "p", text=text)
    digests = {}
    for lf in (None, "n_tokens"):
        spec = plait.load_spec(make_spec([ds.with_options(length_field=lf, eos=7, bos=5)], seq_len=64,
                                         microbatches=2, dp=3))
        batches, rt, _ = run_all_ranks(spec, steps=8)
        rt.close()
        digests[lf] = batch_digest(batches)
        assert sum(len(mb.sample_ids) for mb in batches) > 50
    assert digests[None] == digests["n_tokens"]


def test_planning_does_not_read_the_token_column(tmp_path):
    ds = parquet_with_lengths(tmp_path / "p")
    for lf, planned_reads in ((None, True), ("n_tokens", False)):
        spec = plait.load_spec(make_spec([ds.with_options(length_field=lf, eos=7)], seq_len=64, microbatches=2, dp=4))
        rt = LocalRuntime(spec)
        count = Counter(rt)
        plans = [rt.plan() for _ in range(6)]
        assert (count.calls["read_block"] > 0) == planned_reads, count.calls
        assert (count.calls["read_lengths"] > 0) == (not planned_reads), count.calls
        before = count.calls["read_block"]
        rt.build(plans[0], 0)  # building a rank's batches reads the tokens of the blocks it needs
        assert count.calls["read_block"] >= before + (0 if planned_reads else 1)
        rt.close()


def test_jsonl_length_field(tmp_path):
    root = tmp_path / "j"
    root.mkdir()
    for f in range(2):
        docs = token_docs(25, seed=f + 3)
        write_jsonl(root / f"part-{f}.jsonl", [{"ids": d.tolist(), "n": len(d)} for d in docs])
    base = {"name": "j", "path": str(root / "*.jsonl"), "tokens_field": "ids"}
    digests = []
    for extra in ({}, {"length_field": "n"}):
        spec = plait.load_spec(make_spec([{**base, **extra}], seq_len=48, dp=2))
        batches, rt, _ = run_all_ranks(spec, steps=6)
        rt.close()
        digests.append(batch_digest(batches))
    assert digests[0] == digests[1]


def test_resume_with_length_field(tmp_path):
    ds = parquet_with_lengths(tmp_path / "p")
    spec = plait.load_spec(make_spec([ds.with_options(length_field="n_tokens", eos=7)], seq_len=64, microbatches=2, dp=2))
    reference = list(plait.Loader(spec, dp_rank=1, steps=6, read_ahead=0))
    first = plait.Loader(spec, dp_rank=1, steps=6, read_ahead=0)
    it = iter(first)
    head = list(islice(it, 5))
    it.close()
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    resumed = plait.Loader(spec, dp_rank=1, steps=6, read_ahead=0)
    resumed.load_state_dict(state)
    assert_batches_equal(head + list(resumed), reference)
    resumed.close()


def test_a_wrong_stored_length_is_a_bad_record(tmp_path):
    ds = parquet_with_lengths(tmp_path / "p", files=1, docs=12, wrong={(0, 4): 3})
    spec = plait.load_spec(make_spec([ds.with_options(length_field="n_tokens", eos=7)], seq_len=64, dp=1))
    with pytest.raises(SourceError) as info:
        run_all_ranks(spec, steps=4)
    assert info.value.record == "4" and "n_tokens" in info.value.reason and "says 4 tokens" in info.value.reason
    spec = plait.load_spec(make_spec([ds.with_options(length_field="n_tokens", eos=7, on_error="skip")], seq_len=64))
    batches, rt, _ = run_all_ranks(spec, steps=4)
    report = rt.error_report()["p"]
    rt.close()
    assert report["skipped"] == 1 and "record 4" in report["messages"][0]
    found = [sid for mb in batches for sid in mb.sample_ids if int(sid[2]) == 0 and int(sid[3]) == 4]
    assert not found and sum(mb.stats["dropped_samples"] for mb in batches) == 1  # planned, then dropped


def test_bad_length_values_are_bad_records(tmp_path):
    root = tmp_path / "p"
    root.mkdir()
    docs = token_docs(10, seed=1)
    n = pa.array([len(d) if i not in (2, 6) else (None if i == 2 else -1) for i, d in enumerate(docs)], pa.int64())
    pq.write_table(pa.table({"doc": pa.array([d.tolist() for d in docs]), "n": n}), str(root / "a.parquet"))
    source = {"name": "p", "path": str(root / "a.parquet"), "tokens_field": "doc", "length_field": "n"}
    with pytest.raises(SourceError, match="length_field 'n' is null"):
        run_all_ranks(plait.load_spec(make_spec([source], seq_len=32)), steps=2)
    spec = plait.load_spec(make_spec([{**source, "on_error": "skip"}], seq_len=32, microbatches=1))
    batches, rt, _ = run_all_ranks(spec, steps=3)
    assert rt.error_report()["p"]["skipped"] == 2
    rows = {int(r) for mb in batches for r in np.asarray(mb.sample_ids)[:, -2]} if batches else set()
    rt.close()
    assert not rows & {2, 6}


def test_missing_length_column_names_it(tmp_path):
    ds = parquet_with_lengths(tmp_path / "p", files=1)
    spec = plait.load_spec(make_spec([ds.with_options(length_field="nope")], seq_len=64))
    with pytest.raises(SourceError, match="no column 'nope'"):
        run_all_ranks(spec, steps=1)
