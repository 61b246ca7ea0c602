"""`plait bench throughput SPEC` on a user's spec, and `python -m benchmarks.throughput` on a generated
dataset: both stream the tokens they promise and compare them with a raw read of the same columns."""

from __future__ import annotations

import json

import yaml

from plait.cli import main


def test_bench_throughput_on_a_spec_of_parquet_tokens(tmp_path):
    from benchmarks.throughput import make_dataset

    make_dataset(tmp_path / "data", 200_000, files=2, row_groups=2, median_len=300)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"sources": [{"name": "t", "path": str(tmp_path / "data" / "*.parquet"),
                                                 "tokens_field": "input_ids"}],
                                    "packing": {"seq_len": 2048, "microbatches": 2}, "topology": {"dp": 4}}))
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", str(spec), "--repeats", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["raw_tokens"] >= 200_000 and r["tokens"] >= r["raw_tokens"]  # streamed at least one raw pass
    assert r["ratio"] == r["tokens_per_s"] / r["raw_tokens_per_s"] and r["seq_len"] == 2048


def test_bench_throughput_without_a_parquet_baseline(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"input_ids": list(range(1, 300))}) + "\n" for _ in range(200)))
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"sources": [{"name": "j", "path": str(src), "tokens_field": "input_ids"}],
                                    "packing": {"seq_len": 1024, "microbatches": 1}}))
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", str(spec), "--tokens", "20000", "--repeats", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["raw_tokens_per_s"] is None and r["ratio"] is None and r["tokens"] >= 20_000


def test_benchmarks_throughput_generated(tmp_path):
    from benchmarks import throughput  # the benchmark under test
    from benchmarks.common import main as bench_main

    out = tmp_path / "t.json"
    assert bench_main(throughput, ["--tokens", "200000", "--files", "2", "--repeats", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["raw_tokens"] >= 200_000 and r["tokens"] >= r["raw_tokens"] and r["ratio"] > 0
    assert r["run"]["command"].startswith("python -m benchmarks.throughput")
