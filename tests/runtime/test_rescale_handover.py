"""A rescale starts only the loaders whose partitions change: a loader that owns the same partitions in
the old and the new layout is handed over running (same actor, same process, its buffer kept), the
others start; the stream stays the local runtime's, and the handed-over loader outlives the old layout."""

from __future__ import annotations

import hashlib

import pytest

ray = pytest.importorskip("ray")

from fixtures import mixed_spec as make_spec  # noqa: E402
from plait.metrics import batch_digest_update  # noqa: E402
from plait.runtime.local import LocalRuntime  # noqa: E402
from plait.runtime.placement import LoaderLayout  # noqa: E402
from plait.runtime.placement import unchanged_loaders  # noqa: E402

pytestmark = pytest.mark.timeout(300)
STEPS = 9
# `short` (source 0) in 2 partitions, then 3; `mid` and `long` stay together on one loader throughout
SPLIT = LoaderLayout({0: 2, 1: 1, 2: 1}, [[(0, 0)], [(0, 1)], [(1, 0), (2, 0)]])
RESPLIT = LoaderLayout({0: 3, 1: 1, 2: 1}, [[(1, 0), (2, 0)], [(0, 0)], [(0, 1)], [(0, 2)]])


def test_unchanged_loaders_are_matched_by_their_partitions():
    assert unchanged_loaders(SPLIT, RESPLIT) == {0: 2}  # (0, 0) is in 3 partitions now: other blocks
    assert unchanged_loaders(SPLIT, SPLIT) == {0: 0, 1: 1, 2: 2}
    assert unchanged_loaders(RESPLIT, SPLIT) == {2: 0}


def drive(rt, on_step=None) -> str:
    h = hashlib.sha256()
    for step in range(STEPS):
        plan = rt.plan()
        if on_step is not None:
            on_step(step)
        for r in range(plan.ranks):
            for mb in rt.build(plan, r):
                batch_digest_update(h, mb)
        rt.release()
    return h.hexdigest()


@pytest.mark.ray
@pytest.mark.parametrize("job", [None, "handover-shared"], ids=["own-job", "shared-job"])
def test_rescale_keeps_unchanged_loaders_running(tmp_path, ray_session, job):
    """In a shared (named) job too: its loaders are detached, and a successor Planner finds a handed-over
    one by the name it runs under (the standby's `loader_names`). Before, a shared job restarted every
    loader at each rescale (data-bound `plait bench e2e`: 25-49 s without batches)."""
    from plait.runtime.ray import RayRuntime

    spec = make_spec(tmp_path, dp=2)
    local = LocalRuntime(spec)
    try:
        reference = drive(local)
    finally:
        local.close()
    rt = RayRuntime(spec, loaders=1, **({"job": job, "address": ray_session} if job else {}))
    seen: dict[int, list] = {}

    def loaders():
        handles = ray.get(rt.planner.get_loaders.remote())
        return handles, [ray.get(h.stats.remote())["pid"] for h in handles]

    def on_step(step):
        if step == 2:
            rt.rescale(SPLIT, "test: split")
            seen[2] = loaders()
        if step == 5:
            rt.rescale(RESPLIT, "test: resplit")
            seen[5] = loaders()

    try:
        digest = drive(rt, on_step)
        (before, pids_before), (after, pids_after) = seen[2], seen[5]
        # the mid+long loader is the same actor in the same process; every loader of `short` is new
        assert after[0] == before[2] and pids_after[0] == pids_before[2]
        assert not set(after[1:]) & set(before)
        assert not set(pids_after[1:]) & set(pids_before)
        stats = rt.stats()
        assert stats["retiring"] == []  # the old layout ended ...
        assert ray.get(after[0].stats.remote())["blocks_read"] > 0  # ... and the handed-over loader runs on
        for gone in before[:2]:
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(gone.stats.remote(), timeout=30)
    finally:
        rt.close()
    assert digest == reference
