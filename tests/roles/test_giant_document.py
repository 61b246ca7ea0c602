"""A document far longer than seq_len: the mixture holds its shares at chunk granularity.

A long document's chunks are drawn over as many steps as its source's deficit allows (the offset inside
the document is part of the source's cursor), so a 2M-token document in a source of weight 0.1 takes
about a tenth of every step instead of filling every batch and the carry until it is consumed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import plait
from plait.roles.planner import Planner
from plait.roles.source_loader import BlockMeta
from plait.runtime.local import LocalRuntime
from helpers import Dataset, expected_tokens, make_spec, token_parquet, write_token_parquet


def nbytes(state: dict) -> int:
    """Size of a data state as compact JSON (what a checkpoint stores)."""
    return len(json.dumps(state, separators=(",", ":")).encode())


SEQ_LEN = 4096
GIANT = 2_000_000  # tokens: 489 chunks
WEIGHT = 0.1


def giant_source(root, name: str = "giant", length: int = GIANT, **options) -> Dataset:
    """One Parquet file holding one document of `length` tokens."""
    root.mkdir(parents=True, exist_ok=True)
    doc = (np.arange(length, dtype=np.int64) % 50_000).astype(np.int32)
    write_token_parquet(root / "giant.parquet", [doc], row_group_size=1)
    return Dataset({"name": name, "path": str(root / "*.parquet"), "tokens_field": "input_ids", **options},
                   [str(root / "giant.parquet")], {(0, 0): doc})


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("giant")
    giant = giant_source(root / "giant", weight=WEIGHT)
    short = token_parquet(root / "short", name="short", files=2, docs_per_file=100, row_group_size=25,
                          lo=1, hi=600, weight=1 - WEIGHT)
    return giant, short


def spec_of(sources, **kw):
    opts = {"seq_len": SEQ_LEN, "microbatches": 2, "dp": 2, **kw}
    return plait.load_spec(make_spec(list(sources), **opts))


# ----- (a) regression: shares within one chunk, small state ------------------------------------------
def test_giant_document_keeps_its_share(sources):
    spec = spec_of(sources)
    rt = LocalRuntime(spec)
    p = rt.planner
    steps = 120
    capacity = p.ranks * p.microbatches * p.capacity
    weights = np.array([WEIGHT, 1 - WEIGHT])
    target = np.zeros(2)
    delivered = np.zeros(2)
    giant_chunks = []
    try:
        for _ in range(steps):
            budget = max(0, capacity - int(p.carry.length.sum()))
            target += weights * budget
            plan = rt.plan()
            gap = p.drawn - target
            # drawn tokens: never behind the target, ahead by less than one chunk
            assert np.all(gap > -1e-6) and np.all(gap < SEQ_LEN), (plan.step, gap)
            it = plan.items
            delivered += np.bincount(it.source, weights=it.length, minlength=2)
            # delivered tokens: the same, give or take what the balancer carried to the next step
            carried = int(p.carry.length.sum())
            share_gap = delivered - weights * delivered.sum()
            assert np.all(np.abs(share_gap) <= SEQ_LEN + carried + 1e-6), (plan.step, share_gap, carried)
            giant_chunks.extend(it.chunk[it.source == 0].tolist())
            state = rt.state_dict()
            assert nbytes(state) < 4096, (plan.step, nbytes(state))
            rt.release()
    finally:
        rt.close()
    # The document is still being drawn, a chunk every few steps, in order and none twice.
    share = delivered[0] / delivered.sum()
    assert abs(share - WEIGHT) < 0.01, share
    assert 0 < len(giant_chunks) < GIANT // SEQ_LEN
    assert sorted(giant_chunks) == list(range(len(set(giant_chunks)))) == sorted(set(giant_chunks))
    assert 0 < state["sources"]["giant"]["cursor"][4] < GIANT  # mid-document


# ----- (b) exact resume in the middle of a giant document ---------------------------------------------
def sample_ids(batches) -> list[tuple]:
    return [tuple(map(int, r)) for mb in batches for r in mb.sample_ids]


def test_resume_mid_document_exactly(sources):
    spec = spec_of(sources, dp=1)
    steps, M = 14, 2
    loader = plait.Loader(spec, steps=steps, read_ahead=0)
    reference = list(loader)
    loader.close()
    giant = [r for r in sample_ids(reference) if r[0] == 0]
    assert len(giant) > 2 and [r[4] for r in giant] == list(range(len(giant))), "giant chunks in order"

    # The tokens of every chunk are the document's, cut at chunk * seq_len.
    doc = expected_tokens(sources[0])[(0, 0)]
    for mb in reference:
        for i, sid in enumerate(mb.sample_ids):
            if sid[0] == 0:
                a, b = mb.cu_seqlens[i], mb.cu_seqlens[i + 1]
                off = int(sid[4]) * SEQ_LEN
                np.testing.assert_array_equal(mb.input_ids[a:b], doc[off : off + (b - a)])

    for n in (3, 7, 11, 16):  # mid-step and step boundaries, all inside the document
        first = plait.Loader(spec, steps=steps, read_ahead=0)
        it = iter(first)
        head = [next(it) for _ in range(n)]
        state = json.loads(json.dumps(first.state_dict()))
        it.close()
        first.close()
        assert 0 < state["data"]["sources"]["giant"]["cursor"][4] < GIANT, "state taken mid-document"
        resumed = plait.Loader(spec, steps=steps, read_ahead=0)
        resumed.load_state_dict(state)
        tail = list(resumed)
        resumed.close()
        assert sample_ids(head + tail) == sample_ids(reference), n
        assert len(head) + len(tail) == steps * M


def test_planner_state_resumes_mid_document(sources):
    """Planner level, every step: the state after step k continues exactly the uninterrupted plan."""
    spec = spec_of(sources)
    rt = LocalRuntime(spec)
    plans, states = [], []
    for _ in range(12):
        states.append(rt.state_dict())
        plans.append(rt.plan().items.sample_ids().tolist())
        rt.release()
    rt.close()
    for k in (1, 5, 9):
        assert states[k]["sources"]["giant"]["cursor"][4] > 0
        other = LocalRuntime(spec)
        other.load_state_dict(json.loads(json.dumps(states[k])))
        again = [other.plan().items.sample_ids().tolist() for _ in range(k, 12)]
        other.close()
        assert again == plans[k:]


def test_old_four_field_cursor_still_loads(sources):
    spec = spec_of(sources)
    rt = LocalRuntime(spec)
    state = rt.state_dict()
    ref = [rt.plan().items.sample_ids().tolist() for _ in range(3)]
    rt.close()
    for s in state["sources"].values():
        assert s["cursor"][4] == 0
        s["cursor"] = s["cursor"][:4]  # saved before chunk-level drawing
    rt = LocalRuntime(spec)
    rt.load_state_dict(state)
    assert [rt.plan().items.sample_ids().tolist() for _ in range(3)] == ref
    rt.close()


# ----- (c) property: any lengths, any weights ------------------------------------------------------
class ListProvider:
    """Source i: blocks of the given document lengths (one file), repeated every epoch."""

    def __init__(self, blocks: list[list[list[int]]]):
        self.blocks = blocks

    def first_key(self, source: int):
        return (0, 0, 0)

    def block_meta(self, source: int, key):
        epoch, _, b = key
        lengths = np.asarray(self.blocks[source][b], dtype=np.int64)
        n = len(lengths)
        nb = len(self.blocks[source])
        next_key = (epoch, 0, b + 1) if b + 1 < nb else (epoch + 1, 0, 0)
        return BlockMeta(source, tuple(key), next_key, 0, np.arange(n, dtype=np.int64), 1000 * b + np.arange(n), lengths, n)


def doc_lengths(seq_len: int):
    short = st.integers(0, seq_len)
    long = st.integers(seq_len + 1, 12 * seq_len)
    return st.lists(st.one_of(short, short, long), min_size=1, max_size=5)


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 3),
    seq_len=st.sampled_from([16, 64]),
    microbatches=st.integers(1, 3),
    dp=st.integers(1, 3),
    max_delay=st.sampled_from([0, 0, 2]),
)
def test_chunk_granular_error_diffusion_property(data, n, seq_len, microbatches, dp, max_delay):
    weights = data.draw(st.lists(st.floats(0.0, 5.0, allow_nan=False), min_size=n, max_size=n).filter(lambda w: sum(w) > 0.05))
    blocks = [data.draw(st.lists(doc_lengths(seq_len), min_size=1, max_size=3)) for _ in range(n)]
    for b in blocks:  # every source needs a non-empty document per epoch
        b[0][0] = max(1, b[0][0])
    sources = [{"name": f"s{i}", "path": "/unused", "tokens_field": "t", "weight": w} for i, w in enumerate(weights)]
    spec = plait.load_spec(make_spec(sources, seq_len=seq_len, microbatches=microbatches, dp=dp,
                                     balance={"max_delay": max_delay, "outlier_factor": 1.0}))
    planner = Planner(spec, ListProvider(blocks))
    expected = [source_order(blocks[i], seq_len, i, 60 * dp * microbatches * seq_len) for i in range(n)]
    drawn = [0] * n  # per source: how many chunks of its order were drawn so far
    capacity = planner.ranks * planner.microbatches * planner.capacity
    target = np.zeros(n)
    delivered: list[tuple] = []
    carried = set()
    for _ in range(30):
        budget = max(0, capacity - int(planner.carry.length.sum()))
        target += planner.mixture.weights(planner.step) * budget
        plan = planner.plan_step()
        # within one chunk of the target, cumulatively (held outliers top the step up: use the deficit)
        assert np.all(-planner.deficit <= seq_len + 1e-6) and np.all(planner.deficit <= 1e-6), (plan.step, planner.deficit)
        if max_delay == 0:
            gap = planner.drawn - target
            assert np.all(gap > -1e-6) and np.all(gap <= seq_len + 1e-6), (plan.step, gap)
        assert np.all(plan.micro_tokens <= seq_len)
        assert nbytes(planner.state_dict()) < 2048 + 100 * len(planner.carry)
        placed, now_carried = rows(plan.items), set(rows(planner.carry))
        delivered += placed
        # What this step drew (placed or carried, not carried before): each source's next chunks, in order.
        new = (set(placed) | now_carried) - carried
        carried = now_carried
        for i in range(n):
            mine = sorted(r for r in new if r[0] == i)
            assert mine == sorted(expected[i][drawn[i] : drawn[i] + len(mine)]), f"source {i}: not its next chunks"
            drawn[i] += len(mine)
            assert planner.drawn[i] == sum(r[6] for r in expected[i][: drawn[i]])
            # the cursor points just past the last drawn chunk
            cur = [int(x) for x in planner.cursor[i]]
            last = expected[i][drawn[i] - 1] if drawn[i] else None
            nxt = expected[i][drawn[i]]
            if last and nxt[1:4] == last[1:4]:  # inside a document
                assert cur == [last[1], 0, last[2], last[3], nxt[5]]
            else:
                assert cur[4] == 0
    assert len(set(delivered)) == len(delivered), "a chunk delivered twice"
    assert not carried & set(delivered)
    for i in range(n):  # drawn = delivered + still carried: nothing lost
        assert sorted(r for r in delivered + list(carried) if r[0] == i) == sorted(expected[i][: drawn[i]])


def rows(items) -> list[tuple]:
    return list(zip(items.source.tolist(), items.epoch.tolist(), items.bpos.tolist(), items.position.tolist(),
                    items.chunk.tolist(), items.offset.tolist(), items.length.tolist()))


def source_order(blocks: list[list[int]], seq_len: int, source: int, tokens: int) -> list[tuple]:
    """A source's chunks in its order (epoch after epoch), as `rows` gives them, for at least so many tokens."""
    out, total, epoch = [], 0, 0
    while total <= tokens + seq_len:
        for b, lengths in enumerate(blocks):
            for pos, L in enumerate(lengths):
                for c in range(-(-L // seq_len)):
                    out.append((source, epoch, b, pos, c, c * seq_len, min(seq_len, L - c * seq_len)))
                    total += out[-1][6]
        epoch += 1
    return out
