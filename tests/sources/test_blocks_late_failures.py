"""Late failures (sources/blocks.py): a record planned from its length alone (a `length_field`, Megatron's
index) that fails to decode, or whose tokens disagree with that length, is a dropped sample: never
delivered (its sample id in no batch), counted in `dropped_samples` and, with its labels in
`dropped_label_tokens`, taken out of the step's `global_label_tokens`, so that the labels a trainer sees
are exactly what the loss recipe normalises by. Under `raise` the error names source, shard and record."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import plait
from plait.batch import Payload
from plait.errors import SourceError
from plait.packing import IGNORE_INDEX
from plait.sources.blocks import without_late_failures
from helpers import make_spec, megatron_source, run_all_ranks, token_docs, write_megatron

BAD = (0, 3)  # (shard, row) of the record that fails after planning
STEPS = 8


def parquet_with_a_wrong_length(root, bad_length: int, row_group_size: int = 8) -> tuple[dict, str]:
    """One Parquet file of token ids and a stored n_tokens; record BAD's stored length is `bad_length`
    and its tokens are long enough to be cut into several chunks (seq_len 64)."""
    root.mkdir(parents=True)
    docs = token_docs(24, lo=5, hi=60, seed=3)
    docs[BAD[1]] = np.arange(1, 151, dtype=np.int32)
    n = [len(d) for d in docs]
    n[BAD[1]] = bad_length
    path = str(root / "part-0.parquet")
    pq.write_table(pa.table({"doc": pa.array([d.tolist() for d in docs], pa.list_(pa.int32())),
                             "n_tokens": pa.array(n, pa.int32())}), path, row_group_size=row_group_size)
    return {"name": "p", "path": path, "tokens_field": "doc", "length_field": "n_tokens", "eos": 7}, path


def megatron_with_an_out_of_vocab_id(root) -> tuple[dict, str]:
    """A Megatron dataset whose record BAD holds an id beyond vocab_size: its index says nothing of it,
    so planning takes it at its length and only its decode finds it bad."""
    ds = megatron_source(root, files=1, docs_per_file=24, lo=5, hi=60, vocab=1000)
    docs = [ds.docs[(0, r)] for r in range(24)]
    docs[BAD[1]] = np.full(150, 5000, np.int32)
    write_megatron(ds.files[0], docs)
    return ds.source, ds.files[0]


def spec_of(source: dict, **options) -> dict:
    return plait.load_spec(make_spec([{**source, **options}], seq_len=64, microbatches=2, dp=2, vocab_size=1000))


def assert_dropped_not_delivered(batches) -> int:
    """The bad record's sample id is in no batch; each step's delivered labels are its global_label_tokens
    less what its micro-batches dropped. Returns the samples dropped."""
    delivered = {(int(s[2]), int(s[3])) for mb in batches for s in mb.sample_ids}
    assert BAD not in delivered and len(delivered) >= 20
    by_step = defaultdict(list)
    for mb in batches:
        by_step[mb.step].append(mb)
    for mbs in by_step.values():
        labels = sum(int(np.count_nonzero(mb.labels != IGNORE_INDEX)) for mb in mbs)
        lost = sum(mb.stats["dropped_label_tokens"] for mb in mbs)
        assert labels == mbs[0].stats["global_label_tokens"] - lost
    return sum(mb.stats["dropped_samples"] for mb in batches)


@pytest.mark.parametrize("case", ["length_field", "megatron"])
def test_a_record_failing_after_planning_is_a_dropped_sample(tmp_path, case):
    if case == "length_field":
        source, shard = parquet_with_a_wrong_length(tmp_path / "p", bad_length=120)
        why = "n_tokens' says 121 tokens"
    else:
        source, shard = megatron_with_an_out_of_vocab_id(tmp_path / "m")
        why = "outside the vocabulary"
    batches, rt, _ = run_all_ranks(spec_of(source, on_error="skip"), steps=STEPS)
    report = rt.error_report()[source["name"]]
    rt.close()
    dropped = assert_dropped_not_delivered(batches)
    assert dropped >= 2  # its chunks (121 or 150 tokens at seq_len 64), each planned and each dropped
    assert report["bad_records"] == 1 and f"record {BAD[1]}" in report["messages"][0]
    assert why in report["messages"][0]

    with pytest.raises(SourceError) as info:
        run_all_ranks(spec_of(source), steps=STEPS)
    assert (info.value.source, info.value.shard, info.value.record) == (source["name"], shard, str(BAD[1]))


def test_a_record_shorter_than_its_stored_length_is_dropped_too(tmp_path):
    """Tokens that disagree with the stored length the other way (fewer than planned): no padded copy of
    it reaches a batch."""
    source, _ = parquet_with_a_wrong_length(tmp_path / "p", bad_length=400)
    batches, rt, _ = run_all_ranks(spec_of(source, on_error="skip"), steps=STEPS)
    rt.close()
    assert assert_dropped_not_delivered(batches) >= 1


def test_late_failures_join_the_payload_s_media_drops():
    """A gather with an item dropped for its image (item 1) and one that failed late (item 3): both
    listed, in request order, with their labels; the failed item's unwritten span is left out."""
    length = np.array([2, 3, 2, 4, 1])
    tokens = np.array([1, 2, 5, 6, -1, -1, -1, -1, 9], np.int32)  # item 1's span already gone; item 3 unwritten
    payload = Payload(tokens, None, np.array([1]), np.array([2]))
    failed = np.array([False, False, False, True, False])
    out = without_late_failures(payload, failed, length)
    np.testing.assert_array_equal(out.tokens, [1, 2, 5, 6, 9])
    np.testing.assert_array_equal(out.dropped, [1, 3])
    np.testing.assert_array_equal(out.dropped_labels, [2, 3])
    plain = np.arange(4, dtype=np.int32)
    assert without_late_failures(plain, np.zeros(2, bool), np.array([2, 2])) is plain


def test_inspect_names_a_late_failure_instead_of_an_empty_document(tmp_path, capsys):
    """`plait inspect` previews the bad record as failed at decode, not as a document of 0 tokens."""
    import yaml

    from plait.cli import main

    source, _ = parquet_with_a_wrong_length(tmp_path / "data", bad_length=40, row_group_size=24)  # one block
    spec = make_spec([{**source, "on_error": "skip"}], seq_len=64, microbatches=2, dp=2, vocab_size=1000)
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    assert main(["inspect", str(tmp_path / "spec.yaml"), "--docs", "24"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "part-0.parquet" in line]
    assert len(rows) == 24 and [r for r in rows if "failed at decode" in r] == [r for r in rows if "│ 3 " in r]
