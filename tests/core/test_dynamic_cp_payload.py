"""Dynamic CP payload: a group micro-batch cut for each member (plait.context_parallel.shard_for_group)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from plait.batch import MicroBatch
from plait.context_parallel import causal_work, shard_for_group, unshard_group
from plait.packing import IGNORE_INDEX, multi_token_labels, pack_fields


def group_mb(lengths, seed=0, horizon=1) -> MicroBatch:
    lengths = np.asarray(lengths, dtype=np.int64)
    ids = np.random.default_rng(seed).integers(1, 1000, int(lengths.sum())).astype(np.int32)
    n = len(lengths)
    sample_ids = np.stack([np.zeros(n), np.zeros(n), np.zeros(n), np.arange(n), np.zeros(n)], axis=1).astype(np.int64)
    fields = pack_fields(ids, lengths)
    mtp = multi_token_labels(ids, fields["cu_seqlens"], horizon) if horizon > 1 else None
    return MicroBatch(step=3, microbatch=1, num_microbatches=2, dp_rank=5, input_ids=ids, sample_ids=sample_ids,
                      source_ids=np.zeros(n, np.int32), stats={"step": 3, "global_label_tokens": 7},
                      mtp_labels=mtp, **fields)


def same(a: MicroBatch, b: MicroBatch) -> None:
    for f in ("input_ids", "labels", "position_ids", "cu_seqlens", "sample_ids", "source_ids", "mtp_labels"):
        x, y = getattr(a, f), getattr(b, f)
        if x is None or y is None:
            assert x is None and y is None, f
            continue
        assert x.dtype == y.dtype and np.array_equal(x, y), f
    assert a.stats == b.stats and (a.step, a.microbatch, a.dp_rank) == (b.step, b.microbatch, b.dp_rank)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=0, max_size=10), st.sampled_from([1, 2, 3, 4, 8]),
       st.integers(0, 2**16), st.sampled_from([1, 3]))
def test_every_token_on_exactly_one_member_and_unshard_is_exact(lengths, k, seed, horizon):
    mb = group_mb(lengths, seed, horizon)
    shards = [shard_for_group(mb, k, m, group=[10 + m for m in range(k)], group_id=4) for m in range(k)]
    same(unshard_group(shards), mb)
    real = [s.labels != IGNORE_INDEX for s in shards]
    # labels: each member holds only those of its chunks, and together exactly the micro-batch's
    assert sum(int(r.sum()) for r in real) == int((mb.labels != IGNORE_INDEX).sum())
    # every (document, position) of the micro-batch on exactly one member: padding aside, positions cover 0..L-1
    lengths = np.asarray(lengths, dtype=np.int64)
    seen = np.zeros(int(lengths.sum()), dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    for s in shards:
        local = np.diff(s.cu_seqlens)
        assert np.array_equal(local, np.diff(shards[0].cu_seqlens))  # equal local sizes on every member
        doc = np.repeat(np.arange(len(lengths)), local)
        real = s.position_ids < lengths[doc]
        np.add.at(seen, starts[doc[real]] + s.position_ids[real], 1)
        assert (s.labels[~real] == IGNORE_INDEX).all()
        info = s.stats["cp"]
        assert info["size"] == k and info["group"] == [10 + m for m in range(k)] and info["group_id"] == 4
        assert np.array_equal(info["cu_seqlens"], mb.cu_seqlens)
        padded = np.diff(info["cu_seqlens_padded"])
        if k > 1:  # degree 1: the micro-batch as built, no padding
            assert (padded % (2 * k) == 0).all() and (padded >= lengths).all() and (padded - lengths < 2 * k).all()
        else:
            assert np.array_equal(padded, lengths)
        assert int(local.sum()) * k == int(info["cu_seqlens_padded"][-1])
        assert s.stats["global_label_tokens"] == 7  # the step's, untouched
    assert (seen == 1).all()


def test_zigzag_chunks_padding_and_balance():
    mb = group_mb([10, 4096])
    shards = [shard_for_group(mb, 2, m) for m in range(2)]
    # doc 0: 10 tokens padded to 12, chunks of 3: member 0 holds 0..2 and 9..11 (10, 11 are padding)
    s0 = shards[0]
    assert s0.position_ids[:6].tolist() == [0, 1, 2, 9, 10, 11]
    assert s0.input_ids[4:6].tolist() == [0, 0] and s0.labels[3:6].tolist() == [IGNORE_INDEX] * 3
    assert s0.stats["cp"]["padding"] == 2 and shards[1].stats["cp"]["padding"] == 0
    assert s0.cu_seqlens.tolist() == [0, 6, 6 + 2048] and s0.max_seqlen == 2048
    assert s0.stats["cp"]["cu_seqlens_padded"].tolist() == [0, 12, 12 + 4096]
    work = [causal_work(s) for s in shards]
    assert max(work) / min(work) < 1.01


def test_degree_one_is_the_micro_batch_itself():
    mb = group_mb([5, 9])
    shard = shard_for_group(mb, 1, 0, group=[3], group_id=11)
    assert shard.input_ids is mb.input_ids and shard.stats["cp"]["size"] == 1
    assert shard.stats["cp"]["group"] == [3] and shard.stats["cp"]["cu_seqlens_padded"].tolist() == [0, 5, 14]
    assert "cp" not in mb.stats  # the build's own stats are not touched


def test_a_shard_is_not_cut_again():
    mb = group_mb([40, 7])
    with pytest.raises(ValueError, match="already"):
        shard_for_group(shard_for_group(mb, 2, 0), 2, 1)
    with pytest.raises(ValueError, match="outside"):
        shard_for_group(mb, 2, 2)


IMAGE_ID = 1500


def media_mb(runs, length, others=(30,)) -> MicroBatch:
    """A micro-batch whose first document (`length` tokens) holds image placeholder runs at `runs` ((start,
    length) each), then text documents."""
    import dataclasses

    mb = group_mb([length, *others], seed=5)
    ids = mb.input_ids.copy()
    for start, size in runs:
        ids[start:start + size] = IMAGE_ID
    fields = pack_fields(ids, np.diff(mb.cu_seqlens))
    fields["labels"][np.isin(fields["labels"], [IMAGE_ID])] = IGNORE_INDEX
    n = len(runs)
    return dataclasses.replace(mb, input_ids=ids, **fields, image_grid=np.ones((n, 3), np.int64),
                               pixel_values=np.zeros((n, 12), np.uint8), image_document=np.zeros(n, np.int64),
                               stats={**mb.stats, "image_token_id": IMAGE_ID, "video_token_id": -1})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 380), st.integers(1, 40)), min_size=1, max_size=4),
       st.sampled_from([2, 4]))
def test_chunk_boundaries_never_cut_a_placeholder_run(runs, k):
    length = 420
    runs = [(s, min(n, length - s)) for s, n in runs]
    mb = media_mb(runs, length)
    try:
        shards = [shard_for_group(mb, k, m) for m in range(k)]
    except ValueError as e:  # runs that leave no boundary within twice the padding: named (the next test),
        assert "leave no chunk boundary" in str(e)  # never cut; the Planner keeps media documents whole
        assume(False)
    same(unshard_group(shards), mb)
    owner = np.full(length, -1)
    for m, s in enumerate(shards):  # the member holding each token of the media document
        n = int(s.cu_seqlens[1])
        real = s.position_ids[:n] < length
        owner[s.position_ids[:n][real]] = m
    assert (owner >= 0).all()
    is_run = mb.input_ids[:length] == IMAGE_ID
    edges = np.diff(np.concatenate([[0], is_run.astype(np.int8), [0]]))
    for start, end in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)):
        # each run inside one chunk: one member, contiguous on it (a member's two chunks are far apart)
        assert len(set(owner[start:end].tolist())) == 1, (start, end, owner[start:end])
    padded = np.diff(shards[0].stats["cp"]["cu_seqlens_padded"])
    assert padded[0] % (2 * k) == 0 and length <= padded[0] <= 2 * length + 2 * k  # at most twice the padding
    assert padded[1] == -(-30 // (2 * k)) * 2 * k  # the text document keeps the least padding


def test_a_run_with_no_boundary_left_names_the_document():
    mb = media_mb([(1, 398)], 400)  # one run over almost the whole document: no boundary outside it
    with pytest.raises(ValueError, match=r"document \[0, 0, 0, 0, 0\]"):
        shard_for_group(mb, 2, 0)
    assert shard_for_group(mb, 1, 0).stats["cp"]["size"] == 1


# ----- the build path: a pool rank's waves, each group built once ---------------------------------------------

def dynamic_plan(plan):
    """A fixed-mode step of 4 DP ranks x 2 micro-batches made a dynamic-CP step by hand (until the Planner
    plans them itself): wave 0 holds a group of 2 (ranks 0-1) and two of 1, wave 1 one group of 4."""
    import dataclasses

    from plait.plan import CPGroups

    assert plan.ranks == 4 and plan.microbatches == 2
    groups = CPGroups(wave=np.array([0, 0, 0, 1], np.int32), first=np.array([0, 2, 3, 0], np.int32),
                      size=np.array([2, 1, 1, 4], np.int32))
    group_of = np.array([[0, 3], [0, 3], [1, 3], [2, 3]])  # [rank, micro] of the fixed plan -> group
    item_group = group_of[plan.rank, plan.micro]
    return dataclasses.replace(plan, cp_groups=groups, item_group=item_group,
                               rank=groups.first[item_group], micro=groups.wave[item_group])


@pytest.fixture(scope="module")
def roles_and_plans(demo_spec_path):
    import plait
    from plait.runtime.local import LocalRoles

    spec = plait.load_spec(demo_spec_path).with_overrides(
        topology={"dp": 4}, packing={"seq_len": 2048, "microbatches": 2}, steps=2)
    roles = LocalRoles(spec)
    yield roles, [dynamic_plan(roles.plan()) for _ in range(2)]
    roles.close()


def test_pool_ranks_get_shards_of_groups_built_once(roles_and_plans):
    roles, plans = roles_and_plans
    for plan in plans:
        before = roles.groups.builds
        shards = {p: roles.build(plan, p) for p in range(plan.ranks)}
        assert roles.groups.builds - before == len(plan.cp_groups)  # one build per group, 4 members or not
        assert not roles.groups.groups  # every member cut its shard: nothing kept
        delivered, labels = [], 0
        for g in range(len(plan.cp_groups)):
            wave, first, k = (int(x[g]) for x in (plan.cp_groups.wave, plan.cp_groups.first, plan.cp_groups.size))
            members = [shards[first + m][wave] for m in range(k)]
            for m, s in enumerate(members):
                assert s.stats["cp"]["size"] == k and s.stats["cp"]["rank"] == m and s.dp_rank == first + m
                assert s.stats["cp"]["group"] == list(range(first, first + k)) and s.stats["cp"]["group_id"] == g
                assert (s.microbatch, s.num_microbatches) == (wave, plan.microbatches)
                labels += int((s.labels != IGNORE_INDEX).sum())
            whole = unshard_group(members)
            items = np.flatnonzero(plan.item_group == g)
            assert np.array_equal(whole.sample_ids, plan.items.take(items).sample_ids())
            assert whole.num_tokens == int(plan.items.length[items].sum())
            delivered.append(whole.sample_ids)
        # exactly once: every placed item in one group micro-batch, and the step's label count exact
        ids = np.concatenate(delivered)
        assert len(np.unique(ids, axis=0)) == len(ids) == len(plan.items)
        assert labels == plan.stats()["global_label_tokens"] == plan.label_tokens


def test_a_failed_group_build_is_built_again():
    from plait.job.cp_builds import GroupBuilds
    from plait.plan import Items, RankPlan

    groups = GroupBuilds()
    plan = RankPlan(0, 1, 1, Items.empty(), np.zeros(0, np.int32), {},
                    cp=[{"size": 2, "rank": 1, "group": [0, 1], "group_id": 0}])

    def fail(waves):
        raise OSError("a loader went away")

    with pytest.raises(OSError):
        groups.rank_batches("step", plan, fail)
    assert not groups.groups
    out = groups.rank_batches("step", plan, lambda waves: [group_mb([6, 3])])
    assert out[0].stats["cp"]["rank"] == 1 and groups.builds == 2


# ----- to_torch(layout="megatron_thd") -----------------------------------------------------------------------

# PackedSeqParams' fields in megatron/core/packed_seq_params.py (NVIDIA/Megatron-LM), less the trainer's cp_group
MEGATRON_FIELDS = {"qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                   "max_seqlen_q", "max_seqlen_kv", "local_cp_size"}


def test_megatron_thd_layout_gives_the_group_view():
    torch = pytest.importorskip("torch")
    mb = group_mb([10, 300, 1])
    k = 4
    for member in range(k):
        shard = shard_for_group(mb, k, member)
        params = shard.to_torch(layout="megatron_thd")["packed_seq_params"]
        assert set(params) == MEGATRON_FIELDS and params["qkv_format"] == "thd" and params["local_cp_size"] == k
        assert params["cu_seqlens_q"].dtype == torch.int32
        assert params["cu_seqlens_q"].tolist() == params["cu_seqlens_kv"].tolist() == [0, 10, 310, 311]
        assert params["cu_seqlens_q_padded"].tolist() == [0, 16, 16 + 304, 16 + 304 + 8]
        assert params["max_seqlen_q"] == params["max_seqlen_kv"] == 304
        # the local tokens are the padded group view's 1/k: Transformer Engine finds each rank's chunks so
        assert shard.num_tokens * k == params["cu_seqlens_q_padded"][-1]
    whole = mb.to_torch(layout="megatron_thd")["packed_seq_params"]
    assert whole["local_cp_size"] == 1 and whole["cu_seqlens_q_padded"].tolist() == mb.cu_seqlens.tolist()
    from plait.context_parallel import shard_for_cp

    with pytest.raises(ValueError, match="dynamic"):
        shard_for_cp(mb, 2, 0).to_torch(layout="megatron_thd")


def test_group_vocabulary():
    from plait.torch_cp import vocabulary

    assert vocabulary(4) == [[0, 1], [2, 3], [0, 1, 2, 3]]  # pow2: aligned blocks, as Megatron-Core pre-builds
    assert vocabulary(8, max_degree=2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert vocabulary(3, "contiguous") == [[0, 1], [1, 2], [0, 1, 2]]
    with pytest.raises(ValueError, match="pow2 or contiguous"):
        vocabulary(4, "ring")


def test_one_process_serving_every_rank_builds_each_group_once(demo_spec_path):
    """LocalRuntime(all_ranks=True), as a node's shared job serves: trainer (dp, cp) reads pool rank cp + 2 dp,
    every group micro-batch is built once for all its members, and the step's samples are delivered once."""
    import plait
    from plait.runtime.local import LocalRuntime

    spec = plait.load_spec(demo_spec_path).with_overrides(
        topology={"dp": 2, "cp": 2}, packing={"seq_len": 512, "microbatches": 2}, steps=3,
        context_parallel={"mode": "dynamic", "max_degree": 4})
    rt = LocalRuntime(spec, all_ranks=True)
    try:
        state = rt.state_dict()
        read = {(d, c): [mb for _, mb in rt.iter_rank(d, state, 0, spec.steps, cp_rank=c)]
                for d in range(2) for c in range(2)}
    finally:
        rt.close()
    groups: dict[tuple[int, int], dict[int, MicroBatch]] = {}
    for (d, c), batches in read.items():
        assert {mb.dp_rank for mb in batches} == {c + 2 * d}
        for mb in batches:
            groups.setdefault((mb.step, mb.stats["cp"]["group_id"]), {})[mb.stats["cp"]["rank"]] = mb
    assert rt.roles.groups.builds == len(groups) and max(len(m) for m in groups.values()) > 1
    for step in range(spec.steps):
        ids = np.concatenate([unshard_group([m[i] for i in range(len(m))]).sample_ids
                              for (s, _), m in groups.items() if s == step])
        assert len(np.unique(ids, axis=0)) == len(ids) > 0


def test_image_documents_stay_on_one_rank_under_dynamic_cp(tmp_path):
    """A LLaVA source under dynamic CP (dp 2 x cp 2, slots of 128 tokens): a document with images stays on one
    rank (chunks of at most a slot, never in a group of 2 or more: a shard would cut its placeholder runs or
    make every member encode the group's images), and every planned chunk is delivered once."""
    import mm_data

    import plait
    from plait.runtime.local import LocalRuntime

    spec = plait.load_spec(mm_data.mm_spec([mm_data.llava(tmp_path, n=40)], seq_len=256, max_patches=400,
                                           topology={"dp": 2, "cp": 2}, steps=2,
                                           context_parallel={"mode": "dynamic", "max_degree": 4}))
    rt = LocalRuntime(spec)
    images = 0
    try:
        for _ in range(spec.steps):
            plan = rt.plan()
            assert plan.items.length.max() <= plan.capacity  # media chunks fit one rank's slot
            delivered = []
            for p in range(plan.ranks):
                for mb in rt.build(plan, p):
                    if mb.stats["cp"]["size"] > 1:
                        assert not mb.num_images, "an image document was sharded over a group"
                    if mb.stats["cp"]["rank"] == 0:  # a group's documents, once (every member has their ids)
                        delivered += [tuple(r) for r in mb.sample_ids.tolist()]
                        images += mb.num_images
            assert sorted(delivered) == sorted(map(tuple, plan.items.sample_ids().tolist()))
    finally:
        rt.close()
    assert images > 0
