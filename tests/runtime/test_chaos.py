"""Chaos: kill actors of a Ray-runtime run; the delivered stream of sample ids must not change.

SourceLoaders are killed (`ray.kill(actor, no_restart=True)`) at seeded random steps, several times;
with shadows a standby takes over, without them a fresh loader restarts cold. Either way the stream of
sample ids equals that of a run without failures: none lost, none duplicated, same order. The run without
shadows kills the Constructor too; another test kills the Planner. One local Ray instance serves the whole module.
"""

from __future__ import annotations

import logging

import pytest

ray = pytest.importorskip("ray")

from fixtures import compare_streams, kill_points, mixed_spec as make_spec  # noqa: E402
from plait.runtime.local import LocalRuntime  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]
STEPS = 14
LOADERS = 3


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tmp_path_factory.mktemp("chaos")


@pytest.fixture(scope="module")
def reference(data):
    spec = make_spec(data, dp=4)
    rt = LocalRuntime(spec)
    ids = []
    for _ in range(STEPS):
        plan = rt.plan()
        for r in range(plan.ranks):
            ids.extend(mb.sample_ids for mb in rt.build(plan, r))
        rt.release()
    rt.close()
    return ids


def run_with_kills(spec, kills: dict[int, int], kill_constructor_at: int | None = None,
                   kill_planner_at: int | None = None):
    from plait.runtime.ray import RayRuntime

    # A Constructor actor of its own where one is killed; else the default (on one node the Planner builds)
    rt = RayRuntime(spec, loaders=LOADERS, constructors="auto" if kill_constructor_at is None else "node")
    assert rt.constructors_mode == ("planner" if kill_constructor_at is None else "node")
    ids = []
    try:
        for step in range(STEPS):
            plan = rt.plan()
            if step in kills:
                loaders = ray.get(rt.planner.get_loaders.remote())
                ray.kill(loaders[kills[step]], no_restart=True)
            if step == kill_constructor_at:
                for handle in rt.builders().values():
                    ray.kill(handle, no_restart=True)
            if step == kill_planner_at:
                ray.kill(rt.planner, no_restart=True)
            for r in range(plan.ranks):
                ids.extend(mb.sample_ids for mb in rt.build(plan, r))
        events = rt.recovery_events()
    finally:
        rt.close()
    return ids, events


@pytest.mark.parametrize("shadows,constructor_at", [(1, None), (0, 5)], ids=["shadows", "cold+constructor"])
def test_killing_source_loaders_changes_nothing(ray_session, data, reference, shadows, constructor_at, caplog):
    """Loaders killed 3 times: shadows take over, or (no shadows) fresh loaders restart cold; in that run the
    Constructor is killed too (a Constructor's death beside shadows is the training client's test below)."""
    caplog.set_level(logging.WARNING, logger="plait.recovery")
    spec = make_spec(data, dp=4, shadows=shadows)
    kills = kill_points(STEPS, 3, seed=11, num_loaders=LOADERS)
    ids, events = run_with_kills(spec, kills, kill_constructor_at=constructor_at)
    assert compare_streams(reference, ids) == {"delivered": sum(map(len, reference)), "lost": 0, "duplicated": 0,
                                               "same_order": True}
    loaders = [e for e in events if e["role"] == "loader"]
    assert len(loaders) == len(kills)  # every death detected, each handled once
    expected = "shadow promoted" if shadows else "restarted cold"
    assert all(e["how"].startswith(expected) for e in loaders), loaders
    assert all(e["recovery_s"] < 30 for e in loaders)
    others = [e["role"] for e in events if e["role"] in ("constructor", "planner")]
    assert others == ([] if constructor_at is None else ["constructor"])
    if constructor_at is not None:
        messages = [r.getMessage() for r in caplog.records]
        assert any(m.startswith("failure: Constructor") for m in messages)
        assert any(m.startswith("recovery: Constructor") for m in messages)


def test_killing_the_planner_changes_nothing(ray_session, data, reference, caplog):
    """The Planner (and the loaders it owns) die; it is rebuilt from the last data state and re-plans."""
    caplog.set_level(logging.WARNING, logger="plait.recovery")
    ids, events = run_with_kills(make_spec(data, dp=4), {}, kill_planner_at=6)
    assert compare_streams(reference, ids)["same_order"]
    planner = [e for e in events if e["role"] == "planner"]
    # Rebuilt from the last data state this driver saw: step 6's (its plan came before the kill) or a later
    # one when the plans and builds asked ahead (ray.kill is asynchronous) still answered; never past the
    # step where the death was found, never from an earlier state.
    assert len(planner) == 1 and 6 <= planner[0]["from_step"] <= planner[0]["step"]
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("failure: Planner") for m in messages)
    assert any(m.startswith("recovery: Planner") for m in messages)


def test_a_training_client_survives_loader_and_constructor_deaths(ray_session, data):
    """The trainer-side path (Loader → iter_rank): kills under a running iterator change nothing."""
    import plait

    spec = make_spec(data, dp=2, shadows=1)
    expected = [mb.sample_ids for mb in plait.Loader(spec, dp_rank=1, steps=8, read_ahead=0)]
    loader = plait.Loader(spec, dp_rank=1, steps=8, read_ahead=0, runtime="ray", loaders=LOADERS,
                          constructors="node")
    got = []
    try:
        for i, mb in enumerate(loader):
            got.append(mb.sample_ids)
            rt = loader.runtime
            if i == 3:
                ray.kill(ray.get(rt.planner.get_loaders.remote())[1], no_restart=True)
            if i == 7:
                for handle in rt.builders().values():
                    ray.kill(handle, no_restart=True)
        roles = sorted(e["role"] for e in loader.runtime.recovery_events())
    finally:
        loader.close()
    assert compare_streams(expected, got)["same_order"]
    assert "constructor" in roles and "loader" in roles


def test_a_dead_shadow_is_noticed_and_replaced(ray_session, data, reference):
    """A standby that dies is found from its failed follow calls and replaced; it is not silently lost."""
    from plait.runtime.ray import RayRuntime

    rt = RayRuntime(make_spec(data, dp=4, shadows=1), loaders=LOADERS, respawn_delay=2)
    ids = []
    try:
        for step in range(STEPS):
            plan = rt.plan()
            if step == 2:
                ray.kill(ray.get(rt.planner.get_shadows.remote())[0][0], no_restart=True)
            if step == 11:  # its primary dies later: the replacement shadow takes over
                ray.kill(ray.get(rt.planner.get_loaders.remote())[0], no_restart=True)
            for r in range(plan.ranks):
                ids.extend(mb.sample_ids for mb in rt.build(plan, r))
        events = rt.recovery_events()
        threads = [c["build_threads"] for c in rt.stats()["constructors"].values()]
    finally:
        rt.close()
    assert threads == [4]  # the node's Constructor builds its 4 DP ranks at once
    assert compare_streams(reference, ids)["same_order"]
    roles = [e["role"] for e in events]
    assert roles[:2] == ["shadow", "shadow-start"], roles
    loader = [e for e in events if e["role"] == "loader"]
    assert len(loader) == 1 and loader[0]["how"].startswith("shadow promoted")
