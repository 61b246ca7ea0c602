"""Run-time mixing: schedule kinds, set_weights, the online policy, resume under a changed spec.

Planner-level tests use FakeProvider (metadata only, fast); Loader-level ones small parquet sources.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

import plait
from plait.errors import PlaitError
from plait.mixture import exp_gradient, share_windows
from plait.roles.planner import Planner
from plait.state.spec_change import SpecChangeWarning
from helpers import FakeProvider, batch_digest, make_spec, token_parquet

RANGES = [(1, 60), (20, 200), (5, 120)]


def spec_of(n=3, weights=None, mixture=None, windows=None, seq_len=256, microbatches=4, paths=None):
    sources = []
    for i in range(n):
        s = {"name": f"s{i}", "path": (paths or {}).get(i, "/unused"), "tokens_field": "t",
             "weight": (weights or [1] * n)[i]}
        s.update((windows or {}).get(i, {}))
        sources.append(s)
    extra = {"mixture": mixture} if mixture else {}
    return plait.load_spec(make_spec(sources, seq_len=seq_len, microbatches=microbatches, **extra))


def run(planner: Planner, steps: int, hook=None) -> tuple[np.ndarray, np.ndarray, list]:
    """Plan `steps` steps; (drawn tokens [T, n], weights [T, n], per step: sample ids of the placed items)."""
    drawn, weights, ids = [], [], []
    for _ in range(steps):
        if hook is not None:
            hook(planner)
        plan = planner.plan_step()
        drawn.append(plan.drawn)
        weights.append(plan.weights)
        it = plan.items
        ids.append(sorted(zip(it.source.tolist(), it.epoch.tolist(), it.bpos.tolist(), it.position.tolist(),
                              it.chunk.tolist())))
    return np.array(drawn), np.array(weights), ids


def worst(drawn, weights) -> float:
    return max(w["worst_error"] for w in share_windows(drawn, weights, 100))


SCHEDULES = {
    "constant": dict(weights=[0.2, 0.5, 0.3]),
    "step": dict(mixture={"interpolation": "step", "schedule": [
        {"step": 0, "weights": {"s0": 1, "s1": 1}}, {"step": 100, "weights": {"s1": 1, "s2": 3}}]}),
    "linear": dict(mixture={"interpolation": "linear", "schedule": [
        {"step": 0, "weights": {"s0": 0.8, "s1": 0.1, "s2": 0.1}}, {"step": 300, "weights": {"s0": 0.1, "s2": 0.9}}]}),
    "cosine": dict(mixture={"interpolation": "cosine", "schedule": [
        {"step": 0, "weights": {"s0": 0.7, "s1": 0.3}}, {"step": 200, "weights": {"s1": 0.2, "s2": 0.8}}]}),
    "tokens": dict(mixture={"schedule_by": "tokens", "interpolation": "linear", "schedule": [
        {"tokens": 0, "weights": {"s0": 1}}, {"tokens": 150_000, "weights": {"s1": 1, "s2": 1}}]}),
    "windows": dict(windows={1: {"start_step": 50, "stop_step": 220}, 2: {"stop_step": 120}}),
}


@pytest.mark.parametrize("kind", sorted(SCHEDULES))
def test_each_schedule_kind_is_within_one_percent_per_window(kind):
    planner = Planner(spec_of(**SCHEDULES[kind]), FakeProvider(RANGES))
    drawn, weights, _ = run(planner, 300)
    assert worst(drawn, weights) <= 0.01
    if kind == "windows":  # outside its window a source gets nothing
        assert drawn[:50, 1].sum() == 0 and drawn[221:, 1].sum() == 0 and drawn[121:, 2].sum() == 0
    if kind == "cosine":
        w = planner.mixture.weights(100)
        assert np.allclose(w, [0.35, 0.25, 0.4])  # halfway: (1 - cos(pi/2)) / 2 = 0.5


def test_set_weights_changes_shares_and_survives_resume():
    spec = spec_of(weights=[1, 1, 1])
    ref = Planner(spec, FakeProvider(RANGES))

    def hook(p):
        if p.step == 20:
            p.set_weights({"s0": 0.6}, at_step=50)
        if p.step == 150:
            p.set_weights({"s0": 0.1, "s1": 0.1, "s2": 0.8}, at_step=150)

    drawn, weights, ids = run(ref, 300, hook)
    assert np.allclose(weights[60], [0.6, 0.2, 0.2]) and np.allclose(weights[200], [0.1, 0.1, 0.8])
    assert worst(drawn, weights) <= 0.01
    # interrupted after step 30 (the change for step 50 is in the state) and after 170
    for cut in (30, 170):
        a = Planner(spec, FakeProvider(RANGES))
        _, _, head = run(a, cut, hook)
        state = json.loads(json.dumps(a.state_dict()))
        assert state["overrides"][0]["at_step"] == 50
        b = Planner(spec, FakeProvider(RANGES))
        b.load_state_dict(state)
        _, w_tail, tail = run(b, 300 - cut, hook)
        assert head + tail == ids
        np.testing.assert_array_equal(w_tail, weights[cut:])
    with pytest.raises(PlaitError, match="already planned"):
        ref.set_weights({"s0": 1}, at_step=10)
    with pytest.raises(PlaitError, match="unknown source"):
        ref.set_weights({"nope": 1}, at_step=1000)


def losses_at(step: int) -> dict[str, float]:
    return {"s0": 2.0 + 0.001 * step, "s1": 3.0 - 0.002 * step, "s2": 2.5}


ONLINE = {"online": {"every": 20, "lr": 1.0, "floor": 0.1, "delay": 3, "reference": {"s2": 0.5}}}


def test_online_policy_updates_weights_and_is_exact_on_resume():
    spec = spec_of(mixture=ONLINE)

    def hook(p):  # a trainer reports step s once it has trained it: here, two steps behind planning
        if p.step >= 2:
            p.report(p.step - 2, losses_at(p.step - 2))

    ref = Planner(spec, FakeProvider(RANGES))
    drawn, weights, ids = run(ref, 200, hook)
    online = [o for o in ref.state_dict()["overrides"] if o["by"] == "online"]
    assert [o["at_step"] for o in online][:3] == [22, 42, 62]
    assert weights[30][1] > weights[10][1]  # s1 has the highest loss at first: it gains weight
    assert min(weights.min(axis=0)) >= 0.1 / 3 - 1e-12  # the floor
    assert worst(drawn, weights) <= 0.01
    for cut in (21, 22, 57):
        a = Planner(spec, FakeProvider(RANGES))
        _, _, head = run(a, cut, hook)
        b = Planner(spec, FakeProvider(RANGES))
        b.load_state_dict(json.loads(json.dumps(a.state_dict())))
        _, w_tail, tail = run(b, 200 - cut, hook)
        assert head + tail == ids
        np.testing.assert_array_equal(w_tail, weights[cut:])
    with pytest.raises(PlaitError, match="too late"):
        ref.report(100, losses_at(100))


def test_exp_gradient_step():
    w = exp_gradient(np.array([0.5, 0.5]), np.array([1.0, 0.0]), lr=np.log(3), floor=0.0)
    assert np.allclose(w, [0.75, 0.25])
    w = exp_gradient(np.array([0.5, 0.5]), np.array([50.0, np.nan]), lr=10, floor=0.2)
    assert np.isclose(w.sum(), 1) and np.isclose(w.min(), 0.1)


def draws_of(ids: list, source: int) -> list:
    return [x[1:] for step in ids for x in step if x[0] == source]


def test_resume_with_added_and_removed_source_keeps_unchanged_sources_exact():
    two = spec_of(n=2, weights=[1, 1])
    three = spec_of(n=3, weights=[1, 1, 2])
    ref = Planner(two, FakeProvider(RANGES))
    _, _, ids = run(ref, 120)
    a = Planner(two, FakeProvider(RANGES))
    _, _, head = run(a, 40)
    state = json.loads(json.dumps(a.state_dict()))
    with pytest.raises(PlaitError, match="different spec"):
        Planner(three, FakeProvider(RANGES)).load_state_dict(state)
    b = Planner(three, FakeProvider(RANGES))
    changes = b.load_state_dict(state, allow_spec_change=True)
    assert any("'s2' added" in c for c in changes) and any("mixture changed" in c for c in changes)
    _, _, tail = run(b, 80)
    for s in (0, 1):  # each unchanged source continues its own order exactly: no sample lost or repeated
        got, want = sorted(draws_of(head + tail, s)), sorted(draws_of(ids, s))
        assert len(set(got)) == len(got)
        k = min(len(got), len(want)) - 40  # the last few may still wait in a carry
        assert got[:k] == want[:k]  # in the source's order: nothing skipped
    assert draws_of(tail, 2)[0][:3] == (0, 0, 0)  # the new source from its beginning
    # remove s2 again: it is parked, and continues where it stopped when it comes back
    state3 = json.loads(json.dumps(b.state_dict()))
    c = Planner(two, FakeProvider(RANGES))
    assert any("'s2' removed" in x for x in c.load_state_dict(state3, allow_spec_change=True))
    _, _, mid = run(c, 10)
    assert "s2" in c.state_dict()["parked"]
    d = Planner(three, FakeProvider(RANGES))
    assert any("comes back" in x for x in d.load_state_dict(c.state_dict(), allow_spec_change=True))
    _, _, back = run(d, 30)
    s2 = draws_of(tail + back, 2)
    assert len(set(s2)) == len(s2)


def test_a_changed_source_is_refused_even_with_allow_spec_change():
    a = Planner(spec_of(n=2), FakeProvider(RANGES))
    run(a, 5)
    moved = spec_of(n=2, paths={1: "/elsewhere"})
    with pytest.raises(PlaitError, match="'s1' changed"):
        Planner(moved, FakeProvider(RANGES)).load_state_dict(a.state_dict(), allow_spec_change=True)


def test_states_from_before_run_time_mixing_still_load():
    spec = spec_of(n=2)
    a = Planner(spec, FakeProvider(RANGES))
    run(a, 5)
    old = a.state_dict()
    old["fingerprint"] = spec.legacy_fingerprint()
    for s in old["sources"].values():
        del s["fingerprint"]
    b = Planner(spec, FakeProvider(RANGES))
    b.load_state_dict(old)
    assert b.step == 5


# ----- through the Loader: calls from the trainer's thread, prefetch, state_dict ------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    a = token_parquet(root / "a", name="a", files=2, docs_per_file=40, row_group_size=10, seed=1)
    b = token_parquet(root / "b", name="b", files=2, docs_per_file=40, row_group_size=10, seed=2)
    c = token_parquet(root / "c", name="c", files=1, docs_per_file=40, row_group_size=10, seed=3)
    return a, b, c


def train(loader, steps, calls, stop_after=None):
    """Iterate like a trainer: after each step's last micro-batch, make the run-time calls for that step."""
    out = []
    for mb in loader:
        out.append(mb)
        if mb.microbatch + 1 == mb.num_microbatches:
            calls(loader, mb.step)
            if stop_after is not None and mb.step + 1 == stop_after:
                break
        if mb.step + 1 >= steps and mb.microbatch + 1 == mb.num_microbatches:
            break
    return out


def loader_calls(loader, step):
    if step == 3:
        loader.set_weights({"a": 0.7}, at_step=step + 5)
    loader.report(step, {"a": 1.0 + step * 0.01, "b": 2.0})


def test_loader_set_weights_and_report_resume_with_the_same_digest(data):
    spec = make_spec(list(data[:2]), seq_len=64, microbatches=2,
                     mixture={"online": {"every": 4, "lr": 0.5, "floor": 0.1, "delay": 5}})
    steps = 20
    with plait.Loader(spec, steps=steps) as loader:
        reference = train(loader, steps, loader_calls)
    for cut in (6, 9):
        with plait.Loader(spec, steps=steps) as loader:
            head = train(loader, steps, loader_calls, stop_after=cut)
            state = json.loads(json.dumps(loader.state_dict()))
        with plait.Loader(spec, steps=steps) as loader:
            loader.load_state_dict(state)
            tail = train(loader, steps, loader_calls)
        assert batch_digest(head + tail) == batch_digest(reference)
    with plait.Loader(spec, steps=steps) as loader, pytest.raises(PlaitError, match="already planned"):
        train(loader, steps, lambda ld, s: ld.set_weights({"a": 1}, at_step=s))


def test_loader_resume_with_an_added_source_from_a_step_boundary(data):
    a, b, c = data
    steps = 12
    with plait.Loader(make_spec([a, b], seq_len=64), steps=steps) as loader:
        head = train(loader, steps, lambda *_: None, stop_after=5)
        state = loader.state_dict()
    bigger = make_spec([a, b, c.with_options(weight=2.0)], seq_len=64)
    with plait.Loader(bigger, steps=steps) as loader:
        with pytest.raises(PlaitError, match="different spec"):
            loader.load_state_dict(state)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader.load_state_dict(state, allow_spec_change=True)
        assert any(issubclass(w.category, SpecChangeWarning) for w in caught)
        assert any("'c' added" in x for x in loader.resume_report)
        tail = list(loader)
    assert tail[0].step == 5
    ids = [tuple(x) for mb in head + tail for x in mb.sample_ids.tolist()]
    assert len(ids) == len(set(ids))  # nothing delivered twice across the change
    assert any(mb.source_ids.tolist().count(2) for mb in tail)


def test_cli_run_resumes_under_a_changed_mixture_and_reports_shares(data, tmp_path):
    from plait.cli import main
    from helpers import write_spec

    a, b, _ = data
    first = write_spec(tmp_path / "a.yaml", make_spec([a, b], seq_len=64))
    second = write_spec(tmp_path / "b.yaml", make_spec([a, b.with_options(weight=3.0)], seq_len=64))
    state = str(tmp_path / "state.json")
    assert main([ "run", first, "--steps", "5", "--quiet", "--save-state", state]) == 0
    assert main(["run", second, "--steps", "5", "--quiet", "--resume", state]) == 2  # refused without the flag
    report = tmp_path / "report.json"
    assert main(["run", second, "--steps", "5", "--quiet", "--resume", state, "--allow-spec-change",
                 "--report", str(report)]) == 0
    got = json.loads(report.read_text())
    assert got["spec_changes"] and got["windows"][0]["start"] == 5 and (tmp_path / "report.png").exists()
