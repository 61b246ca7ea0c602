"""The Planner's own contract: metadata in, step plans out.

It plans from block metadata only (no tokens, no files), never over-fills a step or a micro-batch,
draws each source's chunks in that source's order exactly once, keeps the mixture's shares, and its
small JSON state fully defines the rest of the stream.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import make_spec

import plait
from plait.errors import PlaitError
from plait.roles.planner import Planner
from plait.roles.source_loader import BlockMeta

SEQ = 64


class LengthsOnly:
    """A MetadataProvider holding nothing but document lengths: no files, no tokens.

    Source i has one file of `blocks` blocks; block b holds documents at positions with gaps (as if bad
    records had been dropped), lengths seeded, some zero, some several chunks long. Epochs repeat the
    same lengths. Any attribute other than the MetadataProvider protocol is refused and recorded.
    """

    PROTOCOL = ("first_key", "block_meta")

    def __init__(self, ranges: list[tuple[int, int]], *, blocks: int = 3, docs: int = 12, seed: int = 0):
        self.ranges, self.blocks, self.docs, self.seed = ranges, blocks, docs, seed
        self.calls: list[str] = []
        self.refused: list[str] = []

    def __getattr__(self, name):
        if not name.startswith("__"):
            self.refused.append(name)
        raise AttributeError(name)

    def first_key(self, source: int):
        self.calls.append("first_key")
        return (0, 0, 0)

    def block_lengths(self, source: int, bpos: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, lengths) of a block: positions increasing with gaps."""
        rng = np.random.default_rng([self.seed, source, bpos])
        lo, hi = self.ranges[source]
        lengths = rng.integers(lo, hi + 1, size=self.docs).astype(np.int64)
        lengths[rng.random(self.docs) < 0.1] = 0  # empty documents: counted, never placed
        positions = np.cumsum(rng.integers(1, 3, size=self.docs)).astype(np.int64)
        return positions, lengths

    def block_meta(self, source: int, key):
        self.calls.append("block_meta")
        epoch, _, bpos = key
        positions, lengths = self.block_lengths(source, bpos)
        next_key = (epoch, 0, bpos + 1) if bpos + 1 < self.blocks else (epoch + 1, 0, 0)
        return BlockMeta(source, tuple(key), next_key, 7 + source, positions, 1000 * bpos + positions, lengths,
                         int(positions[-1]) + 1)

    def chunks_in_order(self, source: int, count: int) -> list[tuple[int, ...]]:
        """The first `count` chunks of a source in its order: (epoch, fpos, bpos, position, offset, length)."""
        out: list[tuple[int, ...]] = []
        epoch = 0
        while True:
            for bpos in range(self.blocks):
                positions, lengths = self.block_lengths(source, bpos)
                for p, L in zip(positions.tolist(), lengths.tolist()):
                    for off in range(0, L, SEQ):
                        out.append((epoch, 0, bpos, p, off, min(SEQ, L - off)))
                        if len(out) == count:
                            return out
            epoch += 1


def fake_spec(weights=(1.0, 1.0), *, dp: int = 2, microbatches: int = 3, seed: int = 0):
    sources = [{"name": f"s{i}", "path": "/nowhere", "tokens_field": "t", "weight": w} for i, w in enumerate(weights)]
    return plait.load_spec(make_spec(sources, seq_len=SEQ, microbatches=microbatches, dp=dp, seed=seed))


def item_keys(items, sel=None) -> list[tuple[int, ...]]:
    cols = (items.source, items.epoch, items.fpos, items.bpos, items.position, items.offset, items.length)
    sel = np.arange(len(items)) if sel is None else sel
    return [tuple(int(c[i]) for c in cols) for i in sel]


def plan_arrays(plan) -> dict[str, np.ndarray]:
    """Everything that decides the data and its placement, for comparing two plans."""
    it = plan.items
    return {"ids": it.sample_ids(), "offset": it.offset, "length": it.length, "position": it.position,
            "rank": plan.rank, "micro": plan.micro, "micro_tokens": plan.micro_tokens}


def assert_same_plan(a, b) -> None:
    assert (a.step, a.ranks, a.microbatches) == (b.step, b.ranks, b.microbatches)
    for name, x in plan_arrays(a).items():
        np.testing.assert_array_equal(x, plan_arrays(b)[name], err_msg=f"step {a.step}: {name}")


RANGES = [(1, 40), (20, 200)]  # short documents, and documents of up to 4 chunks


def test_plans_from_metadata_only():
    provider = LengthsOnly(RANGES)
    planner = Planner(fake_spec(), provider)
    for _ in range(6):
        plan = planner.plan_step()
        assert plan.tokens > 0
    assert provider.refused == [], "the Planner asked its provider for more than block metadata"
    assert set(provider.calls) <= set(LengthsOnly.PROTOCOL)
    # A block's metadata is fetched once while the cursor is in it, not once per document or step.
    assert provider.calls.count("block_meta") <= 6 * 2 * 2 + 2


@pytest.mark.parametrize("dp,microbatches", [(1, 1), (2, 3), (4, 2)])
def test_step_and_microbatch_budgets_hold(dp, microbatches):
    planner = Planner(fake_spec(dp=dp, microbatches=microbatches), LengthsOnly(RANGES))
    for _ in range(8):
        plan = planner.plan_step()
        assert plan.ranks == dp and plan.microbatches == microbatches
        assert plan.tokens <= dp * microbatches * SEQ
        assert np.all(plan.items.length > 0) and np.all(plan.items.length <= SEQ)
        assert np.all((0 <= plan.rank) & (plan.rank < dp)) and np.all((0 <= plan.micro) & (plan.micro < microbatches))
        tokens = np.zeros((dp, microbatches), dtype=np.int64)
        np.add.at(tokens, (plan.rank, plan.micro), plan.items.length)
        np.testing.assert_array_equal(tokens, plan.micro_tokens)
        assert tokens.max() <= SEQ
        rank_cost = np.bincount(plan.rank, weights=plan.cost, minlength=dp)
        np.testing.assert_allclose(rank_cost, plan.rank_cost)
        assert plan.rank_cost.max() >= plan.lower_bound * (1 - 1e-9)
        # The step is well filled: what is left over is at most a few chunks' worth.
        assert plan.tokens + int(planner.carry.length.sum()) >= dp * microbatches * SEQ - 2 * SEQ
        # Each rank's share is what for_rank hands its Constructor.
        for r in range(dp):
            share = plan.for_rank(r)
            assert share.dp_rank == r and share.microbatches == microbatches
            assert int(share.items.length.sum()) == int(tokens[r].sum())


@pytest.mark.parametrize("ranges,docs,dp,microbatches,steps", [
    (RANGES, 10, 2, 3, 20),
    ([(1, 40), (300, 900)], 4, 1, 2, 100),  # documents of up to 15 chunks, drawn a chunk per step
])
def test_chunks_drawn_in_each_source_order_exactly_once(ranges, docs, dp, microbatches, steps):
    """Everything placed so far plus the carry is exactly a prefix of each source's chunk order (no gap,
    no repeat), and each step draws strictly after what the previous step drew."""
    provider = LengthsOnly(ranges, blocks=2, docs=docs)  # several epochs within the run
    planner = Planner(fake_spec(dp=dp, microbatches=microbatches), provider)
    seen: dict[int, list] = {0: [], 1: []}
    last_drawn: dict[int, tuple] = {}
    empty = 0
    for _ in range(steps):
        plan = planner.plan_step()
        empty += plan.empty_documents
        new = item_keys(plan.items, np.flatnonzero(plan.items.delayed == 0))
        new += item_keys(planner.carry, np.flatnonzero(planner.carry.delayed == 1))
        for s in (0, 1):
            keys = sorted(k[1:] for k in new if k[0] == s)
            if keys:
                assert s not in last_drawn or keys[0] > last_drawn[s], "a step drew before the previous one's draw"
                last_drawn[s] = keys[-1]
        for k in item_keys(plan.items):
            seen[k[0]].append(k[1:])
    for k in item_keys(planner.carry):
        seen[k[0]].append(k[1:])
    for s in (0, 1):
        got = sorted(seen[s])
        assert len(set(got)) == len(got), "a chunk was planned twice"
        assert got == provider.chunks_in_order(s, len(got))
        assert got[-1][0] >= 1, "the run should have crossed an epoch boundary"
    # Zero-token documents before the cursors were counted, never placed.
    skipped = 0
    for s in (0, 1):
        epoch, fpos, bpos, position, _ = (int(x) for x in planner.cursor[s])
        for e in range(epoch + 1):
            for b in range(provider.blocks):
                positions, lengths = provider.block_lengths(s, b)
                before = [(e, 0, b, p) < (epoch, fpos, bpos, position) for p in positions.tolist()]
                skipped += int(((lengths == 0) & np.array(before)).sum())
    assert skipped > 0 and empty == skipped


def test_mixture_shares_track_weights():
    weights = (3.0, 1.0, 0.0)
    provider = LengthsOnly([(1, 40), (20, 200), (1, 10)])
    planner = Planner(fake_spec(weights, dp=2, microbatches=2), provider)
    share = np.array(weights) / sum(weights)
    drawn = np.zeros(3)
    for _ in range(30):
        plan = planner.plan_step()
        drawn += np.bincount(plan.items.source, weights=plan.items.length, minlength=3)
        # Including the carry, each source is within one chunk of its exact share of everything drawn.
        total = drawn + np.bincount(planner.carry.source, weights=planner.carry.length, minlength=3)
        assert np.all(np.abs(total - share * total.sum()) < SEQ), (plan.step, total, share * total.sum())
    assert drawn[2] == 0
    assert drawn[0] > 2.5 * drawn[1]


def test_plan_is_a_pure_function_of_the_state():
    spec = fake_spec()
    first = Planner(spec, LengthsOnly(RANGES))
    for _ in range(5):
        first.plan_step()
    state = json.loads(json.dumps(first.state_dict()))
    ahead = [first.plan_step() for _ in range(6)]
    # A new Planner (new provider object: nothing shared) from the saved state plans the same steps.
    saved = json.dumps(state)
    second = Planner(spec, LengthsOnly(RANGES))
    second.load_state_dict(state)
    for a in ahead:
        assert_same_plan(a, second.plan_step())
    # Each plan names the state it started from; replanning from it gives that plan again.
    third = Planner(spec, LengthsOnly(RANGES))
    third.load_state_dict(ahead[3].state_before)
    assert_same_plan(ahead[3], third.plan_step())
    # Loading a state is a copy: planning on does not change the dict it was given.
    assert json.dumps(state) == saved
    assert second.state_dict() == first.state_dict()


def test_state_is_small_json_and_checked_on_load():
    spec = fake_spec()
    planner = Planner(spec, LengthsOnly(RANGES))
    sizes = []
    for _ in range(40):
        planner.plan_step()
        state = planner.state_dict()
        sizes.append(len(json.dumps(state)))
        assert json.loads(json.dumps(state)) == state
    assert max(sizes) < 4096, sizes  # per-source cursors and a small carry: does not grow with steps
    assert state["step"] == 40
    other = Planner(fake_spec(seed=1), LengthsOnly(RANGES))
    with pytest.raises(PlaitError, match="different spec"):
        other.load_state_dict(state)
    with pytest.raises(PlaitError, match="version"):
        Planner(spec, LengthsOnly(RANGES)).load_state_dict({**state, "version": 999})
    # The data state is layout-free: another DP size and micro-batch count accept it.
    elastic = Planner(fake_spec(dp=3, microbatches=1), LengthsOnly(RANGES))
    elastic.load_state_dict(state)
    assert elastic.plan_step().step == 40


def test_live_blocks_are_the_cursors_and_the_carry():
    """What a SourceLoader may keep: the cursors' blocks and blocks of carried chunks, nothing consumed;
    every chunk of the next step comes from a live block or from one the cursor has not reached."""
    provider = LengthsOnly(RANGES, blocks=4, docs=8)
    planner = Planner(fake_spec(dp=2, microbatches=1), provider)
    for _ in range(15):
        live = planner.live_blocks()
        cursors = {(s, *map(int, planner.cursor[s, :3])) for s in (0, 1)}
        carried = set(planner.carry.block_keys()[0])
        assert live == cursors | carried
        plan = planner.plan_step()
        for key in plan.items.block_keys()[0]:
            s = key[0]
            assert key in live or key[1:] > min(k[1:] for k in cursors if k[0] == s)


def test_dp_override_spreads_the_step_over_that_many_ranks():
    spec = fake_spec(dp=2, microbatches=2)
    planner = Planner(spec, LengthsOnly(RANGES), dp=5)
    plan = planner.plan_step()
    assert plan.ranks == 5 and plan.rank_cost.shape == (5,) and plan.micro_tokens.shape == (5, 2)
    assert set(plan.rank.tolist()) == set(range(5))
    assert plan.tokens <= 5 * 2 * SEQ and plan.tokens > 2 * 2 * SEQ
