"""Prometheus metrics move with what was delivered; `plait top` reads them; events can be JSON lines."""

from __future__ import annotations

import io
import json
import logging
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import plait
from plait import cli
from plait.runtime.local import LocalRuntime
from plait.telemetry import event, json_logs
from helpers import make_spec, scrape_metrics as scrape, text_source, token_parquet


@pytest.fixture
def spec(tmp_path):
    a = token_parquet(tmp_path / "a", name="a", files=2, docs_per_file=30, row_group_size=6, lo=4, hi=40)
    b = text_source(tmp_path / "b", fmt="jsonl", name="b", files=1, docs_per_file=30, eos=256)
    return make_spec([a, b], seq_len=64, microbatches=2, dp=2)


def test_counters_move_with_what_was_delivered(spec):
    rt = LocalRuntime(plait.load_spec(spec), metrics_port=0)
    try:
        first = scrape(rt.metrics_port)
        assert first[("plait_source_tokens_total", (("source", "a"),))] == 0
        delivered = {0: 0, 1: 0}
        samples = {0: 0, 1: 0}
        for _ in range(4):
            plan = rt.plan()
            for r in range(plan.ranks):
                for mb in rt.build(plan, r):
                    for s, n in zip(mb.source_ids.tolist(), (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).tolist()):
                        delivered[s] += n
                        samples[s] += 1
            rt.release()
        now = scrape(rt.metrics_port)
        for i, name in enumerate(("a", "b")):
            assert now[("plait_source_tokens_total", (("source", name),))] == delivered[i] > 0
            assert now[("plait_source_samples_total", (("source", name),))] == samples[i]
        assert now[("plait_steps_planned_total", ())] == 4
        assert now[("plait_step_plan_seconds_count", ())] == 4
        assert 0 < now[("plait_step_fill_ratio", ())] <= 1
        assert now[("plait_step_max_over_lower_bound", ())] >= 1
        assert now[("plait_loader_buffer_bytes", ())] > 0
        assert 0 < now[("plait_loader_busy_ratio", ())] <= 1
    finally:
        rt.close()


def test_a_loader_reports_its_waits_and_plait_top_reads_the_endpoint(spec, capsys):
    spec["metrics"] = {"port": 0}
    loader = plait.Loader(spec, 1, steps=3, read_ahead=0)
    batches = list(loader)
    port = loader.runtime.metrics_port
    waited = scrape(port)[("plait_rank_wait_seconds_total", (("rank", "1"),))]
    assert batches and waited > 0  # prefetch=0: every batch is built while the rank waits
    assert cli.main(["top", f"127.0.0.1:{port}", "--once", "--interval", "0.05"]) == 0
    shown = capsys.readouterr().out
    assert "sources" in shown and "a" in shown and "max rank cost / lower bound" in shown
    loader.close()


def test_top_without_a_job_is_one_sentence(capsys):
    assert cli.main(["top", "127.0.0.1:1", "--once"]) == 2
    assert "cannot read metrics" in capsys.readouterr().err


def test_events_as_json_lines():
    buf = io.StringIO()
    handler = json_logs(buf)
    try:
        event("recovery", "SourceLoader replaced", role="loader", seconds=0.01)
        logging.getLogger("plait.recovery").warning("failure: loader 3 is dead")
    finally:
        for name in ("plait.events", "plait.recovery"):
            logging.getLogger(name).removeHandler(handler)
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert lines[0]["event"] == "recovery" and lines[0]["role"] == "loader" and lines[0]["message"]
    assert lines[1]["logger"] == "plait.recovery" and lines[1]["level"] == "warning"


def test_counts_built_elsewhere_are_summed_at_scrape_and_loaders_are_labelled():
    """The ray runtime's shape: builds counted in other processes (delivery_counts), several loaders."""
    from plait.cli.top import Sample, is_endpoint
    from plait.telemetry import Telemetry

    class MB:  # two documents of source 0 (3 and 5 tokens), one of source 1 (4 tokens)
        source_ids = np.array([0, 0, 1])
        cu_seqlens = np.array([0, 3, 8, 12])

    builders = [Telemetry(["a", "b"]) for _ in range(2)]
    for t in builders:
        t.observe_build([MB()], 0.01)
    job = Telemetry(["a", "b"], delivered=lambda: [t.delivery_counts() for t in builders])
    job.watch_loaders(lambda: {"0": {"buffer_bytes": 10, "busy_fraction": 0.5, "skipped": {"a": 1}},
                               "1": {"buffer_bytes": 30, "busy_fraction": 0.25, "skipped": {"a": 2, "b": 0}}})
    port = job.serve(0)
    now = scrape(port)
    assert now[("plait_source_tokens_total", (("source", "a"),))] == 16
    assert now[("plait_source_samples_total", (("source", "b"),))] == 2
    assert now[("plait_rank_build_seconds_count", ())] == 2
    assert now[("plait_loader_buffer_bytes", (("loader", "1"),))] == 30
    sample = Sample(0.0, now)
    assert sample.total("plait_loader_buffer_bytes") == 40
    assert sample.series("plait_source_skipped_records", "source") == {"a": 3, "b": 0}
    assert is_endpoint("127.0.0.1:9400") and is_endpoint("http://h/metrics") and not is_endpoint("my-job")
