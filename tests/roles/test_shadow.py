"""Shadow loaders, in process: following deltas, takeover after a simulated primary death."""

from __future__ import annotations

import random

import pytest

from fixtures import compare_streams, mixed_spec as make_spec
from plait.roles.constructor import Constructor, LoaderPayloads
from plait.roles.planner import Planner
from plait.roles.shadow import ShadowLoader
from plait.roles.source_loader import SourceLoader


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return make_spec(tmp_path_factory.mktemp("shadow"), dp=4)


def drive(spec, steps, on_step=None):
    loader = SourceLoader(spec)
    planner = Planner(spec, loader)
    cons = Constructor(LoaderPayloads(lambda s: loader))
    ids = []
    for step in range(steps):
        plan = planner.plan_step()
        if on_step:
            loader = on_step(step, loader) or loader
            cons = Constructor(LoaderPayloads(lambda s, ld=loader: ld))
            planner.provider = loader
        for r in range(plan.ranks):
            ids.extend(mb.sample_ids for mb in cons.build(plan.for_rank(r)))
        loader.retain(planner.live_blocks())
    return ids


def test_warm_shadow_mirrors_its_primary(spec):
    shadow = ShadowLoader(spec)

    def follow(step, loader):
        shadow.follow(loader.checkpoint_delta(step))
        assert set(shadow.buffered_keys()) == set(loader.buffered_keys())
        assert shadow.blocks_read == shadow.blocks_prefetched

    drive(spec, 8, follow)
    assert shadow.deltas_applied == 8 and shadow.standby
    assert shadow.pending_samples() > 0


@pytest.mark.parametrize("warm", [True, False])
def test_takeover_continues_the_stream_exactly(spec, warm):
    """Primary dies after step 4's plan; the shadow serves the rest: same ids, same order."""
    reference = drive(spec, 10)
    shadow = ShadowLoader(spec, warm=warm)
    info = {}

    def fail_over(step, loader):
        shadow.follow(loader.checkpoint_delta(step))
        if step == 4:
            loader.close()  # the primary is gone; nothing of it is used from here on
            info.update(shadow.promote())
            return shadow
        return None

    got = drive(spec, 10, fail_over)
    assert compare_streams(reference, got) == {"delivered": sum(map(len, got)), "lost": 0, "duplicated": 0,
                                               "same_order": True}
    assert not shadow.standby
    if warm:
        assert info["reread_blocks"] == 0  # it already held every buffered block
    else:
        assert info["reread_blocks"] == info["held_blocks"] > 0  # exactly the buffered blocks, once


def test_out_of_order_deltas_and_late_snapshot(spec):
    primary = SourceLoader(spec)
    planner = Planner(spec, primary)
    deltas = []
    for step in range(6):
        planner.plan_step()
        primary.retain(planner.live_blocks())
        deltas.append(primary.checkpoint_delta(step))
    shuffled = ShadowLoader(spec)
    order = list(range(6))
    random.Random(3).shuffle(order)
    for i in order:
        shuffled.follow(deltas[i])
    assert shuffled.view.seq == 5
    assert set(shuffled.buffered_keys()) == set(primary.buffered_keys())
    # A shadow started late syncs from a snapshot, then follows the next deltas.
    late = ShadowLoader(spec)
    late.sync(primary.checkpoint_snapshot())
    late.follow(deltas[4])  # stale: ignored
    for step in range(6, 9):
        planner.plan_step()
        primary.retain(planner.live_blocks())
        late.follow(primary.checkpoint_delta(step))
        assert set(late.buffered_keys()) == set(primary.buffered_keys())


def test_a_lost_delta_does_not_hold_memory_forever(spec):
    from plait.roles import shadow as shadow_mod

    primary = SourceLoader(spec)
    planner = Planner(spec, primary)
    follower = ShadowLoader(spec)
    for step in range(shadow_mod.MAX_EARLY_DELTAS + 4):
        planner.plan_step()
        primary.retain(planner.live_blocks())
        delta = primary.checkpoint_delta(step)
        if step != 1:  # delta 1 is lost
            follower.follow(delta)
    assert follower.resyncs == 1 and follower.early_deltas == 0
    planner.plan_step()
    primary.retain(planner.live_blocks())
    follower.follow(primary.checkpoint_delta())
    assert follower.view.seq == primary.delta_tracker.seq - 1  # following again
    follower.sync(primary.checkpoint_snapshot())  # and a snapshot makes the view whole
    assert set(primary.buffered_keys()) == set(follower.view.buffered)
