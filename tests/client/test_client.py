"""The Client's (plait.Loader's) own contract: yield this rank's share of every planned step, in
(step, micro-batch) order, however deep the prefetch; stop after `steps`; checkpoint mid-step and
continue with exactly the batches that were left; refuse ranks and options it cannot serve."""

from __future__ import annotations

import json
from itertools import islice

import numpy as np
import pytest
from helpers import assert_batches_equal, make_spec, text_source, token_parquet

import plait
from plait.errors import PlaitError
from plait.roles.constructor import Constructor, LoaderPayloads
from plait.roles.planner import Planner
from plait.roles.source_loader import SourceLoader

STEPS, M, DP = 4, 3, 2


@pytest.fixture(scope="module")
def spec_dict(tmp_path_factory):
    root = tmp_path_factory.mktemp("client")
    a = token_parquet(root / "a", name="a", files=2, docs_per_file=15, row_group_size=5, lo=5, hi=150, weight=2)
    b = text_source(root / "b", fmt="jsonl", name="b", files=2, docs_per_file=12, hi=20, eos=256)
    return make_spec([a, b], seq_len=64, microbatches=M, dp=DP)


@pytest.fixture(scope="module")
def spec(spec_dict):
    return plait.load_spec(spec_dict)


@pytest.fixture(scope="module")
def reference(spec):
    """Every rank's micro-batches of STEPS steps, built by driving the roles directly."""
    loader = SourceLoader(spec)
    planner = Planner(spec, loader)
    constructor = Constructor(LoaderPayloads(lambda s: loader))
    out = {r: [] for r in range(DP)}
    for _ in range(STEPS):
        plan = planner.plan_step()
        for r in range(DP):
            out[r] += constructor.build(plan.for_rank(r))
        loader.retain(planner.live_blocks())
    loader.close()
    return out


def take(loader, n: int) -> list:
    it = iter(loader)
    out = list(islice(it, n))
    it.close()
    return out


@pytest.mark.parametrize("rank", range(DP))
def test_yields_its_ranks_share_of_each_step_in_order(spec, reference, rank):
    with plait.Loader(spec, dp_rank=rank, steps=STEPS, read_ahead=0) as loader:
        got = list(loader)
    assert [(b.step, b.microbatch, b.dp_rank) for b in got] == [(s, m, rank) for s in range(STEPS) for m in range(M)]
    assert_batches_equal(got, reference[rank])
    assert all(isinstance(b, plait.Batch) for b in got)


def test_prefetch_depth_does_not_change_the_stream(spec, reference):
    for prefetch in (0, 1, 3, 50):
        with plait.Loader(spec, dp_rank=1, steps=STEPS, read_ahead=prefetch) as loader:
            assert_batches_equal(list(loader), reference[1])


def test_steps_bounds_the_stream(spec, spec_dict, reference):
    with plait.Loader(spec, dp_rank=0, steps=2) as loader:
        got = list(loader)
        assert list(loader) == [], "a finished stream stays finished"
    assert_batches_equal(got, reference[0][: 2 * M])
    with plait.Loader({**spec_dict, "steps": 3}, dp_rank=0) as loader:  # the spec's own bound
        assert_batches_equal(list(loader), reference[0][: 3 * M])
    with plait.Loader({**spec_dict, "steps": 3}, dp_rank=0, steps=1) as loader:  # the argument wins
        assert len(list(loader)) == M
    with plait.Loader(spec, dp_rank=0, steps=None) as loader:  # unbounded: as many as asked for
        assert_batches_equal(take(loader, STEPS * M), reference[0])


@pytest.mark.parametrize("n", [0, 1, M + 1, 2 * M, STEPS * M])
def test_state_dict_resumes_with_exactly_the_remaining_batches(spec, reference, n):
    rank = 1
    first = plait.Loader(spec, dp_rank=rank, steps=STEPS, read_ahead=2)
    head = take(first, n)
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    assert state["next_microbatch"] == (0 if n == 0 else (n - 1) % M + 1)
    assert state["data"]["step"] == (0 if n == 0 else (n - 1) // M)
    with plait.Loader(spec, dp_rank=rank, steps=STEPS, read_ahead=0) as resumed:
        resumed.load_state_dict(state)
        tail = list(resumed)
    assert len(tail) == STEPS * M - n
    assert_batches_equal(head + tail, reference[rank])
    # Sample ids prove it: nothing delivered twice, nothing skipped.
    ids = [tuple(x) for b in head + tail for x in b.sample_ids.tolist()]
    assert len(ids) == len(set(ids))


def test_state_of_another_spec_or_version_is_refused_before_iterating(spec, spec_dict):
    with plait.Loader(spec, steps=STEPS) as loader:
        take(loader, 2)
        state = loader.state_dict()
    with plait.Loader({**spec_dict, "seed": 7}) as other, pytest.raises(PlaitError, match="different spec"):
        other.load_state_dict(state)
    with plait.Loader(spec) as other, pytest.raises(PlaitError, match="version"):
        other.load_state_dict({**state, "version": 99})


def test_one_iteration_at_a_time_and_no_state_load_during_it(spec):
    with plait.Loader(spec, steps=STEPS, read_ahead=0) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        with pytest.raises(PlaitError, match="already being iterated"):
            next(iter(loader))
        with pytest.raises(PlaitError, match="while this Loader is being iterated"):
            loader.load_state_dict(state)
        it.close()
        loader.load_state_dict(state)  # fine once the loop has ended
        assert (next(iter(loader)).step, loader.state_dict()["next_microbatch"]) == (0, 2)


@pytest.mark.parametrize("ranks,name", [
    ({"dp_rank": DP}, "dp_rank"), ({"dp_rank": -1}, "dp_rank"), ({"tp_rank": 1}, "tp_rank"),
    ({"pp_rank": 1}, "pp_rank"), ({"cp_rank": 1}, "cp_rank"),
])
def test_ranks_outside_the_topology_are_refused(spec, ranks, name):
    with pytest.raises(PlaitError, match=f"{name}=.* outside the topology"):
        plait.Loader(spec, **ranks)


def test_unknown_runtime_options_are_named(spec):
    with pytest.raises(PlaitError, match="bogus"):
        plait.Loader(spec, bogus=1)
    with pytest.raises(PlaitError, match="unknown runtime"):
        plait.Loader(spec, runtime="nowhere")


def test_context_manager_closes_the_loader(spec):
    closed = []

    class Recording(plait.Loader):
        def close(self):
            closed.append(self.dp_rank)
            super().close()

    with Recording(spec, dp_rank=1, steps=1) as loader:
        assert len(list(loader)) == M
    assert closed == [1]
    with pytest.raises(RuntimeError), Recording(spec, dp_rank=0, steps=1):
        raise RuntimeError("the training step failed")
    assert closed == [1, 0], "closed on the way out of an exception too"


def test_from_torchrun_takes_ranks_from_the_environment(spec_dict, reference, monkeypatch):
    """4 processes with tp=2: global rank 3 is (dp 1, tp 1); both TP ranks of a replica get its batches."""
    free = {k: v for k, v in spec_dict.items() if k != "topology"}  # dp follows from the world size
    monkeypatch.setenv("WORLD_SIZE", "4")
    streams = {}
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))
        with plait.Loader.from_torchrun(free, tp=2, steps=STEPS) as loader:
            assert (loader.dp_rank, loader.tp_rank) == (rank // 2, rank % 2)
            assert (loader.spec.topology.dp, loader.spec.topology.tp) == (DP, 2)
            streams[rank] = list(loader)
    for rank, got in streams.items():
        assert_batches_equal(got, reference[rank // 2])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")  # the spec says dp 2; 8 processes with tp=2 make 4: the launch decides
    with plait.Loader.from_torchrun(spec_dict, tp=2, steps=1) as loader:
        assert loader.spec.topology.dp == 4
    monkeypatch.delenv("RANK")
    with pytest.raises(PlaitError, match="RANK is not set"):
        plait.Loader.from_torchrun(free)
    assert np.all([len(s) == STEPS * M for s in streams.values()])


def test_old_option_names_still_work_with_a_deprecation_warning(spec, reference):
    """`prefetch` is now `read_ahead` (micro-batches the reader thread holds): the old name gives the same
    stream with a DeprecationWarning; both at once are refused."""
    with pytest.warns(DeprecationWarning, match="prefetch= is deprecated: it is now called read_ahead="):
        loader = plait.Loader(spec, dp_rank=1, steps=STEPS, prefetch=3)
    with loader:
        assert loader.read_ahead == 3
        assert [mb.sample_ids.tolist() for mb in loader] == [mb.sample_ids.tolist() for mb in reference[1]]
    with pytest.raises(plait.PlaitError, match="both given"):
        plait.Loader(spec, steps=STEPS, prefetch=1, read_ahead=1)
