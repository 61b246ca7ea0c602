"""plait.exactly_once: the comparison the chaos tests and recovery benchmarks trust must see every fault."""

from __future__ import annotations

import numpy as np

from plait.exactly_once import compare_streams, kill_points


def ids(*rows):
    return np.array(rows, dtype=np.int64).reshape(-1, 5)


def test_compare_streams_counts_lost_duplicated_foreign_and_order():
    ref = [ids([0, 0, 0, 0, 0], [0, 0, 0, 1, 0]), ids([1, 0, 2, 5, 1])]
    assert compare_streams(ref, [r.copy() for r in ref]) == {"delivered": 3, "lost": 0, "duplicated": 0,
                                                              "same_order": True}
    swapped = [ref[1], ref[0]]
    assert compare_streams(ref, swapped) == {"delivered": 3, "lost": 0, "duplicated": 0, "same_order": False}
    lost_one = [ref[0]]
    assert compare_streams(ref, lost_one)["lost"] == 1
    twice = [ref[0], ref[1], ref[1]]
    assert compare_streams(ref, twice)["duplicated"] == 1
    foreign = [ref[0], ids([9, 9, 9, 9, 9])]  # one lost, one from elsewhere: both count
    assert compare_streams(ref, foreign) == {"delivered": 3, "lost": 1, "duplicated": 1, "same_order": False}
    assert compare_streams([], []) == {"delivered": 0, "lost": 0, "duplicated": 0, "same_order": True}


def test_kill_points_are_seeded_distinct_and_skip_the_first_two_steps():
    a = kill_points(20, 3, seed=11, num_loaders=3)
    assert a == kill_points(20, 3, seed=11, num_loaders=3) and len(a) == 3
    assert min(a) >= 2 and max(a) < 19 and set(a.values()) <= {0, 1, 2}
