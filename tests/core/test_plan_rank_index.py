"""A plan's per-rank views come from one index per plan: they must equal a scan of every item (and of every
group) for each rank, whatever the layout."""

import pickle

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.plan import CPGroups, members


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 7), max_size=60), st.integers(8, 10))
def test_members_equal_a_scan_per_key(keys, count):
    keys = np.array(keys, dtype=np.int64)
    of = members({}, "index", keys, count)
    for k in range(-1, count + 1):
        assert of(k).tolist() == np.flatnonzero(keys == k).tolist()


@st.composite
def groups(draw):
    """Waves of groups tiling a pool of ranks (a rank in at most one group per wave), as the CP planner
    lays them out."""
    ranks, waves = draw(st.integers(1, 9)), draw(st.integers(1, 4))
    wave, first, size = [], [], []
    for w in range(waves):
        r = 0
        while r < ranks:
            k = draw(st.integers(1, ranks - r))
            if draw(st.booleans()):  # some ranks sit a wave out
                wave.append(w), first.append(r), size.append(k)
            r += k
    order = draw(st.permutations(range(len(size))))  # group ids need not follow waves
    pick = np.array(order, dtype=np.int64)
    return ranks, CPGroups(np.array(wave, np.int32)[pick], np.array(first, np.int32)[pick], np.array(size, np.int32)[pick])


def scan_covering(g: CPGroups, rank: int) -> list[int]:
    ids = np.flatnonzero((g.first <= rank) & (rank < g.first + g.size))
    return ids[np.argsort(g.wave[ids], kind="stable")].tolist()


@settings(max_examples=80, deadline=None)
@given(groups())
def test_covering_equals_a_scan_of_every_group(case):
    ranks, g = case
    for r in range(ranks + 1):
        assert g.covering(r).tolist() == scan_covering(g, r)
    back = pickle.loads(pickle.dumps(g))  # the index is not sent, and is rebuilt on the other side
    assert "_rank_index" not in back.__dict__
    assert [back.covering(r).tolist() for r in range(ranks)] == [scan_covering(g, r) for r in range(ranks)]
