"""Multimodal balancing: two capacities (tokens, patches), the capacity-aware lower bound, the encoder cost
and its fit (`python -m benchmarks.multimodal`: tests/bench/test_bench_multimodal.py)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait import balance
from plait.balance import tuning
from plait.cost import CostModel, EncoderCost


@st.composite
def two_capacity_problems(draw, max_items: int = 300):
    R = draw(st.sampled_from([1, 2, 3, 5, 12, 64, 80]))
    M = draw(st.integers(1, 4))
    C = draw(st.integers(8, 512))
    Pc = draw(st.integers(4, 2048))
    n = draw(st.integers(0, max_items))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lengths = np.clip(rng.lognormal(np.log(C / 6), 1.2, n), 1, C + 3).astype(np.int64)
    patches = np.where(rng.random(n) < draw(st.floats(0.0, 1.0)),
                       np.clip(rng.lognormal(np.log(Pc / 5), 1.2, n), 0, Pc + 3), 0).astype(np.int64)
    kind = draw(st.sampled_from(["total", "ties", "arbitrary"]))
    if kind == "total":
        costs = lengths + lengths**2 / C + 3.0 * patches + patches**2 / Pc
    elif kind == "ties":
        costs = np.ones(n)
    else:
        costs = rng.integers(0, 50, n).astype(np.float64)
    priority = rng.integers(0, 3, n) if draw(st.booleans()) else None
    mode = draw(st.sampled_from(["equal", "variable"]))
    return lengths, costs, patches, R, M, C, Pc, priority, mode


def _assign(p, **extra):
    lengths, costs, patches, R, M, C, Pc, priority, mode = p
    return balance.assign(lengths, costs, ranks=R, microbatches=M, capacity=C, priority=priority, mode=mode,
                          loads=patches, load_capacity=Pc, **extra)


@settings(max_examples=120, deadline=None)
@given(two_capacity_problems())
def test_two_capacities_are_respected_and_nothing_is_lost(p):
    lengths, _, patches, R, _, C, Pc, _, _ = p
    a = _assign(p)
    n = len(lengths)
    placed = a.rank >= 0
    assert a.rank.shape == (n,) and ((a.rank >= -1) & (a.rank < R)).all()
    assert (a.micro[~placed] == -1).all() and (a.micro[placed] >= 0).all()
    assert (a.micro[placed] < a.microbatches[a.rank[placed]]).all()
    W = a.micro_cost.shape[1]
    tok = np.zeros((R, W), dtype=np.int64)
    pat = np.zeros((R, W), dtype=np.int64)
    np.add.at(tok, (a.rank[placed], a.micro[placed]), lengths[placed])
    np.add.at(pat, (a.rank[placed], a.micro[placed]), patches[placed])
    assert (tok <= C).all() and (pat <= Pc).all()
    assert (tok == a.micro_tokens).all() and (pat == a.micro_loads[..., 0]).all()
    # every item is placed once or carried (rank -1); what fits nowhere is carried
    assert not placed[(lengths > C) | (patches > Pc)].any()
    # deterministic
    b = _assign(p)
    assert np.array_equal(a.rank, b.rank) and np.array_equal(a.micro, b.micro)


@settings(max_examples=80, deadline=None)
@given(two_capacity_problems())
def test_without_patches_the_call_is_the_text_only_one(p):
    lengths, costs, patches, R, M, C, Pc, priority, mode = p
    kw = dict(ranks=R, microbatches=M, capacity=C, priority=priority, mode=mode)
    text = balance.assign(lengths, costs, **kw)
    for extra in (dict(loads=None), dict(loads=None, load_capacity=Pc),
                  dict(loads=np.zeros(len(lengths), dtype=np.int64), load_capacity=Pc)):
        same = balance.assign(lengths, costs, **kw, **extra)
        assert np.array_equal(text.rank, same.rank) and np.array_equal(text.micro, same.micro)
        assert np.array_equal(text.micro_cost, same.micro_cost) and np.array_equal(text.rank_cost, same.rank_cost)
        assert np.array_equal(text.micro_tokens, same.micro_tokens)
    # patches alone are reported, not limited
    free = balance.assign(lengths, costs, **kw, loads=patches)
    assert np.array_equal(free.rank, text.rank) and free.micro_loads.sum() == patches[free.placed].sum()


@settings(max_examples=30, deadline=None)
@given(st.integers(64, 160), st.integers(1, 4), st.integers(0, 4000), st.integers(0, 2**32 - 1))
def test_two_capacity_rounds_make_the_heaps_choices(R, W, n, seed):
    # With patches the round phase is still only a faster way to the heaps' assignment.
    rng = np.random.default_rng(seed)
    C, Pc = 1024, 4096
    lengths = np.clip(rng.lognormal(np.log(C / 12), 1.2, n), 1, C).astype(np.int64)
    patches = np.where(rng.random(n) < 0.5, np.clip(rng.lognormal(np.log(Pc / 12), 1.2, n), 0, Pc), 0).astype(np.int64)
    costs = lengths + 2.0 * patches
    kw = dict(ranks=R, microbatches=W, capacity=C, loads=patches, load_capacity=Pc)
    fast = balance.assign(lengths, costs, **kw)
    saved = tuning.ROUND_ITEM
    try:
        tuning.ROUND_ITEM = float("inf")
        slow = balance.assign(lengths, costs, **kw)
    finally:
        tuning.ROUND_ITEM = saved
    assert np.array_equal(fast.rank, slow.rank) and np.array_equal(fast.micro, slow.micro)


def test_big_two_capacity_step_with_snapshots_balances():
    # > SNAPSHOT_MIN items and >= ROUND_RANKS ranks: rounds, snapshots and resumed passes with patches.
    rng = np.random.default_rng(3)
    R, M, C, Pc, n = 128, 4, 4096, 8192, 30000
    lengths = np.clip(rng.lognormal(np.log(200), 1.0, n), 8, C).astype(np.int64)
    patches = np.where(rng.random(n) < 0.6, np.clip(rng.lognormal(np.log(600), 1.0, n), 0, Pc), 0).astype(np.int64)
    costs = lengths + lengths**2 / C + 4.0 * patches + patches**2 / Pc
    a = balance.assign(lengths, costs, ranks=R, microbatches=M, capacity=C, loads=patches, load_capacity=Pc)
    assert (a.micro_tokens <= C).all() and (a.micro_loads <= Pc).all()
    assert balance.max_over_capacity_lb(a, lengths, costs, patches, microbatches=M, capacity=C,
                                        load_capacity=Pc) <= 1.02


def _optimum(lengths, costs, patches, R, W, C, Pc):
    """The smallest largest rank cost over all assignments within both capacities (inf: none)."""
    n = len(lengths)

    def packs(items):  # do these items fit W micro-batches of (C, Pc)?
        bins = [[0, 0] for _ in range(W)]

        def go(k):
            if k == len(items):
                return True
            i = items[k]
            seen = set()
            for b in bins:
                if tuple(b) in seen:
                    continue
                seen.add(tuple(b))
                if b[0] + lengths[i] <= C and b[1] + patches[i] <= Pc:
                    b[0] += lengths[i]
                    b[1] += patches[i]
                    if go(k + 1):
                        return True
                    b[0] -= lengths[i]
                    b[1] -= patches[i]
            return False

        return go(0)

    best = np.inf
    fits: dict = {}
    for ranks in itertools.product(range(R), repeat=n):
        if any(ranks[i] > max(ranks[:i], default=-1) + 1 for i in range(n)):
            continue  # ranks are interchangeable: first use in order
        groups = [tuple(i for i in range(n) if ranks[i] == r) for r in range(R)]
        top = max(float(sum(costs[i] for i in g)) for g in groups)
        if top >= best:
            continue
        if all(fits.setdefault(g, packs(g)) for g in groups):
            best = top
    return best


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 7), st.integers(1, 3), st.integers(1, 2), st.integers(0, 2**32 - 1), st.booleans())
def test_capacity_lower_bound_is_below_the_optimum(n, R, W, seed, with_patches):
    rng = np.random.default_rng(seed)
    C, Pc = 10, 10
    lengths = rng.integers(1, C + 1, n).astype(np.int64)
    patches = rng.integers(0, Pc + 1, n).astype(np.int64) if with_patches else np.zeros(n, dtype=np.int64)
    costs = np.round(lengths + lengths**2 / 4 + patches * rng.random() * 3, 3)
    lb = balance.capacity_lower_bound(lengths, costs, patches if with_patches else None, ranks=R, microbatches=W,
                                      capacity=C, load_capacity=Pc if with_patches else None)
    assert lb >= balance.lower_bound(costs, R)
    opt = _optimum(lengths, costs, patches, R, W, C, Pc)
    assert lb <= opt


def test_capacity_lower_bound_sees_long_items_that_cannot_spread():
    # 3 ranks of 2 micro-batches (10 tokens): 4 long items (6 tokens, cost 10), 6 short ones (2 tokens,
    # cost 1). Some rank holds 2 of the long items: 20, well above the average 46 / 3.
    lengths = np.array([6, 6, 6, 6] + [2] * 6, dtype=np.int64)
    costs = np.array([10.0] * 4 + [1.0] * 6)
    lb_old = balance.lower_bound(costs, 3)  # 46 / 3
    lb = balance.capacity_lower_bound(lengths, costs, ranks=3, microbatches=2, capacity=10)
    assert lb > lb_old + 1.0  # the rank with 2 long items costs at least 20 + its share of short items
    assert lb <= _optimum(lengths, costs, np.zeros(10, dtype=np.int64), 3, 2, 10, 10)


def test_encoder_cost_per_item_and_total():
    enc = EncoderCost(2.0, 0.5)
    np.testing.assert_allclose(enc(np.array([0, 2, 4])), [0.0, 6.0, 16.0])
    per_image = np.array([2, 4, 4, 1])
    offsets = np.array([0, 2, 2, 4])  # item 0: two images, item 1: none, item 2: two
    np.testing.assert_allclose(enc.per_item(per_image, offsets), [6.0 + 16.0, 0.0, 16.0 + 2.5])
    vit = EncoderCost.from_dims(1024, 24, 4096)
    assert vit.linear == 3.0 * 24 * (8 * 1024**2 + 4 * 1024 * 4096) and vit.quadratic == 3.0 * 24 * 4 * 1024
    model = CostModel(1.0, 0.01, encoder=enc)
    lengths = np.array([10, 0, 20])
    np.testing.assert_allclose(model(lengths, per_image, offsets), model.text(lengths) + [22.0, 0.0, 18.5])


def test_fit_recovers_both_parts(tmp_path):
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(60):
        docs = rng.integers(100, 4000, rng.integers(1, 8))
        imgs = rng.integers(256, 8000, rng.integers(0, 6))
        rows.append((docs.sum(), (docs**2).sum(), len(docs), imgs.sum(), (imgs**2).sum()))
    X = np.array(rows, dtype=np.float64)
    truth = (2e-6, 3e-10, 1e-4, 5e-6, 4e-10, 2e-3)  # linear, quadratic, per_doc, enc linear, enc quadratic, overhead
    time = X @ np.array(truth[:5]) + truth[5]
    model, report = CostModel.fit(X[:, 0], X[:, 1], X[:, 2], time, sum_P=X[:, 3], sum_P2=X[:, 4])
    np.testing.assert_allclose([model.linear, model.quadratic, model.per_doc], truth[:3], rtol=1e-5)
    np.testing.assert_allclose([model.encoder.linear, model.encoder.quadratic], truth[3:5], rtol=1e-5)
    assert report["overhead"] == pytest.approx(truth[5], rel=1e-5) and report["r2"] > 0.999999
    # the command reads the encoder columns; files without them fit as before
    from plait.cli import main

    path = tmp_path / "mm.csv"
    lines = ["sum_L,sum_L2,count,sum_P,sum_P2,time"] + [",".join(map(str, (*r, t))) for r, t in zip(rows, time)]
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "fit.json"
    assert main(["fit-cost", str(path), "--json", str(out)]) == 0
    fitted = json.loads(out.read_text())
    assert fitted["encoder_linear"] == pytest.approx(truth[3], rel=1e-5)
    assert fitted["encoder_quadratic"] == pytest.approx(truth[4], rel=1e-5)
    half = tmp_path / "half.csv"
    half.write_text("sum_L,sum_L2,count,sum_P,time\n1,1,1,1,1\n2,4,1,2,2\n")
    assert main(["fit-cost", str(half)]) == 2
