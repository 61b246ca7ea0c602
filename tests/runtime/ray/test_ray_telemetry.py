"""A ray job's metrics: its Planner serves the job's endpoint (planning, per-loader figures collected from
the loader actors, tokens delivered as counted by the Constructors); `plait jobs` shows the address and
`plait top JOB` finds and reads it. One local Ray instance for the module."""

from __future__ import annotations

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import plait  # noqa: E402
from plait import cli  # noqa: E402
from helpers import make_spec, text_source, token_parquet  # noqa: E402
from helpers import scrape_metrics as scrape  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


@pytest.fixture
def spec(tmp_path):
    a = token_parquet(tmp_path / "a", name="a", files=2, docs_per_file=30, row_group_size=6, lo=4, hi=40)
    b = text_source(tmp_path / "b", fmt="jsonl", name="b", files=1, docs_per_file=30, eos=256)
    return make_spec([a, b], seq_len=64, microbatches=2, dp=1, metrics={"port": 0})


def test_the_planner_serves_the_job_endpoint_and_top_finds_it(ray_session, spec, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich's tables, one row a line
    loader = plait.Loader(spec, 0, runtime="ray", job="tele", loaders=2, steps=3, read_ahead=0, metrics_port=0,
                          planner_standby=False)  # no standby Planner: not the subject, a process fewer
    try:
        delivered = {"a": 0, "b": 0}
        for mb in loader:
            for s, n in zip(mb.source_ids.tolist(), np.diff(mb.cu_seqlens).tolist()):
                delivered["ab"[s]] += n
        address = loader.runtime.metrics_address()
        assert address and address.startswith("127.0.0.1:")
        now = scrape(int(address.rpartition(":")[2]))
        for name, n in delivered.items():
            assert now[("plait_source_tokens_total", (("source", name),))] == n > 0
        assert now[("plait_steps_planned_total", ())] >= 3
        assert now[("plait_rank_build_seconds_count", ())] == 3
        assert 0 < now[("plait_step_fill_ratio", ())] <= 1
        buffers = {dict(k[1])["loader"] for k in now if k[0] == "plait_loader_buffer_bytes"}
        assert buffers == {"0", "1"}
        # This trainer process's own endpoint (asked for): the time its rank waited.
        mine = scrape(loader.runtime.metrics_port)
        assert mine[("plait_rank_wait_seconds_total", (("rank", "0"),))] > 0

        assert cli.main(["jobs"]) == 0
        assert address in capsys.readouterr().out  # the metrics column
        assert cli.main(["top", "tele", "--once", "--interval", "0.05"]) == 0
        shown = capsys.readouterr().out
        assert "sources" in shown and "loaders" in shown and "max rank cost / lower bound" in shown
        assert cli.main(["top", "no-such-job", "--once"]) == 2
        assert "no job named 'no-such-job'" in capsys.readouterr().err
    finally:
        loader.close()
