"""The ray runtime: same batches as local, bit for bit, whatever the number of loaders; a shared,
once-planned stream for many clients. One local Ray instance for the whole module (kept small)."""

from __future__ import annotations

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import plait  # noqa: E402
from plait.metrics import combined_digest  # noqa: E402
from plait.cli.stream import stream  # noqa: E402
from helpers import boundary_state_without_next, local_resume_ids  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def spec(demo_spec_path):
    return plait.load_spec(demo_spec_path).with_overrides(
        topology={"dp": 4}, packing={"seq_len": 4096, "microbatches": 2}, steps=6
    )


@pytest.fixture(scope="module")
def tokens_spec(tmp_path_factory):
    """Two pre-tokenized sources, 4 DP ranks: for the tests of how clients share and resume a job (the demo's
    text would be tokenized again by each of their local reference Loaders: seconds of CPU each)."""
    from helpers import make_spec, token_parquet

    root = tmp_path_factory.mktemp("tokens")
    sources = [token_parquet(root / name, name=name, files=3, docs_per_file=60, row_group_size=10, lo=16, hi=1500,
                             seed=seed) for seed, name in enumerate(("web", "long"))]
    return plait.load_spec(make_spec(sources, seq_len=1024, microbatches=2, dp=4)).with_overrides(steps=6)


@pytest.fixture(scope="module")
def local_digest(spec):
    """The local runtime's digest of the module's spec, computed once for the Ray runs it is compared with."""
    return _digest(spec, "local")


def _digest(spec, runtime, **options):
    out = stream(spec, steps=spec.steps, runtime=runtime, progress=False, runtime_options=options)
    return combined_digest(out["digests"])


def test_partition_map_follows_the_source_file_order(spec):
    """The placement map (no source opened) puts block (epoch, file_pos) where the Source's own order does."""
    from plait.runtime.placement import PartitionMap
    from plait.sources import Source

    src = Source(spec.sources[1], 1, spec.seed)
    n = len(src.files)
    pmap = PartitionMap(spec.seed, {1: n}, {1: n}, {(1, p): p for p in range(n)})  # partition p = file p
    for epoch in range(3):
        assert [pmap.loader_of(1, epoch, f) for f in range(n)] == src.file_order(epoch).tolist()


def test_partitions_follow_cpu_work_not_source_count(spec):
    from plait.runtime.placement import assign_partitions

    many = spec.with_overrides(sources=[
        {"name": f"s{i}", "path": spec.sources[3].path, "tokens_field": "input_ids", "weight": 1.0} for i in range(64)
    ])
    num, owned = assign_partitions(many, 2, None)
    assert set(num.values()) == {1} and sorted(len(o) for o in owned) == [32, 32]
    # More loaders than sources: the heaviest source is split; explicit partitions are honoured.
    num, owned = assign_partitions(spec, 6, None)
    assert sum(num.values()) == 6 and all(owned)
    num, owned = assign_partitions(spec, 2, {"web": 3})
    assert num[1] == 3 and sum(len(o) for o in owned) == 6


@pytest.mark.parametrize("options", [{"loaders": 1}, {"loaders": 3, "partitions": {"web": 2, "long": 2}}])
def test_ray_digest_equals_local(ray_session, spec, local_digest, options):
    assert _digest(spec, "ray", **options) == local_digest


def test_clients_share_one_planned_stream(ray_session, tokens_spec):
    """Trainer ranks attach to one job by name; each step is planned once; TP/CP ranks share builds
    (each CP rank gets its shard); a resumed client continues bit for bit."""
    spec = tokens_spec.with_overrides(topology={"dp": 2, "tp": 2, "cp": 2})
    local = {(r, c): list(plait.Loader(spec, dp_rank=r, cp_rank=c, read_ahead=0)) for r in range(2) for c in range(2)}
    # the first creates the job, the others join it (no standby Planner: not the subject, one process fewer)
    loaders = [plait.Loader(spec, dp_rank=r, tp_rank=t, cp_rank=c, runtime="ray", job="test-job", loaders=2,
                            attach=(r, t, c) != (0, 0, 0), planner_standby=False)
               for r in range(2) for t in range(2) for c in range(2)]
    try:
        for ld in loaders:
            got = list(ld)
            want = local[(ld.dp_rank, ld.cp_rank)]
            assert len(got) == len(want) == spec.steps * 2
            for a, b in zip(got, want):
                assert a.stats["cp"]["rank"] == ld.cp_rank  # its own shard (cut by the Constructor)
                assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.sample_ids, b.sample_ids)
                assert np.array_equal(a.position_ids, b.position_ids) and np.array_equal(a.cu_seqlens, b.cu_seqlens)
        with pytest.raises(plait.PlaitError, match="DP ranks"):  # a client with another layout is refused
            plait.Loader(spec.with_overrides(topology={"dp": 4}), runtime="ray", job="test-job", attach=True)
        stats = loaders[0].runtime.stats()
        assert stats["planned"] == spec.steps  # planned once for all 8 clients
        assert len(stats["loaders"]) == 2
        # the node's one Constructor builds its 2 DP ranks (and a rank's next step) at once
        assert [c["build_threads"] for c in stats["constructors"].values()] == [2]

        # Resume mid-step from a checkpoint taken by a local client: same continuation.
        it = iter(plait.Loader(spec, dp_rank=1, cp_rank=1, read_ahead=0))
        for _ in range(5):
            next(it)
        state = it.gi_frame.f_locals["self"].state_dict()
        resumed = plait.Loader(spec, dp_rank=1, cp_rank=1, runtime="ray", job="test-job", attach=True)
        resumed.load_state_dict(state)
        rest = list(resumed)
        assert [b.sample_ids.tolist() for b in rest] == [b.sample_ids.tolist() for b in local[(1, 1)][5:]]
        resumed.close()
    finally:
        for ld in loaders:
            ld.close()
    with pytest.raises(ValueError):
        ray.get_actor("test-job/planner", namespace="plait")


def test_auto_layout_follows_measured_cost(ray_session, tmp_path):
    """loaders="auto": the probe finds the tokenized JSONL source dearer than the pre-tokenized Parquet
    ones, splits it over both loaders (a 2-CPU instance), and the stream is still the local one."""
    from helpers import make_spec, text_source, token_parquet, train_tokenizer

    tok = train_tokenizer(tmp_path / "tokenizer.json")
    text = text_source(tmp_path / "txt", fmt="jsonl", files=4, docs_per_file=200, lo=100, hi=300, tokenizer=tok)
    # Row groups of ~200k tokens: the probe times blocks on the wall clock, and a read of a 20k-token row
    # group (~1 ms) preempted for a time slice on a loaded machine measured as dear as tokenizing (CI failed
    # so once); a time slice is small beside a 200k-token read.
    ids = [token_parquet(tmp_path / f"ids{i}", name=f"ids{i}", files=2, docs_per_file=1000, row_group_size=1000,
                         lo=100, hi=300, seed=i) for i in range(2)]
    auto = plait.load_spec(make_spec([text, *ids], seq_len=256, microbatches=2, dp=2)).with_overrides(steps=6)
    rows = []
    # A tiny step time makes the demand exceed the 2 CPUs: the layout is then bounded by the cluster.
    got = _digest(auto, "ray", step_time=1e-6, on_layout=rows.extend)
    assert got == _digest(auto, "local")
    assert len(rows) == 2  # one per CPU
    assert all("txt[" in r["sources"] and "/2]" in r["sources"] for r in rows)  # split over both loaders
    assert all(float(r["us_per_1k_tokens"].split("–")[0]) > 0 for r in rows)
    names = " ".join(r["sources"] for r in rows)
    assert "ids0[" not in names and "ids1[" not in names  # cheap sources keep one partition


def test_an_elastic_resume_is_replanned_by_the_jobs_planner(ray_session, tokens_spec, monkeypatch):
    """A boundary state saved on 4 ranks without the state after its step resumes on a 2-rank Ray job:
    the job's Planner actor re-plans the saved step (`replan_after`), never the trainer, and the client
    reads exactly what a local Loader resuming the same state reads (sample ids)."""
    from plait.job import elastic

    spec = tokens_spec

    saved = boundary_state_without_next(spec)
    spec2 = spec.with_overrides(topology={"dp": 2})
    want = local_resume_ids(spec2, saved, dp_rank=1, steps=4)

    def in_trainer(*args, **kwargs):
        raise AssertionError("the trainer re-planned a step")

    monkeypatch.setattr(elastic, "replan_after", in_trainer)  # this process only: the actor has its own
    with plait.Loader(spec2, dp_rank=1, steps=4, read_ahead=0, runtime="ray", job="elastic-job", loaders=1,
                      planner_standby=False) as ray_ld:
        ray_ld.load_state_dict(saved)
        got = [mb.sample_ids.tolist() for mb in ray_ld]
    assert got == want and len(got) > 0


def test_a_constructor_builds_each_of_its_ranks_on_a_thread_of_its_own():
    """A node's Constructor serves every DP rank of the node: one build thread per rank (2 at least: a rank's
    next step beside its current one; 16 at most), so its ranks' gathers are in flight together."""
    from plait.runtime.ray.constructor_actor import MAX_BUILD_THREADS, build_threads

    assert [build_threads(n) for n in (1, 2, 8, 64)] == [2, 2, 8, MAX_BUILD_THREADS]
