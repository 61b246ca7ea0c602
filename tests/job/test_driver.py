"""`plait run` drives the local runtime through the job service, the path every reader takes: each step
planned once in the service's plan stream, each rank built by its builds, and a resumed run continuing
where the state says."""

from __future__ import annotations

import pytest

from helpers import make_spec, token_parquet

import plait
from plait.runtime.local import LocalRuntime

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    ds = token_parquet(tmp_path_factory.mktemp("driver"), files=2, docs_per_file=60, row_group_size=5, lo=4, hi=40)
    return plait.load_spec(make_spec([ds], seq_len=64, microbatches=2, dp=2, steps=6))


def drive(rt: LocalRuntime, steps: int) -> dict[int, list]:
    got: dict[int, list] = {0: [], 1: []}
    for _ in range(steps):
        plan = rt.plan()
        for rank in range(plan.ranks):
            got[rank] += [mb.sample_ids.tolist() for mb in rt.build(plan, rank)]
        rt.release()
    return got


def test_the_driver_reads_the_job_services_stream_and_resumes_from_a_state(spec):
    want = {r: [mb.sample_ids.tolist() for mb in plait.Loader(spec, dp_rank=r, read_ahead=0)] for r in (0, 1)}
    rt = LocalRuntime(spec)
    try:
        assert drive(rt, 6) == want
        stats = rt.service.stats()
        assert stats["window"] == 6 and stats["most_builds"] >= 1  # planned in the stream, built by its builds
        assert rt.service.builds.requests == 12
    finally:
        rt.close()
    first = LocalRuntime(spec)
    try:
        drive(first, 2)
        state = first.state_dict()  # the start of step 2: nothing is planned ahead of the driver
    finally:
        first.close()
    rt = LocalRuntime(spec)
    try:
        rt.load_state_dict(state)
        assert drive(rt, 4) == {r: want[r][4:] for r in (0, 1)}
    finally:
        rt.close()
