"""One buffer budget for the job on Ray: each SourceLoader actor's budget is its share of
loading.max_buffer_mb (its sources, a split source counting for the partitions it owns), so the loaders'
budgets add up to the job's cap however the sources are spread over them, except that a loader's share is
never below one of its sources' buffer_mb (docs/memory.md)."""

from __future__ import annotations

import plait
from helpers import make_spec, token_parquet
from plait.roles.source_loader import loader_budget


def test_loader_budgets_add_up_to_the_jobs_cap(tmp_path):
    sources = [token_parquet(tmp_path / f"s{i}", name=f"s{i}", files=2, docs_per_file=4) for i in range(16)]
    spec = plait.load_spec(make_spec(sources, loading={"max_buffer_mb": 512}))
    cap = 512 * 2**20
    for loaders in (1, 2, 4, 8, 16):
        per = 16 // loaders
        shares = [loader_budget(spec, list(range(i * per, (i + 1) * per)), {}) for i in range(loaders)]
        assert sum(shares) == cap, loaders
    # source 0 read by 4 loaders, a partition each (the rest on the first): a share is never below one of its
    # sources' buffer_mb (16 MiB by default), so a loader with a sliver (8 MiB) holds one buffer_mb: the
    # total is over the cap by at most that floor per such loader
    split = [loader_budget(spec, list(range(16)), {0: (4, frozenset({0}))})]
    split += [loader_budget(spec, [0], {0: (4, frozenset({p}))}) for p in (1, 2, 3)]
    floor = spec.sources[0].buffer_bytes
    assert split[0] == cap - 3 * (cap // 16 // 4) and split[1:] == [floor] * 3
    assert cap < sum(split) <= cap + 3 * floor
