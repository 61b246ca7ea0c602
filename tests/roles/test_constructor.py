"""The Constructor's own contract: one rank's share of a step plan in, packed micro-batches out.

Each micro-batch is its items' tokens concatenated in plan order, with cu_seqlens at the item
boundaries, positions restarting per item and labels that never cross one; payloads are fetched once,
only for the micro-batches asked for. LoaderPayloads routes each block's spans to the loader owning it.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    docs_in_batch,
    expected_tokens,
    make_spec,
    text_source,
    token_parquet,
)

import plait
from plait.packing import IGNORE_INDEX
from plait.plan import ITEM_INT_COLUMNS, Items, RankPlan
from plait.roles.constructor import Constructor, LoaderPayloads
from plait.roles.planner import Planner
from plait.roles.source_loader import SourceLoader


def doc_tokens(source: int, row: int, offset: int, length: int) -> np.ndarray:
    """The known payload of a document span: distinct per (source, row) and per token."""
    return (source * 1_000_000 + row * 1000 + np.arange(offset, offset + length)).astype(np.int32)


class KnownPayloads:
    """A PayloadSource that makes up tokens from the items' ids and records every fetch."""

    def __init__(self):
        self.fetched: list[np.ndarray] = []

    def fetch(self, items: Items) -> np.ndarray:
        self.fetched.append(items.sample_ids())
        parts = [doc_tokens(*(int(x) for x in (items.source[i], items.row[i], items.offset[i], items.length[i])))
                 for i in range(len(items))]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def make_items(rows) -> Items:
    """Items from (source, row, chunk, length) tuples; offset = chunk * 100."""
    cols = {c: np.zeros(len(rows), dtype=np.int64) for c in ITEM_INT_COLUMNS}
    for i, (source, row, chunk, length) in enumerate(rows):
        cols["source"][i], cols["row"][i], cols["chunk"][i], cols["length"][i] = source, row, chunk, length
        cols["offset"][i], cols["shard"][i], cols["position"][i] = chunk * 100, 3 + source, row
    return Items(**cols)


ROWS = [(0, 5, 0, 7), (1, 2, 0, 1), (0, 9, 1, 30), (1, 4, 0, 12), (0, 5, 1, 3), (0, 11, 0, 20), (1, 8, 0, 2)]
MICRO = np.array([2, 0, 1, 0, 2, 2, 1])
STATS = {"step": 4, "tokens": 75, "capacity": 64}


def rank_plan(rows=ROWS, micro=MICRO, microbatches: int = 3) -> RankPlan:
    return RankPlan(step=4, dp_rank=1, microbatches=microbatches, items=make_items(rows), micro=np.asarray(micro),
                    stats=dict(STATS))


def expected_fields(rows) -> dict[str, np.ndarray]:
    """The packed fields of items `rows`, computed directly from the definition."""
    docs = [doc_tokens(s, r, c * 100, n) for s, r, c, n in rows]
    labels = [np.append(d[1:], IGNORE_INDEX) for d in docs]
    return {
        "input_ids": np.concatenate(docs) if docs else np.zeros(0, np.int32),
        "labels": np.concatenate(labels) if docs else np.zeros(0, np.int32),
        "position_ids": np.concatenate([np.arange(len(d)) for d in docs]) if docs else np.zeros(0, np.int32),
        "cu_seqlens": np.concatenate([[0], np.cumsum([len(d) for d in docs])]),
        "sample_ids": np.array([[s, 0, 3 + s, r, c] for s, r, c, _ in rows], dtype=np.int64).reshape(-1, 5),
        "source_ids": np.array([s for s, *_ in rows]),
    }


FIELDS = ("input_ids", "labels", "position_ids", "cu_seqlens", "sample_ids", "source_ids")


def assert_microbatch(mb, rows) -> None:
    want = expected_fields(rows)
    for f in FIELDS:
        np.testing.assert_array_equal(getattr(mb, f), want[f], err_msg=f"micro-batch {mb.microbatch}: {f}")


def test_each_microbatch_is_its_items_packed_in_plan_order():
    payloads = KnownPayloads()
    batches = Constructor(payloads).build(rank_plan())
    assert [mb.microbatch for mb in batches] == [0, 1, 2]
    for mb in batches:
        assert (mb.step, mb.dp_rank, mb.num_microbatches) == (4, 1, 3)
        assert mb.stats == {**STATS, "dropped_samples": 0, "dropped_label_tokens": 0}  # nothing dropped here
        assert_microbatch(mb, [r for r, m in zip(ROWS, MICRO) if m == mb.microbatch])
        assert mb.input_ids.dtype == np.int32 and mb.labels.dtype == np.int32
        assert mb.cu_seqlens.dtype == np.int32 and mb.position_ids.dtype == np.int32
        # No label crosses an item boundary: each item's last label is ignored, all others are the next token.
        ends = mb.cu_seqlens[1:] - 1
        assert np.all(mb.labels[ends] == IGNORE_INDEX)
        assert int((mb.labels == IGNORE_INDEX).sum()) == len(ends)
    assert sum(mb.num_tokens for mb in batches) == sum(r[3] for r in ROWS)


def test_payloads_are_fetched_once_for_exactly_the_planned_items():
    payloads = KnownPayloads()
    Constructor(payloads).build(rank_plan())
    assert len(payloads.fetched) == 1, "one fetch per build: payloads move once"
    want = make_items(ROWS).sample_ids()
    assert sorted(map(tuple, payloads.fetched[0].tolist())) == sorted(map(tuple, want.tolist()))


def test_only_builds_just_those_microbatches_identically():
    full = Constructor(KnownPayloads()).build(rank_plan())
    payloads = KnownPayloads()
    part = Constructor(payloads).build(rank_plan(), only={2, 0})
    assert [mb.microbatch for mb in part] == [0, 2]
    for mb in part:
        ref = full[mb.microbatch]
        for f in FIELDS:
            np.testing.assert_array_equal(getattr(mb, f), getattr(ref, f), err_msg=f)
        assert mb.num_microbatches == 3
    # Only the wanted micro-batches' payloads were fetched.
    fetched = sorted(map(tuple, payloads.fetched[0].tolist()))
    want = make_items([r for r, m in zip(ROWS, MICRO) if m in (0, 2)]).sample_ids()
    assert fetched == sorted(map(tuple, want.tolist()))
    none = KnownPayloads()
    assert Constructor(none).build(rank_plan(), only=set()) == [] and none.fetched == []
    assert Constructor(none).build(rank_plan(), only={7}) == [] and none.fetched == []


def test_empty_rank_plan_builds_empty_microbatches():
    batches = Constructor(KnownPayloads()).build(rank_plan([], np.zeros(0, dtype=np.int64), microbatches=2))
    assert [mb.microbatch for mb in batches] == [0, 1]
    for mb in batches:
        assert mb.num_tokens == 0 and mb.max_seqlen == 0
        np.testing.assert_array_equal(mb.cu_seqlens, [0])
        assert mb.sample_ids.shape == (0, 5) and len(mb.labels) == 0 and len(mb.position_ids) == 0
    # A rank whose items all sit in its last micro-batch still gets the empty ones before it, in order.
    rows = ROWS[:3]
    batches = Constructor(KnownPayloads()).build(rank_plan(rows, [2, 2, 2]))
    assert [mb.num_tokens for mb in batches] == [0, 0, sum(r[3] for r in rows)]
    assert_microbatch(batches[2], rows)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    root = tmp_path_factory.mktemp("constructor")
    a = token_parquet(root / "a", name="a", files=2, docs_per_file=20, row_group_size=5, lo=5, hi=180, eos=3)
    b = text_source(root / "b", fmt="parquet", name="b", files=2, docs_per_file=20, row_group_size=5, hi=30)
    spec = plait.load_spec(make_spec([a, b], seq_len=64, microbatches=2, dp=2))
    return spec, [expected_tokens(a), expected_tokens(b)]


def test_loader_payloads_route_blocks_to_their_loaders(real):
    """One loader per source or one for all: the same micro-batches, and each chunk is the right slice
    of its document as written."""
    spec, expected = real
    shared = SourceLoader(spec)
    own = {s: SourceLoader(spec, source_indices=[s]) for s in (0, 1)}
    planner = Planner(spec, shared)
    one = Constructor(LoaderPayloads(lambda s: shared))
    split = Constructor(LoaderPayloads(lambda s: own[s]))
    S = spec.packing.seq_len
    docs = 0
    for _ in range(4):
        plan = planner.plan_step()
        for r in range(plan.ranks):
            a, b = one.build(plan.for_rank(r)), split.build(plan.for_rank(r))
            assert len(a) == len(b) == 2
            for x, y in zip(a, b):
                for f in FIELDS:
                    np.testing.assert_array_equal(getattr(x, f), getattr(y, f), err_msg=f)
                for (source, epoch, shard, row, chunk), toks in docs_in_batch(x):
                    np.testing.assert_array_equal(toks, expected[source][(shard, row)][chunk * S:(chunk + 1) * S])
                    docs += 1
        shared.retain(planner.live_blocks())
    assert docs >= 16
    # Each per-source loader decoded only its own source's blocks.
    assert {k[0] for k in own[0].buffered_keys()} <= {0} and {k[0] for k in own[1].buffered_keys()} <= {1}
    assert own[0].blocks_read > 0 and own[1].blocks_read > 0
    for loader in (shared, *own.values()):
        loader.close()

