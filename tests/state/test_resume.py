"""Client state_dict / load_state_dict: resuming continues the stream bit for bit; exactly-once delivery."""

from __future__ import annotations

import json
from itertools import islice

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import plait
from plait.errors import PlaitError
from helpers import assert_batches_equal, make_spec, run_all_ranks, text_source, token_parquet

STEPS, M, DP = 5, 3, 2


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    # long documents (chunks, carry) + short text: every kind of item in the state
    a = token_parquet(root / "a", name="a", files=2, docs_per_file=12, row_group_size=5, lo=10, hi=250, weight=2)
    b = text_source(root / "b", fmt="jsonl.gz", name="b", files=2, docs_per_file=15, hi=25, eos=256)
    return plait.load_spec(make_spec([a, b], seq_len=96, microbatches=M, dp=DP))


@pytest.fixture(scope="module")
def reference(spec):
    return {r: list(plait.Loader(spec, dp_rank=r, steps=STEPS, read_ahead=0)) for r in range(DP)}


def take(loader, n: int) -> list:
    it = iter(loader)
    out = list(islice(it, n))
    it.close()
    return out


def test_reference_stream_shape(reference):
    for r, batches in reference.items():
        assert len(batches) == STEPS * M
        assert [(b.step, b.microbatch, b.dp_rank) for b in batches] == [(s, m, r) for s in range(STEPS) for m in range(M)]


@pytest.mark.parametrize("prefetch_before,prefetch_after", [(0, 0), (2, 0), (0, 3), (4, 4)])
@pytest.mark.parametrize("n", [0, 1, 2, M, M + 1, 2 * M - 1, 2 * M, STEPS * M - 1, STEPS * M])
def test_resume_bit_for_bit(spec, reference, n, prefetch_before, prefetch_after):
    rank = n % DP  # both ranks, spread over the cases
    first = plait.Loader(spec, dp_rank=rank, steps=STEPS, read_ahead=prefetch_before)
    head = take(first, n)
    state = json.loads(json.dumps(first.state_dict()))  # what a trainer would write to disk
    first.close()
    resumed = plait.Loader(spec, dp_rank=rank, steps=STEPS, read_ahead=prefetch_after)
    resumed.load_state_dict(state)
    tail = list(resumed)
    resumed.close()
    assert_batches_equal(head + tail, reference[rank])


def test_resume_twice_and_on_the_same_loader(spec, reference):
    loader = plait.Loader(spec, dp_rank=1, steps=STEPS, read_ahead=2)
    got = take(loader, 4)
    s1 = loader.state_dict()
    got += take(loader, 0)  # a new iteration continues where the last one stopped
    got += take(loader, 5)
    s2 = loader.state_dict()
    loader.load_state_dict(s1)  # rewind
    again = take(loader, 5)
    assert_batches_equal(again, got[4:9])
    loader.load_state_dict(s2)
    got += list(loader)
    assert_batches_equal(got, reference[1])


def test_state_is_json_and_does_not_grow(spec):
    loader = plait.Loader(spec.with_overrides(topology={"dp": 1}), steps=50, read_ahead=0)
    sizes = {}
    for i, mb in enumerate(loader, 1):
        if i % M == 0 and mb.step + 1 in (5, 50):
            state = loader.state_dict()
            assert json.loads(json.dumps(state)) == state
            sizes[mb.step + 1] = len(json.dumps(state))
    # carried chunks are bounded by what a step holds; counters gain a digit or two
    assert sizes[50] <= sizes[5] + 400, sizes
    assert sizes[50] < 4000, sizes


def test_state_from_another_spec_is_refused(spec, tmp_path):
    state = take_state(spec, 4)
    other = spec.with_overrides(seed=spec.seed + 1)
    with pytest.raises(PlaitError, match="different spec"):
        plait.Loader(other, dp_rank=0, steps=STEPS).load_state_dict(state)
    extra = token_parquet(tmp_path / "x", name="x", files=1, docs_per_file=4)
    more = spec.with_overrides(sources=[*[s.model_dump() for s in spec.sources], extra.source])
    with pytest.raises(PlaitError, match="different spec"):
        plait.Loader(more, dp_rank=0, steps=STEPS).load_state_dict(state)
    with pytest.raises(PlaitError, match="version"):
        plait.Loader(spec, dp_rank=0).load_state_dict({**state, "version": 999})


def take_state(spec, n: int) -> dict:
    loader = plait.Loader(spec, dp_rank=0, steps=STEPS, read_ahead=0)
    take(loader, n)
    return loader.state_dict()


def test_layout_change_keeps_the_data_state(spec):
    """The data state does not depend on the layout (storage options, on_error, topology)."""
    state = take_state(spec, M)
    sources = [{**s.model_dump(), "on_error": "skip"} for s in spec.sources]
    plait.Loader(spec.with_overrides(sources=sources), dp_rank=0, steps=STEPS).load_state_dict(state)


# ----- exactly once ------------------------------------------------------------------------------
def test_exactly_once_across_ranks(spec):
    """Every chunk of every drawn document is delivered once (or still carried); nothing else is."""
    steps = 12
    batches, rt, drawn = run_all_ranks(spec, steps, record_drawn=True)
    carry = rt.planner.carry.sample_ids()
    rt.close()
    delivered = np.concatenate([mb.sample_ids for mb in batches])
    as_set = {tuple(r) for r in delivered.tolist()}
    assert len(as_set) == len(delivered), "a chunk was delivered twice"
    carried = {tuple(r) for r in carry.tolist()}
    assert not (as_set & carried)
    drawn_ids = np.concatenate([d.sample_ids() for d in drawn])
    assert len({tuple(r) for r in drawn_ids.tolist()}) == len(drawn_ids), "a chunk was drawn twice"
    assert as_set | carried == {tuple(r) for r in drawn_ids.tolist()}
    # chunks of a drawn document are 0..n-1 with n = ceil(length / seq_len)
    lengths = np.concatenate([d.length for d in drawn])
    chunk = drawn_ids[:, 4]
    first = drawn_ids[chunk == 0]
    nchunks = {}
    for row in drawn_ids.tolist():
        key = tuple(row[:4])
        nchunks[key] = nchunks.get(key, 0) + 1
    assert len(nchunks) == len(first)
    for row, n in nchunks.items():
        assert {c for (*k, c) in as_set | carried if tuple(k) == row} == set(range(n))
    assert lengths.max() <= spec.packing.seq_len
    assert len(carried) < len(as_set) / 4, "carry is the exception"


def test_exactly_once_through_interruptions(spec, reference):
    """Stop and resume every few micro-batches on every rank: the union is the uninterrupted stream."""
    for rank in range(DP):
        got, state = [], None
        while True:
            loader = plait.Loader(spec, dp_rank=rank, steps=STEPS, read_ahead=1)
            if state is not None:
                loader.load_state_dict(state)
            part = take(loader, 4)
            state = json.loads(json.dumps(loader.state_dict()))
            loader.close()
            if not part:
                break
            got += part
        assert_batches_equal(got, reference[rank])


# ----- any layout (property) ----------------------------------------------------------------------
@settings(max_examples=20)
@given(
    seq_len=st.sampled_from([48, 96, 200]),
    microbatches=st.integers(1, 3),
    dp=st.integers(1, 3),
    balance=st.sampled_from([{}, {"mode": "variable"}, {"max_delay": 2, "outlier_factor": 0.5}]),
    data=st.data(),
)
def test_resume_and_exactly_once_any_layout(spec, seq_len, microbatches, dp, balance, data):
    layout = spec.with_overrides(packing={"seq_len": seq_len, "microbatches": microbatches}, topology={"dp": dp},
                                 balance=balance)
    rank = data.draw(st.integers(0, dp - 1))
    steps = 4
    ref = list(plait.Loader(layout, dp_rank=rank, steps=steps, read_ahead=0))
    n = data.draw(st.integers(0, len(ref)))
    first = plait.Loader(layout, dp_rank=rank, steps=steps, read_ahead=data.draw(st.integers(0, 2)))
    head = take(first, n)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = plait.Loader(layout, dp_rank=rank, steps=steps, read_ahead=data.draw(st.integers(0, 2)))
    resumed.load_state_dict(state)
    assert_batches_equal(head + list(resumed), ref)
    # exactly once over all ranks
    batches, rt, drawn = run_all_ranks(layout, steps, record_drawn=True)
    delivered = [tuple(r) for mb in batches for r in mb.sample_ids.tolist()]
    carried = {tuple(r) for r in rt.planner.carry.sample_ids().tolist()}
    rt.close()
    assert len(delivered) == len(set(delivered))
    assert set(delivered) | carried == {tuple(r) for d in drawn for r in d.sample_ids().tolist()}
    assert not (set(delivered) & carried)
    for mb in batches:
        assert len(mb.input_ids) <= seq_len


def test_stopping_early_leaves_no_prefetch_thread_behind(spec, reference):
    """Breaking out of a prefetching Loader stops its worker (no stall, no thread still stepping the
    runtime), and the same Loader then continues exactly where the consumer stopped."""
    import threading

    def workers():
        return [t for t in threading.enumerate() if t.name == "plait-prefetch" and t.is_alive()]

    import time

    before = len(workers())
    for n in (STEPS * M - 2, STEPS * M - 1, 1):
        loader = plait.Loader(spec, dp_rank=0, steps=STEPS, read_ahead=2)
        it = iter(loader)
        head = list(islice(it, n))
        if n >= STEPS * M - 2:  # let the worker finish the stream: it then waits for room in the queue
            for _ in range(2000):
                if loader.runtime.planner.step == STEPS:
                    break
                time.sleep(0.005)
        it.close()
        assert len(workers()) == before
        assert_batches_equal(head + list(loader), reference[0])
        assert len(workers()) == before
