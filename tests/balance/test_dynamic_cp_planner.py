"""The Planner in `context_parallel.mode: dynamic`: plans per the contract of plait.plan, every drawn chunk
placed once, exact and elastic resume (the plan is a pure function of the data state and the layout)."""

import json

import numpy as np
import pytest
from helpers import FakeProvider, make_spec, run_all_ranks, token_parquet

import plait
from plait.roles.planner import Planner

RANGES = [(1, 60), (40, 500)]  # short documents, and long ones (up to max_degree x slot tokens whole)


def dynamic_spec(*, dp=2, cp=2, microbatches=1, groups="pow2", seq_len=128):
    sources = [{"name": f"s{i}", "path": "/nowhere", "tokens_field": "t"} for i in range(len(RANGES))]
    return plait.load_spec(make_spec(sources, seq_len=seq_len, microbatches=microbatches, dp=dp,
                                     topology={"dp": dp, "cp": cp}, context_parallel={"mode": "dynamic", "groups": groups}))


def spy_draws(planner: Planner) -> list:
    drawn, original = [], planner.draw

    def draw(source):
        items = original(source)
        drawn.append(items)
        return items

    planner.draw = draw
    return drawn


def chunk_keys(items) -> list[tuple]:
    cols = (items.source, items.epoch, items.fpos, items.bpos, items.position, items.offset, items.length)
    return [tuple(int(c[i]) for c in cols) for i in range(len(items))]


def check_contract(plan, spec) -> None:
    pool, slot = spec.topology.dp * spec.topology.cp, spec.packing.seq_len // spec.topology.cp
    g = plan.cp_groups
    assert plan.ranks == pool and plan.capacity == slot
    cover = np.zeros((pool, plan.microbatches), dtype=int)
    for w, f, k in zip(g.wave, g.first, g.size):
        cover[f:f + k, w] += 1
    assert (cover == 1).all()
    assert np.array_equal(plan.rank, g.first[plan.item_group]) and np.array_equal(plan.micro, g.wave[plan.item_group])
    k = g.size[plan.item_group]
    padded = np.where(k > 1, -(-plan.items.length // (2 * k)) * 2 * k, plan.items.length)
    assert (np.bincount(plan.item_group, weights=padded, minlength=len(g)) <= g.size * slot).all()
    for p in range(pool):
        rp = plan.for_rank(p)
        assert rp.microbatches == plan.microbatches and len(rp.cp) == plan.microbatches
        assert all(c["rank"] == p - c["group"][0] for c in rp.cp)
    s = plan.stats()
    assert s["waves"] == plan.microbatches and sum(s["cp_degrees"].values()) == len(plan.items)


@pytest.mark.parametrize("groups", ["pow2", "contiguous"])
def test_every_drawn_chunk_is_placed_once(groups):
    spec = dynamic_spec(dp=3, cp=2, groups=groups)
    planner = Planner(spec, FakeProvider(RANGES, docs_per_block=12))
    drawn = spy_draws(planner)
    placed = []
    for _ in range(12):
        plan = planner.plan_step()
        check_contract(plan, spec)
        placed += chunk_keys(plan.items)
        assert plan.stats()["max_over_lb"] >= 1.0 - 1e-9
    assert len(placed) == len(set(placed))
    every = [k for items in drawn for k in chunk_keys(items)]
    assert sorted(placed + chunk_keys(planner.carry)) == sorted(every)
    assert max(k[-1] for k in placed) > spec.packing.seq_len  # long documents stay whole beyond seq_len
    assert any(max(plan.cp_groups.size) > 1 for plan in [planner.plan_step()])


def test_exact_resume_replays_the_same_stream():
    spec = dynamic_spec(microbatches=2)
    first = Planner(spec, FakeProvider(RANGES))
    for _ in range(3):
        first.plan_step()
    state = json.loads(json.dumps(first.state_dict()))
    ahead = [first.plan_step() for _ in range(4)]
    second = Planner(spec, FakeProvider(RANGES))
    second.load_state_dict(state)
    for a in ahead:
        b = second.plan_step()
        assert np.array_equal(a.items.sample_ids(), b.items.sample_ids())
        assert np.array_equal(a.item_group, b.item_group) and np.array_equal(a.cp_groups.size, b.cp_groups.size)


def test_elastic_resume_on_another_dp_places_every_chunk_once():
    first = Planner(dynamic_spec(dp=2), FakeProvider(RANGES))
    drawn = spy_draws(first)
    placed = [k for _ in range(4) for k in chunk_keys(first.plan_step().items)]
    state = json.loads(json.dumps(first.state_dict()))
    wider = dynamic_spec(dp=4)
    second = Planner(wider, FakeProvider(RANGES))
    second.load_state_dict(state)
    drawn_after = spy_draws(second)
    for _ in range(4):
        plan = second.plan_step()
        check_contract(plan, wider)
        placed += chunk_keys(plan.items)
    assert len(placed) == len(set(placed))
    every = [k for items in drawn + drawn_after for k in chunk_keys(items)]
    assert sorted(placed + chunk_keys(second.carry)) == sorted(every)


def test_local_runtime_serves_every_token_once_with_exact_label_counts(tmp_path):
    """Planner + builds: the members' shards of every group hold each document's tokens once, and the
    label tokens over all pool ranks are the step's global_label_tokens."""
    ds = token_parquet(tmp_path / "a", files=2, docs_per_file=40, lo=1, hi=300)
    spec = plait.load_spec(make_spec([ds], seq_len=64, microbatches=1, dp=2, topology={"dp": 2, "cp": 2},
                                     context_parallel={"mode": "dynamic"}))
    batches, rt, _ = run_all_ranks(spec, 3)
    rt.close()
    steps: dict[int, list] = {}
    for mb in batches:
        steps.setdefault(mb.stats["step"], []).append(mb)
    sharded = 0
    for step, mbs in steps.items():
        assert len(mbs) == 4 * mbs[0].stats["waves"]  # every pool rank one micro-batch per wave
        assert sum(int((mb.labels != -100).sum()) for mb in mbs) == mbs[0].stats["global_label_tokens"] > 0
        assert all(len(mb.input_ids) <= 32 for mb in mbs)  # a rank's slot: seq_len / cp
        sharded += sum(mb.stats["cp"]["size"] > 1 for mb in mbs)
    assert sharded > 0


def test_plait_plan_shows_the_degrees_chosen_per_step(tmp_path, capsys):
    import yaml

    from plait.cli import main

    short = token_parquet(tmp_path / "short", name="short", files=2, docs_per_file=60, lo=1, hi=40)
    long = token_parquet(tmp_path / "long", name="long", files=2, docs_per_file=10, lo=100, hi=500, seed=1)
    spec = make_spec([short, long], seq_len=128, microbatches=1, dp=2, topology={"dp": 2, "cp": 2},
                     context_parallel={"mode": "dynamic"})
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--steps", "3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "dynamic CP over dp x cp = 4 ranks" in text and "degrees (k: documents)" in text
    rows = json.loads(out.read_text())["steps"]
    assert all(r["waves"] >= 1 and sum(r["cp_degrees"].values()) == r["docs"] for r in rows)
    assert any(int(k) > 1 for r in rows for k in r["cp_degrees"])


def test_loader_resume_mid_step_gives_the_same_stream(tmp_path):
    """A trainer (dp, cp) in dynamic mode checkpoints after some micro-batches (waves) and resumes: the
    micro-batches that follow are the ones it would have read (sample ids and tokens)."""
    ds = token_parquet(tmp_path / "a", files=2, docs_per_file=40, lo=1, hi=300)
    spec = plait.load_spec(make_spec([ds], seq_len=64, microbatches=1, dp=2, topology={"dp": 2, "cp": 2},
                                     context_parallel={"mode": "dynamic"}, steps=4))
    whole = list(plait.Loader(spec, dp_rank=1, cp_rank=1, read_ahead=0))
    with plait.Loader(spec, dp_rank=1, cp_rank=1, read_ahead=0) as first:
        it = iter(first)
        head = [next(it) for _ in range(3)]
        state = json.loads(json.dumps(first.state_dict()))
    with plait.Loader(spec, dp_rank=1, cp_rank=1, read_ahead=0) as second:
        second.load_state_dict(state)
        tail = list(second)
    assert len(whole) == len(head) + len(tail) > 3
    for a, b in zip(whole, head + tail):
        assert np.array_equal(a.sample_ids, b.sample_ids) and np.array_equal(a.input_ids, b.input_ids)
