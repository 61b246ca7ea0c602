"""A served or node-shared job's host keeps data blocks only for steps a reader still needs: a rank that
nobody reads (not joined, on another node, gone) pins nothing, and when it does read later it still gets its
stream exactly (its builds read the blocks again)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytest.importorskip("pyarrow.flight")

from helpers import make_spec, token_parquet  # noqa: E402

import plait  # noqa: E402
from plait.runtime.serve_local import LocalJobServer  # noqa: E402

pytestmark = pytest.mark.timeout(120)
JOB = "host-blocks"
STEPS = 20


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    ds = token_parquet(tmp_path_factory.mktemp("host-blocks"), files=4, docs_per_file=400, row_group_size=20,
                       lo=4, hi=40)
    return plait.load_spec(make_spec([ds], seq_len=64, microbatches=2, dp=4, steps=STEPS + 10))


def thin(spec, server, dp_rank):
    return plait.Loader(spec, dp_rank=dp_rank, runtime="flight", job_address=server.address, token=server.token,
                        job=JOB, read_ahead=0)


def test_one_of_four_ranks_reading_pins_blocks_of_two_steps_at_most_and_a_late_rank_reads_exactly(spec):
    want = {r: list(plait.Loader(spec, dp_rank=r, read_ahead=0, steps=STEPS)) for r in (0, 1)}
    with LocalJobServer(spec, JOB) as server:
        roles = server.service.roles
        kept: list[list[int]] = []
        release = roles.release

        def recorded(*in_flight):
            kept.append([plan.step for plan in in_flight])
            release(*in_flight)

        roles.release = recorded
        with thin(spec, server, 0) as reader:
            got0 = list(itertools.islice(iter(reader), 2 * STEPS))
            # The loader keeps the blocks of the steps it is told (and the Planner's own). Before: every
            # planned step stayed pinned for the three ranks that never read (39 of 39 in the issue).
            assert max(len(steps) for steps in kept[5:]) <= 2, kept
            assert len(server.service.window.steps) >= STEPS  # the window still holds what a late reader asks
            # A rank that starts late reads the steps whose blocks went: read again, the same stream.
            read = roles.loader.blocks_read
            with thin(spec, server, 1) as late:
                got1 = list(itertools.islice(iter(late), 2 * STEPS))
            assert roles.loader.blocks_read > read
    for got, ref in ((got0, want[0]), (got1, want[1])):
        assert [mb.sample_ids.tolist() for mb in got] == [mb.sample_ids.tolist() for mb in ref]
        assert all(np.array_equal(a.input_ids, b.input_ids) for a, b in zip(got, ref))
