"""The dynamic-CP StepPlan contract (docs/long-context.md): groups, for_rank per pool rank, stats."""

import numpy as np

from plait.plan import CPGroups, Items, StepPlan


def _items(lengths):
    n = len(lengths)
    cols = {c: np.zeros(n, dtype=np.int64) for c in ("source", "epoch", "fpos", "bpos", "shard", "chunk", "offset", "delayed")}
    return Items(position=np.arange(n), row=np.arange(n), length=np.asarray(lengths, dtype=np.int64), **cols)


def _plan():
    # pool of 4 ranks, 2 waves: wave 0 one group of 4; wave 1 a pair (0, 1) and two single ranks
    groups = CPGroups(wave=np.array([0, 1, 1, 1], np.int32), first=np.array([0, 0, 2, 3], np.int32),
                      size=np.array([4, 2, 1, 1], np.int32), comm=np.array([2.0, 1.0, 0.0, 0.0]))
    item_group = np.array([0, 1, 2, 2, 3])
    items = _items([400, 150, 60, 40, 90])
    cost = np.array([400.0, 150.0, 60.0, 40.0, 90.0])
    rank_cost = np.array([100 + 2 + 75 + 1, 100 + 2 + 75 + 1, 100 + 2 + 100, 100 + 2 + 90])
    return StepPlan(
        step=3, ranks=4, microbatches=2, capacity=100, items=items, cost=cost,
        rank=groups.first[item_group], micro=groups.wave[item_group], rank_cost=rank_cost,
        micro_cost=np.zeros((4, 2)), micro_tokens=np.zeros((4, 2), dtype=np.int64), lower_bound=float(rank_cost.max()),
        carried=0, cp_groups=groups, item_group=item_group,
    )


def test_for_rank_gives_every_group_of_the_rank_one_per_wave():
    plan = _plan()
    r1 = plan.for_rank(1)
    assert r1.microbatches == 2
    assert r1.items.length.tolist() == [400, 150]
    assert r1.micro.tolist() == [0, 1]
    assert r1.cp == [{"size": 4, "rank": 1, "group": [0, 1, 2, 3], "group_id": 0},
                     {"size": 2, "rank": 1, "group": [0, 1], "group_id": 1}]
    r2 = plan.for_rank(2)
    assert r2.items.length.tolist() == [400, 60, 40]
    assert r2.micro.tolist() == [0, 1, 1]
    assert [c["size"] for c in r2.cp] == [4, 1] and r2.cp[1]["group"] == [2]


def test_every_pool_rank_and_wave_is_covered_once():
    plan = _plan()
    for p in range(plan.ranks):
        waves = [plan.cp_groups.wave[c["group_id"]] for c in plan.for_rank(p).cp]
        assert waves == list(range(plan.microbatches))


def test_stats_report_waves_degrees_and_comm_share():
    s = _plan().stats()
    assert s["waves"] == 2
    assert s["cp_degrees"] == {1: 3, 2: 1, 4: 1}
    assert s["comm_share"] == (2.0 * 4 + 1.0 * 2) / float(_plan().rank_cost.sum())


def test_fixed_mode_plans_have_no_cp_fields():
    plan = _plan()
    plan.cp_groups = plan.item_group = None
    assert plan.for_rank(0).cp is None
    assert "waves" not in plan.stats()


def test_dynamic_cp_counts_the_audio_placeholder_labels_the_constructor_masks():
    """An audio-only spec under dynamic CP: the step's global_label_tokens leaves out the labels masked over
    audio placeholders, as fixed CP does (the loss normaliser divides by it)."""
    import plait
    from helpers import FakeProvider, make_spec
    from plait.roles.planner import Planner
    from plait.roles.source_loader import BlockMeta

    class AudioProvider(FakeProvider):
        def block_meta(self, source, key):
            m = super().block_meta(source, key)
            audio = np.zeros((len(m.lengths), 3), np.int64)
            audio[:, 0], audio[:, 1], audio[:, 2] = 750, 750 * 750, 10  # one 10-token clip a document
            return BlockMeta(m.source, m.key, m.next_key, m.shard, m.positions, m.rows, m.lengths,
                             m.num_positions, np.zeros(len(m.lengths), np.int64), np.zeros(len(m.lengths), np.int64),
                             audio)

    for cp in ({"context_parallel": {"mode": "dynamic", "groups": "pow2"}}, {}):
        d = make_spec([{"name": "a", "path": "/nowhere", "tokens_field": "t"}], seq_len=128, microbatches=1, dp=2,
                      topology={"dp": 2, "cp": 2}, **cp)
        d["audio"] = {"audio_token_id": 300}
        planner = Planner(plait.load_spec(d), AudioProvider([(20, 60)]))
        plan = planner.plan_step()
        masked = planner.costs.masked_labels(plan.items)
        assert masked > 0
        assert plan.stats()["global_label_tokens"] == int((plan.items.length - 1).clip(min=0).sum()) - masked
