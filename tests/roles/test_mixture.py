"""Mixture: token shares track the target weights exactly over time (error diffusion); schedules."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import plait
from plait.mixture import MixtureSchedule, take_count
from plait.roles.planner import Planner
from helpers import FakeProvider, make_spec, run_all_ranks, token_parquet
from plait.cli.stream import stream


def fake_spec(n: int, weights=None, schedule=None, interpolation="linear", seq_len=64, microbatches=2, dp=1):
    sources = [{"name": f"s{i}", "path": "/unused", "tokens_field": "t", "weight": (weights or [1] * n)[i]} for i in range(n)]
    extra = {"mixture": {"schedule": schedule, "interpolation": interpolation}} if schedule else {}
    return plait.load_spec(make_spec(sources, seq_len=seq_len, microbatches=microbatches, dp=dp, **extra))


def check_error_diffusion(planner: Planner, provider: FakeProvider, steps: int) -> np.ndarray:
    """After every step: 0 <= drawn_i - target_i < longest chunk of source i (a document or seq_len)."""
    n = len(planner.spec.sources)
    target = np.zeros(n)
    maxlen = np.array([min(provider.max_length(i), planner.seq_len) for i in range(n)], dtype=np.float64)
    capacity = planner.ranks * planner.microbatches * planner.capacity
    for _ in range(steps):
        budget = max(0, capacity - int(planner.carry.length.sum()))
        target += planner.mixture.weights(planner.step) * budget
        plan = planner.plan_step()
        gap = planner.drawn - target
        assert np.all(gap > -1e-6), (plan.step, gap)
        assert np.all(gap < maxlen + 1e-6), (plan.step, gap, maxlen)
        assert np.all(plan.micro_tokens <= planner.capacity)
    return target


@given(
    weights=st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=1, max_size=4).filter(lambda w: sum(w) > 0.01),
    data=st.data(),
    seq_len=st.sampled_from([32, 64, 256]),
    microbatches=st.integers(1, 3),
    dp=st.integers(1, 3),
)
def test_error_diffusion_property(weights, data, seq_len, microbatches, dp):
    n = len(weights)
    ranges = [tuple(sorted(data.draw(st.tuples(st.integers(1, 400), st.integers(1, 400))))) for _ in range(n)]
    spec = fake_spec(n, weights, seq_len=seq_len, microbatches=microbatches, dp=dp)
    provider = FakeProvider(ranges, blocks=3, docs_per_block=10)
    planner = Planner(spec, provider)
    check_error_diffusion(planner, provider, steps=25)
    # sources with weight 0 get nothing
    for i, w in enumerate(weights):
        if w == 0:
            assert planner.drawn[i] == 0


@given(
    points=st.lists(st.lists(st.floats(0.0, 5.0, allow_nan=False), min_size=3, max_size=3).filter(lambda w: sum(w) > 0.01),
                    min_size=1, max_size=4),
    gaps=st.lists(st.integers(1, 8), min_size=3, max_size=3),
    interpolation=st.sampled_from(["linear", "step"]),
)
def test_error_diffusion_with_schedules(points, gaps, interpolation):
    steps = np.concatenate([[0], np.cumsum(gaps)])[: len(points)]
    schedule = [{"step": int(s), "weights": {f"s{i}": w for i, w in enumerate(p)}} for s, p in zip(steps, points)]
    spec = fake_spec(3, schedule=schedule, interpolation=interpolation)
    provider = FakeProvider([(1, 50), (20, 120), (5, 300)], blocks=2, docs_per_block=12)
    check_error_diffusion(Planner(spec, provider), provider, steps=30)


def test_schedule_interpolation_values():
    sched = [{"step": 0, "weights": {"s0": 1, "s1": 0}}, {"step": 10, "weights": {"s0": 0, "s1": 3}},
             {"step": 20, "weights": {"s0": 1}}]
    lin = MixtureSchedule(fake_spec(2, schedule=sched, interpolation="linear"))
    np.testing.assert_allclose(lin.weights(0), [1, 0])
    np.testing.assert_allclose(lin.weights(5), [0.5 / 2.0, 1.5 / 2.0])  # (0.5, 1.5) normalised
    np.testing.assert_allclose(lin.weights(10), [0, 1])
    np.testing.assert_allclose(lin.weights(15), [0.5 / 2.0, 1.5 / 2.0])  # (0.5, 1.5): s1 missing at 20 = 0
    np.testing.assert_allclose(lin.weights(20), [1, 0])
    np.testing.assert_allclose(lin.weights(1000), [1, 0])
    step = MixtureSchedule(fake_spec(2, schedule=sched, interpolation="step"))
    np.testing.assert_allclose(step.weights(9), [1, 0])
    np.testing.assert_allclose(step.weights(10), [0, 1])
    np.testing.assert_allclose(step.weights(19), [0, 1])
    np.testing.assert_allclose(step.weights(25), [1, 0])
    flat = MixtureSchedule(fake_spec(3, weights=[1, 1, 2]))
    np.testing.assert_allclose(flat.weights(123), [0.25, 0.25, 0.5])


def test_step_schedule_switches_sources():
    sched = [{"step": 0, "weights": {"s0": 1}}, {"step": 5, "weights": {"s1": 1}}]
    spec = fake_spec(2, schedule=sched, interpolation="step")
    planner = Planner(spec, FakeProvider([(10, 30), (10, 30)]))
    for step in range(10):
        before = planner.drawn.copy()
        planner.plan_step()
        new = planner.drawn - before
        if step < 5:
            assert new[1] == 0 and new[0] > 0
        else:
            assert new[0] == 0 and new[1] > 0


def test_take_count():
    lengths = np.array([10, 10, 10])
    assert take_count(lengths, 0) == 0
    assert take_count(lengths, -5) == 0
    assert take_count(lengths, 1) == 1
    assert take_count(lengths, 10) == 1
    assert take_count(lengths, 10.5) == 2
    assert take_count(lengths, 100) == 3
    assert take_count(np.array([], dtype=np.int64), 5) == 0


def test_mixture_on_real_files_matches_target(tmp_path):
    a = token_parquet(tmp_path / "a", name="a", files=2, docs_per_file=40, row_group_size=10, lo=5, hi=60, weight=3)
    b = token_parquet(tmp_path / "b", name="b", files=2, docs_per_file=40, row_group_size=10, lo=30, hi=200, seed=1,
                      weight=1)
    spec = plait.load_spec(make_spec([a, b], seq_len=128, microbatches=2, dp=2))
    summary = stream(spec, steps=20, progress=False)
    for name, target in (("a", 0.75), ("b", 0.25)):
        m = summary["mixture"][name]
        assert m["target"] == pytest.approx(target)
        assert m["achieved"] == pytest.approx(target, abs=0.03)
    # and the delivered batches carry the source ids in that proportion
    batches, rt, _ = run_all_ranks(spec, 20)
    rt.close()
    toks = np.zeros(2)
    for mb in batches:
        np.add.at(toks, mb.source_ids, np.diff(mb.cu_seqlens))
    assert toks[0] / toks.sum() == pytest.approx(0.75, abs=0.03)


def test_error_diffusion_on_real_sources(tmp_path):
    """The same exact-tracking property with real readers, chunking and carry in play."""
    from plait.roles.source_loader import SourceLoader

    from helpers import expected_tokens, text_source

    a = token_parquet(tmp_path / "a", name="a", files=2, docs_per_file=15, row_group_size=4, lo=5, hi=300, weight=1)
    b = text_source(tmp_path / "b", fmt="jsonl", name="b", files=2, docs_per_file=20, weight=2, eos=256)
    sched = [{"step": 0, "weights": {"a": 1, "b": 2}}, {"step": 8, "weights": {"a": 3, "b": 1}}]
    spec = plait.load_spec(make_spec([a, b], seq_len=64, microbatches=2, dp=2, mixture={"schedule": sched}))
    loader = SourceLoader(spec)

    class Provider:
        first_key = loader.first_key
        block_meta = loader.block_meta

        @staticmethod
        def max_length(i):
            return max(len(t) for t in expected_tokens((a, b)[i]).values())

    check_error_diffusion(Planner(spec, Provider()), Provider(), steps=16)
    loader.close()
