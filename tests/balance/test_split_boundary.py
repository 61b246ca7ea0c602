"""packing.split: boundary: documents cut at a micro-batch's end fill it; every token still comes once.

A cut's rest is a new chunk of the document, numbered by its token offset (granule 1, packing_phases.py),
so sample ids stay unique per document and (sample id, offset) pieces tile each document exactly.
"""

from __future__ import annotations

import numpy as np

import plait
from plait.roles.planner import Planner
from helpers import FakeProvider, make_spec, run_all_ranks, token_parquet

RANGES = [(1, 300), (1, 2000), (5, 60)]  # mixed: short, long (chunked), tiny


def spec_of(split="boundary", *, dp=2, microbatches=3, seq_len=512, extra=None):
    sources = [{"name": f"s{i}", "path": "/nowhere", "tokens_field": "t"} for i in range(len(RANGES))]
    spec = make_spec(sources, seq_len=seq_len, microbatches=microbatches, dp=dp)
    spec["packing"].update({"split": split, **(extra or {})})
    return plait.load_spec(spec)


def run(spec, steps):
    planner = Planner(spec, FakeProvider(RANGES, blocks=4, docs_per_block=64))
    return [planner.plan_step() for _ in range(steps)], planner


def test_boundary_fills_99_percent():
    plain, _ = run(spec_of("none"), 30)
    split, _ = run(spec_of(), 30)
    fill_plain = sum(p.tokens for p in plain) / sum(p.slots for p in plain)
    fill_split = sum(p.tokens for p in split) / sum(p.slots for p in split)
    assert fill_split >= 0.99, fill_split
    assert fill_split > fill_plain
    assert all(p.fill >= 0.99 for p in split[1:])
    assert sum(p.documents_cut for p in split) > 0 and all(p.documents_cut == 0 for p in plain)
    for p in split:
        assert int(p.micro_tokens.max()) <= p.capacity
        # micro_tokens agree with the items placed
        per = np.zeros_like(p.micro_tokens)
        np.add.at(per, (p.rank, p.micro), p.items.length)
        np.testing.assert_array_equal(per, p.micro_tokens)
        assert p.stats()["documents_cut"] == p.documents_cut


def test_boundary_pieces_tile_documents_with_unique_ids():
    got, planner = run(spec_of(), 25)
    pieces: dict = {}
    for items in [p.items for p in got] + [planner.carry]:
        for i in range(len(items)):
            key = (int(items.source[i]), int(items.epoch[i]), int(items.bpos[i]), int(items.position[i]))
            pieces.setdefault(key, []).append((int(items.offset[i]), int(items.length[i]), int(items.chunk[i])))
    for key, ps in pieces.items():
        ps.sort()
        assert [c for _, _, c in ps] == [o for o, _, _ in ps]  # chunk number = token offset
        assert ps[0][0] == 0
        assert all(o1 + l1 == o2 for (o1, l1, _), (o2, _, _) in zip(ps, ps[1:])), (key, ps)


def test_boundary_resume_is_exact():
    spec = spec_of()
    full, _ = run(spec, 12)
    head, planner = run(spec, 5)
    tail_planner = Planner(spec, FakeProvider(RANGES, blocks=4, docs_per_block=64))
    tail_planner.load_state_dict(planner.state_dict())
    tail = [tail_planner.plan_step() for _ in range(7)]
    for a, b in zip(head + tail, full):
        np.testing.assert_array_equal(a.items.sample_ids(), b.items.sample_ids())
        np.testing.assert_array_equal(a.items.offset, b.items.offset)
        np.testing.assert_array_equal(a.rank, b.rank)
        np.testing.assert_array_equal(a.micro, b.micro)


def test_boundary_with_long_cap():
    spec = spec_of(extra={"max_long_per_step": {"min_tokens": 400, "per_rank": 1}})
    got, _ = run(spec, 15)
    for p in got:
        for r in range(p.ranks):
            assert int(((p.items.length >= 400) & (p.rank == r)).sum()) <= 1


def test_every_token_once_in_order_end_to_end(tmp_path):
    """Through the Loader: each document's tokens, gathered from its pieces in offset order, are the
    document exactly; every micro-batch is <= seq_len and (after the first step) nearly full."""
    ds = token_parquet(tmp_path / "d", files=2, docs_per_file=60, lo=1, hi=200)
    spec = make_spec([ds], seq_len=128, microbatches=2, dp=2)
    spec["packing"]["split"] = "boundary"
    batches, rt, _ = run_all_ranks(plait.load_spec(spec), 6)
    carry = rt.planner.carry
    rt.close()
    got: dict = {}
    for mb in batches:
        assert len(mb.input_ids) <= 128
        cu = mb.cu_seqlens
        for i in range(len(cu) - 1):
            s, e, shard, row, chunk = (int(x) for x in mb.sample_ids[i])
            got.setdefault((shard, row), []).append((chunk, mb.input_ids[cu[i]:cu[i + 1]]))
    carried = {(int(carry.shard[i]), int(carry.row[i])): int(carry.offset[i]) for i in range(len(carry))}
    assert sum(len(mb.input_ids) for mb in batches) / (len(batches) * 128) >= 0.97
    unfinished = []
    for key, parts in got.items():
        parts.sort(key=lambda x: x[0])
        offsets = np.cumsum([0] + [len(t) for _, t in parts])[:-1].tolist()
        assert [c for c, _ in parts] == offsets, key  # chunk number = offset, no gap, no overlap
        tokens = np.concatenate([t for _, t in parts])
        doc = ds.docs[key]
        np.testing.assert_array_equal(tokens, doc[:len(tokens)])  # in order, from its first token
        if key in carried:  # the rest of it waits in the carry, from exactly where delivery stopped
            assert carried[key] == len(tokens)
        elif len(tokens) < len(doc):
            unfinished.append(key)
    assert len(unfinished) <= 1  # at most the document the cursor stands in (drawn part-way)


def test_default_unchanged():
    """split: none (the default) draws and places exactly what it did: chunk numbers are indices."""
    a, _ = run(spec_of("none"), 8)
    sources = [{"name": f"s{i}", "path": "/nowhere", "tokens_field": "t"} for i in range(len(RANGES))]
    b, _ = run(plait.load_spec(make_spec(sources, seq_len=512, microbatches=3, dp=2)), 8)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.items.sample_ids(), y.items.sample_ids())
        np.testing.assert_array_equal(x.rank, y.rank)
    long = np.concatenate([p.items.chunk for p in a])
    assert long.max() > 0 and long.max() < 2000 // 512 + 1
