"""Balancing: properties of balance.assign (hypothesis) and of the Planner steps that use it."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import FakeProvider
from hypothesis import example, given, settings
from hypothesis import strategies as st

from plait import balance
from plait.balance import lpt, ordering, tuning
from plait.cost import CostModel
from plait.roles.planner import Planner
from plait.spec import load_spec

COST = CostModel(1.0, 1.0 / 64)


@st.composite
def problems(draw, max_items: int = 300):
    """A random step: lengths <= capacity, costs c(L) (or arbitrary), layout, carried priorities."""
    R = draw(st.integers(1, 12))
    M = draw(st.integers(1, 4))
    C = draw(st.integers(8, 256))
    n = draw(st.integers(0, max_items))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["lognormal", "uniform", "equal", "arbitrary"]))
    if kind == "lognormal":
        lengths = np.clip(rng.lognormal(np.log(C / 6), 1.2, n), 1, C).astype(np.int64)
    elif kind == "uniform":
        lengths = rng.integers(1, C + 1, n)
    else:
        lengths = np.full(n, max(1, C // draw(st.integers(1, 8))), dtype=np.int64)
    costs = COST(lengths) if kind != "arbitrary" else rng.integers(0, 50, n).astype(np.float64)
    priority = rng.integers(0, 3, n) if draw(st.booleans()) else None
    mode = draw(st.sampled_from(["equal", "variable"]))
    return lengths, costs, R, M, C, priority, mode


def check_valid(a: balance.Assignment, lengths, costs, R, M, C, mode):
    n = len(lengths)
    assert a.rank.shape == (n,) and a.micro.shape == (n,)
    placed = a.rank >= 0
    assert ((a.rank >= -1) & (a.rank < R)).all()
    assert (a.micro[~placed] == -1).all()
    W = a.micro_cost.shape[1]
    assert a.micro_tokens.shape == (R, W) and a.microbatches.shape == (R,)
    if mode == "equal":
        assert W == M and (a.microbatches == M).all()
    else:
        assert (a.microbatches >= 1).all() and (a.microbatches <= 2 * M).all() and W == max(1, a.microbatches.max())
    # every placed item sits in one of its rank's micro-batches; the reported sums are exactly its items
    assert (a.micro[placed] >= 0).all() and (a.micro[placed] < a.microbatches[a.rank[placed]]).all()
    tokens = np.zeros((R, W), dtype=np.int64)
    cost = np.zeros((R, W))
    np.add.at(tokens, (a.rank[placed], a.micro[placed]), lengths[placed])
    np.add.at(cost, (a.rank[placed], a.micro[placed]), costs[placed])
    assert (tokens == a.micro_tokens).all()
    assert (tokens <= C).all()  # capacity respected
    np.testing.assert_allclose(cost, a.micro_cost, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(cost.sum(axis=1), a.rank_cost, rtol=1e-9, atol=1e-9)
    # micro-batches past a rank's count are empty
    beyond = np.arange(W)[None, :] >= a.microbatches[:, None]
    assert (a.micro_tokens[beyond] == 0).all()


def ratio(a: balance.Assignment, costs, R) -> float:
    lb = balance.lower_bound(costs[a.placed], R)
    return float(a.rank_cost.max()) / lb if lb > 0 else 1.0


@given(problems())
def test_assignment_is_valid_and_deterministic(p):
    lengths, costs, R, M, C, priority, mode = p
    a = balance.assign(lengths, costs, ranks=R, microbatches=M, capacity=C, priority=priority, mode=mode)
    check_valid(a, lengths, costs, R, M, C, mode)
    b = balance.assign(lengths.copy(), costs.copy(), ranks=R, microbatches=M, capacity=C,
                       priority=None if priority is None else priority.copy(), mode=mode)
    for f in ("rank", "micro", "rank_cost", "micro_cost", "micro_tokens", "microbatches"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f


# Found by hypothesis: the capped LPT pass places item 65 (cost 131) past the cap on the least-loaded
# rank, then holds back two 12-token items to keep other ranks under a cap the step already exceeds:
# 1805 tokens placed against greedy's 1829, max 1050.05 > LB (1 + CAP_SLACK) = 1042.83.
MISSED_CAP = np.array([123, 12, 135, 70, 65, 13, 8, 89, 42, 112, 197, 77, 10, 17, 124, 169, 135, 49, 12, 12, 37, 19,
                       183, 3, 67, 23, 26], dtype=np.int64)


@example((MISSED_CAP, COST(MISSED_CAP), 5, 2, 197, None, "equal"))
@given(problems())
def test_never_worse_than_greedy(p):
    lengths, costs, R, M, C, priority, _ = p
    a = balance.assign(lengths, costs, ranks=R, microbatches=M, capacity=C)
    g = balance.greedy(lengths, costs, ranks=R, microbatches=M, capacity=C)
    assert ratio(a, costs, R) <= ratio(g, costs, R) * (1 + 1e-9)
    # and it places at least the tokens greedy would, unless it chose to carry some to cap the maximum
    if a.rank_cost.max() > balance.lower_bound(costs, R) * (1 + tuning.CAP_SLACK):
        assert lengths[a.placed].sum() >= lengths[g.placed].sum()


@given(problems())
def test_places_everything_when_it_fits_loosely(p):
    lengths, costs, R, M, C, _, mode = p
    # capacity for every item on every rank: nothing may stay behind
    big = int(lengths.sum()) + 1
    a = balance.assign(lengths, costs, ranks=R, microbatches=M, capacity=big, mode=mode)
    assert a.placed.all()
    check_valid(a, lengths, costs, R, M, big, mode)


@given(problems())
def test_items_that_fit_nowhere_stay_unplaced(p):
    lengths, costs, R, M, C, _, mode = p
    lengths = lengths.copy()
    if len(lengths):
        lengths[0] = C + 1  # can never fit
    a = balance.assign(lengths, COST(lengths), ranks=R, microbatches=M, capacity=C, mode=mode)
    if len(lengths):
        assert a.rank[0] == -1 and a.micro[0] == -1


def test_carrying_that_misses_the_cap_gives_way_to_the_plain_pass():
    """A capped pass that held items back yet ends above the cap makes the step no faster than the cap
    allows: the plain pass, placing every token greedy places, is kept instead."""
    lengths, costs, R, M, C = MISSED_CAP, COST(MISSED_CAP), 5, 2, 197
    cap = balance.lower_bound(costs, R) * (1 + tuning.CAP_SLACK)
    order = np.lexsort((np.arange(len(costs)), -costs))
    capped = lpt.LptRun(np.zeros(len(costs), dtype=bool), lengths[order], costs[order], R, M, C, cap).result
    assert capped.skipped == 2 and capped.rank_cost.max() > cap  # the situation: carried, cap missed anyway
    a = balance.assign(lengths, costs, ranks=R, microbatches=M, capacity=C)
    g = balance.greedy(lengths, costs, ranks=R, microbatches=M, capacity=C)
    assert a.placed.all() and lengths[a.placed].sum() == lengths[g.placed].sum() == 1829
    assert a.rank_cost.max() == pytest.approx(g.rank_cost.max())


def test_urgent_items_go_first():
    # A full-capacity chunk carried before must be placed even when small new items could fill every slot.
    C = 100
    lengths = np.concatenate([[C], np.full(400, 10)])
    pr = np.zeros(len(lengths), dtype=np.int64)
    pr[0] = 2
    a = balance.assign(lengths, COST(lengths), ranks=2, microbatches=2, capacity=C, priority=pr)
    assert a.rank[0] >= 0


@given(st.lists(st.floats(0, 1e12, allow_nan=False), max_size=200), st.integers(0, 2))
def test_order_is_decreasing_cost_ties_by_index(costs, urgent_every):
    costs = np.asarray(costs, dtype=np.float64)
    n = len(costs)
    pr = None if urgent_every == 0 else (np.arange(n) % (urgent_every + 1) == 0).astype(np.int64) * 2
    order, _, _ = ordering.sorted_items(costs, pr, None)
    urgent = np.zeros(n, bool) if pr is None else pr >= 2
    expect = np.lexsort((np.arange(n), -costs, ~urgent))
    assert np.array_equal(order, expect)


@given(st.integers(1, 6), st.integers(1, 9), st.integers(0, 2**31))
def test_middle_heavy_order(R, M, seed):
    rng = np.random.default_rng(seed)
    mc = rng.integers(0, 5, size=(R, M)).astype(np.float64)
    counts = rng.integers(1, M + 1, size=R)
    for cnt in (None, counts):
        pos = balance.middle_heavy_order(mc, cnt)
        for r in range(R):
            m = M if cnt is None else int(cnt[r])
            assert sorted(pos[r, :m]) == list(range(m))  # a permutation of the rank's micro-batches
            assert list(pos[r, m:]) == list(range(m, M))  # the rest stay put
            arranged = np.empty(m)
            arranged[pos[r, :m]] = mc[r, :m]
            assert_middle_heavy(arranged)


def assert_middle_heavy(x: np.ndarray) -> None:
    """Non-decreasing up to the peak, non-increasing after it, and the peak in the middle."""
    m = len(x)
    if m == 0:
        return
    k = int(np.argmax(x))
    assert (np.diff(x[: k + 1]) >= 0).all() and (np.diff(x[k:]) <= 0).all(), x
    assert x[(m - 1) // 2] == x.max() or x[m // 2] == x.max(), x


@given(problems())
def test_assigned_micro_batches_are_middle_heavy(p):
    lengths, costs, R, M, C, _, mode = p
    a = balance.assign(lengths, costs, ranks=R, microbatches=M, capacity=C, mode=mode)
    for r in range(R):
        assert_middle_heavy(a.micro_cost[r, : a.microbatches[r]])


def test_lower_bound():
    assert balance.lower_bound(np.array([]), 4) == 0.0
    assert balance.lower_bound(np.array([1.0, 1.0, 1.0, 1.0]), 2) == 2.0
    assert balance.lower_bound(np.array([10.0, 1.0, 1.0]), 4) == 10.0


@pytest.mark.parametrize("mode", ["equal", "variable"])
def test_many_documents_per_rank_certify_within_one_percent(mode):
    # >= 8 documents per rank and a context where tokens do not bind: max/LB <= 1.01.
    rng = np.random.default_rng(0)
    R, M, C = 256, 4, 8192
    lengths = np.clip(rng.lognormal(np.log(350), 1.2, 30 * R), 16, C).astype(np.int64)
    costs = CostModel.from_dims(4096, 32, 11008, 32)(lengths)
    a = balance.assign(lengths, costs, ranks=R, microbatches=M, capacity=C, mode=mode)
    assert a.placed.all()
    assert ratio(a, costs, R) <= 1.01


def test_variable_mode_balances_when_tokens_bind():
    # One 128k chunk per few ranks: equal mode must carry or be uneven; variable mode lets the light
    # ranks take more tokens and reaches the bound.
    rng = np.random.default_rng(1)
    R, M, C = 64, 4, 131072
    lengths = np.clip(rng.lognormal(np.log(2000), 1.3, 200 * R), 64, C).astype(np.int64)
    lengths = lengths[: np.searchsorted(np.cumsum(lengths), R * M * C)]
    costs = CostModel.from_dims(4096, 32, 11008, 32)(lengths)
    v = balance.assign(lengths, costs, ranks=R, microbatches=M, capacity=C, mode="variable")
    assert v.placed.all() and ratio(v, costs, R) <= 1.01
    e = balance.assign(lengths, costs, ranks=R, microbatches=M, capacity=C, mode="equal")
    g = balance.greedy(lengths, costs, ranks=R, microbatches=M, capacity=C)
    assert ratio(g, costs, R) > 1.05 and ratio(e, costs, R) < 1.05


def test_first_fit_baseline():
    rank = np.array([0, 0, 0, 1, 1], dtype=np.int64)
    lengths = np.array([6, 6, 4, 11, 3], dtype=np.int64)
    micro = np.empty(5, dtype=np.int64)
    balance.first_fit(rank, lengths, 2, 10, micro)
    assert micro.tolist() == [0, 1, 0, -1, 0]


# ----- the Planner around it -----------------------------------------------------------------------
def planner(tmp_path, *, dp=4, microbatches=2, seq_len=64, ranges=((1, 40), (30, 200)), **extra) -> Planner:
    sources = [{"name": f"s{i}", "path": str(tmp_path / f"s{i}.parquet"), "tokens_field": "ids"} for i in range(len(ranges))]
    spec = load_spec({"sources": sources, "packing": {"seq_len": seq_len, "microbatches": microbatches},
                      "topology": {"dp": dp, **extra.pop("topology", {})}, "cost": {"linear": 1.0, "quadratic": 0.01},
                      **extra})
    return Planner(spec, FakeProvider(list(ranges), blocks=6, docs_per_block=32))


def drawn_ids(plans) -> list[tuple]:
    return [tuple(r) for p in plans for r in p.items.sample_ids().tolist()]


def test_planner_stats_certificate(tmp_path):
    pl = planner(tmp_path)
    for _ in range(5):
        plan = pl.plan_step()
        s = plan.stats()
        lb = max(plan.cost.sum() / plan.ranks, plan.cost.max())
        assert s["lower_bound"] == pytest.approx(lb)
        assert s["max_over_lb"] == pytest.approx(plan.rank_cost.max() / lb)
        assert s["max_over_mean"] == pytest.approx(plan.rank_cost.max() / plan.rank_cost.mean())
        per_rank = np.bincount(plan.rank, weights=plan.items.length, minlength=plan.ranks)
        assert s["tokens_max_over_mean"] == pytest.approx(per_rank.max() / per_rank.mean())
        np.testing.assert_allclose(np.bincount(plan.rank, weights=plan.cost, minlength=plan.ranks), plan.rank_cost)
        assert s["global_label_tokens"] == int((plan.items.length - 1).clip(min=0).sum())
        assert plan.for_rank(0).stats == s


def test_planner_variable_mode_counts(tmp_path):
    pl = planner(tmp_path, balance={"mode": "variable"})
    seen = []
    for _ in range(6):
        plan = pl.plan_step()
        assert plan.rank_microbatches is not None and (plan.rank_microbatches <= plan.microbatches).all()
        for r in range(plan.ranks):
            rp = plan.for_rank(r)
            assert rp.microbatches == plan.rank_microbatches[r]
            assert (rp.micro < rp.microbatches).all()
        seen.append(plan)
    ids = drawn_ids(seen)
    assert len(ids) == len(set(ids))


def test_planner_context_parallel_reports_per_cp_rank_cost(tmp_path):
    a = planner(tmp_path).plan_step()
    b = planner(tmp_path, topology={"cp": 4}).plan_step()
    assert np.array_equal(a.rank, b.rank) and np.array_equal(a.micro, b.micro)
    np.testing.assert_allclose(b.rank_cost, a.rank_cost / 4)
    assert b.max_over_lb == pytest.approx(a.max_over_lb)


def test_planner_delays_outliers_at_most_max_delay_steps(tmp_path):
    # Short documents with rare long ones; one micro-batch per rank so long ones outweigh a rank's mean.
    kw = dict(dp=8, microbatches=1, seq_len=256, ranges=((1, 20), (200, 256)))
    base = planner(tmp_path, **kw)
    pl = planner(tmp_path, balance={"max_delay": 2, "outlier_factor": 1.0}, **kw)
    plans = [pl.plan_step() for _ in range(12)]
    assert sum(p.delayed_outliers for p in plans) > 0
    assert all(int(p.items.delayed.max(initial=0)) <= 2 + 1 for p in plans)  # + 1 for a capacity carry
    # the data state round-trips with held outliers in it
    state = pl.state_dict()
    other = planner(tmp_path, balance={"max_delay": 2, "outlier_factor": 1.0}, **kw)
    other.load_state_dict(state)
    assert drawn_ids([other.plan_step()]) == drawn_ids([pl.plan_step()])
    # nothing is delivered twice, and delaying does not drop anything the plain planner delivers
    ids = drawn_ids(plans)
    assert len(ids) == len(set(ids))
    plain = set(drawn_ids([base.plan_step() for _ in range(6)]))
    delivered = set(drawn_ids(plans)) | {tuple(r) for r in pl.carry.sample_ids().tolist()}
    assert plain <= delivered | set(drawn_ids([pl.plan_step() for _ in range(4)]))


def test_planner_no_delay_by_default(tmp_path):
    pl = planner(tmp_path, dp=8, microbatches=1, seq_len=256, ranges=((1, 20), (200, 256)))
    assert all(pl.plan_step().delayed_outliers == 0 for _ in range(6))


@pytest.mark.parametrize("dist,R", [("web", 64), ("longctx", 64), ("longctx", 512)])
def test_equal_mode_long_context_within_one_percent(dist, R):
    # 128k micro-batches full of tokens, long chunks costlier than short documents: whole micro-batches
    # move between ranks and a few long chunks (<= 1% of the tokens, never urgent ones) are carried.
    import zlib

    from fixtures import step_chunks

    M, C = 4, 131072
    rng = np.random.default_rng(zlib.crc32(f"{dist}/{R}/{C}/0/0".encode()))
    lengths = step_chunks(dist, R * M * C, C, rng)
    costs = CostModel.from_dims(4096, 32, 11008, 32)(lengths)
    priority = np.zeros(len(lengths), dtype=np.int64)
    priority[np.flatnonzero(lengths == C)[:R // 4]] = 2  # carried before: must be placed now
    a = balance.assign(lengths, costs, ranks=R, microbatches=M, capacity=C, priority=priority)
    assert ratio(a, costs, R) <= 1.01
    assert a.placed[priority >= 2].all()
    plain = balance.assign(lengths, costs, ranks=R, microbatches=M, capacity=C)
    assert ratio(plain, costs, R) <= 1.01
    assert lengths[plain.placed].sum() >= 0.93 * R * M * C


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 3, 16, 64, 100]), st.integers(1, 4), st.integers(64, 512), st.integers(0, 4000),
       st.integers(0, 2**32 - 1), st.floats(0.9, 1.05))
def test_passes_resumed_from_snapshots_equal_full_passes(R, W, C, n, seed, cap_factor):
    # Later LPT passes at other caps resume from the first pass's snapshots: the result must be exactly
    # that of a pass from scratch (heap phase, round phase, and the first held-back item all covered).
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(C / 8), 1.3, n), 1, C).astype(np.int64)
    urgent = rng.random(n) < 0.02
    order, Ls, Cs = ordering.sorted_items(COST(lengths), urgent.astype(np.int64) * 2, lengths)
    Us = urgent[order]
    lb = balance.lower_bound(Cs, R)
    saved = tuning.SNAPSHOT_MIN
    tuning.SNAPSHOT_MIN = 0  # snapshots at any size (normally only for large steps)
    try:
        first = lpt.LptRun(Us, Ls, Cs, R, W, C, lb * 1.002)
    finally:
        tuning.SNAPSHOT_MIN = saved
    for cap in (np.inf, lb * cap_factor, lb * 1.0001, lb * 1.01):
        resumed = first.rerun(cap)
        scratch = first.pass_from_scratch(cap)  # one pass from the first item, no snapshots
        assert np.array_equal(resumed.rank, scratch.rank) and np.array_equal(resumed.micro, scratch.micro)
        assert resumed.skipped == scratch.skipped
        np.testing.assert_array_equal(resumed.room, scratch.room)


@settings(max_examples=20, deadline=None)
@given(st.integers(4097, 20000), st.integers(0, 2**32 - 1), st.sampled_from(["text", "tiles", "arbitrary"]))
def test_sorted_items_by_length_equal_the_cost_order(n, seed, kind):
    # The fast path sorts by length when cost is an increasing function of it; it must give the very
    # order of the cost sort (ties by index), and fall back when cost is not such a function.
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 3000, n).astype(np.int64)
    if kind == "text":
        costs = COST(lengths)
    elif kind == "tiles":  # constant per 128-token tile: equal costs for different lengths
        costs = np.ceil(lengths / 128.0) * 7.0
    else:
        costs = rng.integers(1, 50, n).astype(np.float64)
    order, Ls, Cs = ordering.sorted_items(costs, None, lengths)
    expect = np.lexsort((np.arange(n), -costs))
    assert np.array_equal(order, expect)
    assert np.array_equal(Ls, lengths[expect]) and np.array_equal(Cs, costs[expect])


def heaps_only(**kw) -> balance.Assignment:
    saved = tuning.ROUND_ITEM
    try:
        tuning.ROUND_ITEM = float("inf")  # no item is small enough for the rounds: heaps only
        return balance.assign(**kw)
    finally:
        tuning.ROUND_ITEM = saved


def test_tuning_is_read_when_the_stages_run():
    # The stages read plait.balance.tuning when they run (no copies taken at import): patching a value
    # there changes the next call.
    R = 64
    costs = np.ones(R * 40)
    urgent = np.zeros(len(costs), dtype=np.bool_)
    assert lpt.round_start(urgent, costs, R) == 0  # every item small enough for the rounds
    saved = tuning.ROUND_ITEM
    try:
        tuning.ROUND_ITEM = float("inf")
        assert lpt.round_start(urgent, costs, R) == len(costs)  # heaps only
    finally:
        tuning.ROUND_ITEM = saved
    lengths = np.ones(len(costs), dtype=np.int64)
    assert lpt.LptRun(urgent, lengths, costs, R, 1, 100, 1.0).snaps is None  # a small step: no snapshots
    saved = tuning.SNAPSHOT_MIN
    try:
        tuning.SNAPSHOT_MIN = 0
        assert lpt.LptRun(urgent, lengths, costs, R, 1, 100, 1.0).snaps is not None
    finally:
        tuning.SNAPSHOT_MIN = saved


def test_lpt_rounds_hand_over_to_the_heaps_exactly():
    # Found in review: rank 5 fills up during the rounds; the heaps then take over and must hold the
    # same ranks as if they had run all along (a rank too full but costlier than the least loaded one
    # with room stays in the cost heap), or the cap carries the last item that LPT places.
    R, rounds = 64, 40
    lengths = np.ones(R * rounds + 1, dtype=np.int64)
    lengths[5 : R * rounds : R] = 2
    kw = dict(lengths=lengths, costs=np.ones(len(lengths)), ranks=R, microbatches=1, capacity=2 * rounds)
    fast, slow = balance.assign(**kw), heaps_only(**kw)
    assert slow.rank[-1] >= 0
    assert np.array_equal(fast.rank, slow.rank) and np.array_equal(fast.micro, slow.micro)


@settings(max_examples=30, deadline=None)
@given(st.integers(64, 256), st.integers(1, 4), st.integers(32, 2048), st.integers(0, 6000), st.integers(0, 2**32 - 1),
       st.sampled_from(["text", "flat", "two-level"]))
def test_lpt_rounds_make_the_heaps_choices(R, W, C, n, seed, kind):
    # The round phase is a faster way to the same assignment: with it disabled (every item through the
    # heaps) the result must be identical.
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(C / 12), 1.2, n), 1, C).astype(np.int64)
    if kind == "text":
        costs = COST(lengths)
    elif kind == "flat":  # every item the same cost, lengths differing: ties everywhere
        costs = np.ones(n)
    else:
        costs = np.where(rng.random(n) < 0.1, 5.0, 1.0)
    fast = balance.assign(lengths, costs, ranks=R, microbatches=W, capacity=C)
    slow = heaps_only(lengths=lengths, costs=costs, ranks=R, microbatches=W, capacity=C)
    assert np.array_equal(fast.rank, slow.rank) and np.array_equal(fast.micro, slow.micro)
