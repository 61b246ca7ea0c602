"""Dynamic context parallelism on the ray runtime: the same shards as local, bit for bit; each trainer (dp, cp)
reads its pool rank's waves; every planned sample delivered once; a group micro-batch built once per
Constructor serving its members."""

from __future__ import annotations

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import plait  # noqa: E402
from plait.cli.stream import stream  # noqa: E402
from plait.context_parallel import unshard_group  # noqa: E402
from plait.metrics import combined_digest  # noqa: E402
from plait.packing import IGNORE_INDEX  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    """Pre-tokenized sources with documents up to 4 micro-batches long (the demo's text would be tokenized
    again by every reader, local and Ray: seconds of CPU each, not the subject here)."""
    from helpers import make_spec, token_parquet

    root = tmp_path_factory.mktemp("dcp")
    sources = [token_parquet(root / name, name=name, files=3, docs_per_file=40, row_group_size=10, lo=16, hi=hi,
                             seed=seed) for seed, (name, hi) in enumerate((("web", 600), ("long", 2000)))]
    return plait.load_spec(make_spec(sources, seq_len=512, microbatches=2, dp=2)).with_overrides(
        topology={"dp": 2, "cp": 2}, steps=4, context_parallel={"mode": "dynamic", "groups": "pow2", "max_degree": 4})


def test_dynamic_cp_ray_digest_equals_local(ray_session, spec):
    outs = {rt: stream(spec, steps=spec.steps, runtime=rt, progress=False,
                       runtime_options={"loaders": 2} if rt == "ray" else None) for rt in ("ray", "local")}
    assert sorted(outs["local"]["digests"], key=int) == ["0", "1", "2", "3"]  # a digest per pool rank
    assert combined_digest(outs["ray"]["digests"]) == combined_digest(outs["local"]["digests"])


def test_trainers_read_their_pool_ranks_waves_exactly_once(ray_session, spec):
    ranks = [(d, c) for d in range(2) for c in range(2)]
    local = {(d, c): list(plait.Loader(spec, dp_rank=d, cp_rank=c, read_ahead=0)) for d, c in ranks}
    # no standby Planner (not the subject: one process fewer)
    loaders = {(d, c): plait.Loader(spec, dp_rank=d, cp_rank=c, runtime="ray", job="dcp-job", loaders=1,
                                    attach=(d, c) != (0, 0), planner_standby=False) for d, c in ranks}
    try:
        got = {key: list(ld) for key, ld in loaders.items()}
        stats = loaders[(0, 0)].runtime.stats()
    finally:
        for ld in loaders.values():
            ld.close()
    groups: dict[tuple[int, int], dict[int, object]] = {}
    for (d, c), batches in got.items():
        assert len(batches) == len(local[(d, c)])
        for a, b in zip(batches, local[(d, c)]):
            pool_rank = c + 2 * d
            assert a.dp_rank == pool_rank and pool_rank in a.stats["cp"]["group"]
            for f in ("input_ids", "labels", "position_ids", "cu_seqlens", "sample_ids"):
                assert np.array_equal(getattr(a, f), getattr(b, f)), f
            groups.setdefault((a.step, a.stats["cp"]["group_id"]), {})[a.stats["cp"]["rank"]] = a
    # exactly once: the group micro-batches of a step, reassembled, hold every planned sample once
    for step in range(spec.steps):
        wholes = [unshard_group([m[i] for i in range(len(m))]) for (s, _), m in groups.items() if s == step]
        ids = np.concatenate([w.sample_ids for w in wholes])
        assert len(np.unique(ids, axis=0)) == len(ids) > 0
        labels = sum(int((w.labels != IGNORE_INDEX).sum()) for w in wholes)
        assert labels == wholes[0].stats["global_label_tokens"]
    assert max(len(m) for m in groups.values()) > 1  # some documents did run over a group of ranks
    # one Constructor serves this node's four pool ranks: each group built once there
    assert sum(c["group_builds"] for c in stats["constructors"].values()) == len(groups)
