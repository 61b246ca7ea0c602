"""One buffer budget for the job: a SourceLoader's sources share one budget (its share of
loading.max_buffer_mb, applied at release too), blocks outside the plan window (those no planned step
draws from, e.g. a source's cursor block) dropped first; sized to the plan window (WINDOW_SLACK set), the
decoded data held no longer grows with the number of sources. A source's buffer_mb is a cap only where the
spec sets it. The stream never depends on the budget: a dropped block is read again when a step draws from it."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import batch_digest, make_spec, token_parquet

import plait
from plait.roles.source_loader import SourceLoader
from plait.runtime.local import LocalRuntime
from plait.sources import buffer_budget

SOURCES = 12


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """Twelve sources of one ~40 KiB block each per file: a step draws from a few of them only."""
    root = tmp_path_factory.mktemp("shared-budget")
    return [token_parquet(root / f"s{i}", name=f"s{i}", files=2, docs_per_file=40, row_group_size=40, lo=200,
                          hi=300, seed=i, eos=1) for i in range(SOURCES)]


def run(spec, steps: int = 12) -> tuple[list, list[int], LocalRuntime]:
    """Every rank's micro-batches of `steps` steps, and the loader's buffered blocks after each step."""
    rt = LocalRuntime(spec)
    out, held = [], []
    for _ in range(steps):
        plan = rt.plan()
        for r in range(plan.ranks):
            out.extend(rt.build(plan, r))
        rt.release()
        held.append(len(rt.loader.buffered_keys()))
    return out, held, rt


def test_sources_share_one_budget_sized_to_the_plan_window(many, monkeypatch):
    spec = plait.load_spec(make_spec(many, seq_len=512, microbatches=1, dp=2))
    roomy_batches, roomy_held, roomy = run(spec)
    roomy.close()
    assert max(roomy_held) >= SOURCES  # the default: every source's cursor block kept within the cap
    monkeypatch.setattr(buffer_budget, "WINDOW_SLACK", 0)  # only what the planned steps draw from
    tight_batches, tight_held, tight = run(spec)
    try:
        assert max(tight_held[1:]) < SOURCES // 2, tight_held  # cursor blocks no planned step needs are dropped
        assert tight.loader.blocks_read > roomy.loader.blocks_read  # ... and read again when a step draws on them
        assert batch_digest(tight_batches) == batch_digest(roomy_batches)
        ids = np.concatenate([mb.sample_ids for mb in tight_batches])
        assert len(np.unique(ids, axis=0)) == len(ids)  # exactly once
    finally:
        tight.close()


def test_buffer_mb_caps_a_source_only_where_the_spec_sets_it(many):
    entries = [s.with_options(buffer_mb=0.5) if i == 0 else s for i, s in enumerate(many)]
    loader = SourceLoader(plait.load_spec(make_spec(entries, seq_len=512, microbatches=1, dp=2)))
    try:
        assert loader.source_budget == {0: 2**19}
    finally:
        loader.close()
