"""Elastic resume: one data state continues the same per-source sequence on 8 → 4 → 16 DP ranks.

What "the same global sequence" means when the step budget changes: a step on 4 ranks draws half the
tokens of a step on 8, so step boundaries differ from an uninterrupted run; what does not change is
each source's sequence of drawn documents (its fixed order, continued from the cursors) and the token
share of every source (the deficits carry over). Carried chunks, cut for the same seq_len, are placed
first on the new layout. So: per source the delivered chunks plus the still-carried ones are exactly a
prefix of that source's order, nothing is delivered twice, and what was carried at a switch is never
lost.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from fixtures import mixed_spec as make_spec
from helpers import boundary_state_without_next, local_resume_ids
from plait.state.log import nbytes
from plait.errors import PlaitError
from plait.runtime.local import LocalRuntime

K = 6  # steps per phase


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return make_spec(tmp_path_factory.mktemp("elastic"), dp=8)


def run(spec, dp: int, steps: int, state: dict | None = None):
    """Planner-level job on `dp` ranks: (delivered ids in order, order keys by id, state after)."""
    rt = LocalRuntime(spec.with_overrides(topology={"dp": dp}))
    if state is not None:
        rt.load_state_dict(json.loads(json.dumps(state)))  # as saved to disk
    ids, order = [], {}
    for _ in range(steps):
        plan = rt.plan()
        assert plan.ranks == dp
        it = plan.items
        keys = np.stack([it.epoch, it.fpos, it.bpos, it.position, it.chunk], axis=1)
        for sid, key in zip(map(tuple, it.sample_ids().tolist()), map(tuple, keys.tolist())):
            order[sid] = key
        for r in range(dp):
            for mb in rt.build(plan, r):
                assert mb.dp_rank == r
                ids.extend(map(tuple, mb.sample_ids.tolist()))
        rt.release()
    state = rt.state_dict()
    rt.close()
    return ids, order, state


def carry_ids(state: dict) -> dict[tuple, tuple]:
    """Carried chunks of a data state: id -> order key (epoch, fpos, bpos, position, chunk)."""
    out = {}
    for r in state["carry"]:
        source, epoch, fpos, bpos, position, shard, row, chunk = r[:8]
        out[(source, epoch, shard, row, chunk)] = (epoch, fpos, bpos, position, chunk)
    return out


def per_source_sorted(ids, order) -> dict[int, list[tuple]]:
    out: dict[int, list[tuple]] = {}
    for sid in ids:
        out.setdefault(sid[0], []).append(order[sid])
    return {s: sorted(v) for s, v in out.items()}


def test_elastic_8_4_16_exactly_once_and_prefix(spec):
    ids8, ord8, s8 = run(spec, 8, K)
    ids4, ord4, s4 = run(spec, 4, K, s8)
    ids16, ord16, s16 = run(spec, 16, K, s4)
    assert (s8["step"], s4["step"], s16["step"]) == (K, 2 * K, 3 * K)
    delivered = ids8 + ids4 + ids16
    assert len(delivered) == len(set(delivered)), "a chunk was delivered twice"

    # Carried chunks at each switch are delivered later or are still carried: never lost.
    final_carry = carry_ids(s16)
    later = set(ids4) | set(ids16) | set(final_carry)
    assert set(carry_ids(s8)) <= later
    assert set(carry_ids(s4)) <= set(ids16) | set(final_carry)
    assert not set(final_carry) & set(delivered)

    # Per source, delivered + carried is exactly a prefix of the uninterrupted run's order (dp=8,
    # drawn far enough: 8K + 4K + 16K rank-steps of tokens = 3.5K steps at dp=8).
    order = {**ord8, **ord4, **ord16, **final_carry}
    elastic = per_source_sorted(delivered + list(final_carry), order)
    ref_ids, ref_order, ref_state = run(spec, 8, 4 * K + 2)
    ref_carry = carry_ids(ref_state)
    reference = per_source_sorted(ref_ids + list(ref_carry), {**ref_order, **ref_carry})
    for s, keys in elastic.items():
        assert len(keys) <= len(reference[s]), f"source {s}: reference not drawn far enough"
        assert keys == reference[s][: len(keys)], f"source {s}: not a prefix of the source's order"
        assert len(set(keys)) == len(keys)
    # Whole documents: a drawn document's chunks are all delivered or carried.
    for s, keys in elastic.items():
        docs: dict[tuple, list[int]] = {}
        for e, f, b, p, c in keys:
            docs.setdefault((e, f, b, p), []).append(c)
        assert all(sorted(c) == list(range(len(c))) for c in docs.values())

    # The mixture continues: drawn tokens per source track the weights across the layout changes.
    drawn = np.array([s16["sources"][s.name]["drawn"] for s in spec.sources], dtype=np.float64)
    weights = np.array([s.weight for s in spec.sources])
    target = weights / weights.sum() * drawn.sum()
    assert np.all(np.abs(drawn - target) <= 2 * 1501)


def test_state_is_small_and_layout_free(spec):
    _, _, s8 = run(spec, 8, K)
    _, _, s16 = run(spec, 16, K)
    _, _, s8_long = run(spec, 8, 3 * K)
    # Kilobytes, not growing with the number of steps or ranks (only the carry varies).
    for s in (s8, s16, s8_long):
        assert nbytes(s) < 16_000
        assert set(s) == {"version", "fingerprint", "step", "sources", "carry", "delivered"}
    head = [nbytes({k: v for k, v in s.items() if k != "carry"}) for s in (s8, s16, s8_long)]
    assert max(head) < 1024 and max(head) - min(head) < 32  # a few digits more, nothing else
    # The carry is bounded by what one step leaves behind, not by the run's length.
    assert len(s8_long["carry"]) <= 4 * max(len(s8["carry"]), len(s16["carry"]), 8)


def test_carried_chunks_must_fit_the_new_layout(spec):
    _, _, s8 = run(spec, 8, K)
    assert s8["carry"], "the test needs carried chunks"
    longest = max(row[9] for row in s8["carry"])  # column 9 of a carried row is its length
    small = spec.with_overrides(packing={"seq_len": longest - 1})
    rt = LocalRuntime(small)
    with pytest.raises(PlaitError, match="capacity"):
        rt.load_state_dict(s8)
    rt.close()


def test_client_resumes_elastically_from_a_step_boundary(spec):
    """Loader level: 8 ranks consume K steps; the state of any rank resumes 4 ranks for K steps."""
    import plait

    def consume(sp, dp, steps, state=None):
        out, states = [], []
        for r in range(dp):
            ld = plait.Loader(sp.with_overrides(topology={"dp": dp}), dp_rank=r, steps=steps, read_ahead=0)
            if state is not None:
                ld.load_state_dict(state)
            out.extend(tuple(x) for mb in ld for x in mb.sample_ids.tolist())
            states.append(ld.state_dict())
            ld.close()
        return out, states

    first, states = consume(spec, 8, K)
    assert all(s == states[0] for s in states), "every rank holds the same data state"
    saved = json.loads(json.dumps(states[0]))
    assert saved["next_microbatch"] == spec.packing.num_microbatches and saved["layout"]["dp"] == 8
    second, _ = consume(spec, 4, 2 * K, saved)
    ids8, _, s8 = run(spec, 8, K)
    ids4, _, _ = run(spec, 4, K, s8)
    assert sorted(first) == sorted(ids8)
    assert sorted(second) == sorted(ids4)

    # Mid-step checkpoints cannot move to another layout (each rank's progress differs).
    ld = plait.Loader(spec, dp_rank=0, steps=K, read_ahead=0)
    next(iter(ld))
    mid = ld.state_dict()
    ld.close()
    other = plait.Loader(spec.with_overrides(topology={"dp": 4}), dp_rank=0, read_ahead=0)
    with pytest.raises(PlaitError, match="step boundary"):
        other.load_state_dict(mid)
    other.close()


def test_a_thin_client_resumes_elastically_with_the_job_replanning(spec, monkeypatch):
    """The re-planning of an elastic resume runs on the job's side: a flight client of a one-process
    server (4 ranks) resumes a boundary state saved on 8 ranks, the server re-plans the saved step (its
    `replan_after` action), and the client reads exactly what a local Loader resuming the same state
    reads (sample ids)."""
    import plait
    from plait.runtime.flight_serving import JobFlight
    from plait.runtime.serve_local import LocalJobServer

    saved = boundary_state_without_next(spec)  # without `next`: the step must be re-planned
    spec4 = spec.with_overrides(topology={"dp": 4})
    want = local_resume_ids(spec4, saved, dp_rank=1, steps=4)

    answered = []
    answer = JobFlight.answer

    def spy(self, name, body, peer):
        answered.append(name)
        return answer(self, name, body, peer)

    monkeypatch.setattr(JobFlight, "answer", spy)
    with LocalJobServer(spec4, "elastic") as server:
        with plait.Loader(spec4, dp_rank=1, steps=4, read_ahead=0, runtime="flight", job_address=server.address,
                          token=server.token) as thin:
            thin.load_state_dict(saved)
            got = [mb.sample_ids.tolist() for mb in thin]
    assert answered.count("replan_after") == 1
    assert got == want and len(got) > 0
