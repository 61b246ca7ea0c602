"""Auto-partitioning and scaling (plait.runtime.placement, plait.runtime.scaling): the pure layout function, the cost probe, and a
bad Ray address failing fast. No Ray instance here (the Ray end-to-end test is in test_ray_runtime.py)."""

from __future__ import annotations

import socket
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

import plait
from helpers import make_spec, text_source, token_parquet, train_tokenizer
from plait.runtime.placement import demand_of, plan_layout
from plait.runtime.scaling import describe, format_layout, probe_costs


def _pairs(layout):
    return [pair for owned in layout.owned for pair in owned]


def test_expensive_source_gets_more_partitions_and_loaders():
    # one source needs 3 cores, three need almost nothing; 8 CPUs, 8 files each
    layout = plan_layout([3.0, 0.01, 0.02, 0.01], [8, 8, 8, 8], cpus=8)
    assert layout.loaders == 7  # ceil(3.04 / 0.5)
    assert layout.num_partitions[0] == 7 and all(layout.num_partitions[i] == 1 for i in (1, 2, 3))
    holders = {k for k, owned in enumerate(layout.owned) if any(s == 0 for s, _ in owned)}
    assert len(holders) == 7  # spread over every loader
    cheap = {k for k, owned in enumerate(layout.owned) if any(s != 0 for s, _ in owned)}
    assert len(cheap) <= 3
    # the busiest loader carries about a fair share, not a whole expensive source
    assert max(layout.loader_demand(k) for k in range(layout.loaders)) < 3.0 / 7 + 0.05


def test_many_cheap_sources_share_few_loaders():
    layout = plan_layout([0.001] * 64, [4] * 64, cpus=32)
    assert layout.loaders == 1 and set(layout.num_partitions.values()) == {1}
    assert sorted(_pairs(layout)) == [(i, 0) for i in range(64)]
    # 64 sources together needing ~3 cores: a handful of loaders, each source still one partition
    layout = plan_layout([0.05] * 64, [4] * 64, cpus=32)
    assert layout.loaders == 7 and set(layout.num_partitions.values()) == {1}
    assert sorted(len(o) for o in layout.owned) in ([9] * 6 + [10], [9, 9, 9, 9, 9, 9, 10])


def test_bounds_cpus_files_and_fixed_partitions():
    # demand far beyond the cluster: bounded by its CPUs
    assert plan_layout([100.0, 1.0], [64, 64], cpus=4).loaders == 4
    # at most one loader per partition: a single-file source cannot be split
    layout = plan_layout([10.0], [1], cpus=16)
    assert layout.loaders == 1 and layout.num_partitions == {0: 1}
    # fixed partitions are honoured; the others still follow demand
    layout = plan_layout([2.0, 0.1], [8, 8], cpus=8, partitions={1: 3})
    assert layout.num_partitions[1] == 3 and layout.num_partitions[0] >= 2
    assert sorted(_pairs(layout)) == sorted((s, p) for s, n in layout.num_partitions.items() for p in range(n))


@given(
    demand=st.lists(st.floats(min_value=0.0, max_value=20.0, allow_nan=False), min_size=1, max_size=40),
    files=st.lists(st.integers(min_value=1, max_value=16), min_size=40, max_size=40),
    cpus=st.integers(min_value=1, max_value=64),
)
def test_layout_properties(demand, files, cpus):
    files = files[: len(demand)]
    layout = plan_layout(demand, files, cpus)
    pairs = _pairs(layout)
    # every (source, partition) owned exactly once
    assert sorted(pairs) == sorted((s, p) for s, n in layout.num_partitions.items() for p in range(n))
    assert len(pairs) == len(set(pairs))
    assert set(layout.num_partitions) == set(range(len(demand)))
    assert all(1 <= layout.num_partitions[s] <= files[s] for s in range(len(demand)))
    # 1 <= loaders <= CPUs, at most one per partition, none idle
    assert 1 <= layout.loaders <= max(1, cpus) and layout.loaders <= len(pairs)
    assert all(layout.owned)
    # deterministic
    again = plan_layout(list(demand), list(files), cpus)
    assert again.owned == layout.owned and again.num_partitions == layout.num_partitions
    # a more expensive source never gets fewer partitions than a cheaper one with as many files
    for a in range(len(demand)):
        for b in range(len(demand)):
            if demand[a] > demand[b] and files[a] >= files[b]:
                assert layout.num_partitions[a] >= layout.num_partitions[b]


def test_probe_measures_tokenizing_dearer_than_token_ids(tmp_path):
    tok = train_tokenizer(tmp_path / "tokenizer.json")
    text = text_source(tmp_path / "txt", fmt="jsonl", files=2, docs_per_file=400, lo=200, hi=400,
                       tokenizer=tok)
    # Large id blocks: reading ids costs a few ns a token, tokenizing text a few hundred.
    ids = token_parquet(tmp_path / "ids", files=2, docs_per_file=2000, row_group_size=1000, lo=200, hi=400)
    spec = plait.load_spec(make_spec([text, ids], seq_len=1024, microbatches=4, dp=2))
    # A probe is a timing: on a busy machine one can be descheduled mid-read, so take the cheapest of three.
    probes = [probe_costs(spec) for _ in range(3)]
    cost = [min(p[0][i] for p in probes) for i in range(2)]
    files = probes[0][1]
    assert files == [2, 2] and all(c > 0 for c in cost)
    assert cost[0] > 3 * cost[1], cost  # tokenizing text vs reading ids
    demand = demand_of(spec, cost, step_time=1.0)
    assert demand[0] == pytest.approx(cost[0] * 0.5 * 2 * 4 * 1024)
    layout = plan_layout([d * 1e4 for d in demand], files, cpus=4)
    layout.cost = cost
    assert layout.num_partitions == {0: 2, 1: 1} and layout.loaders == 3  # the ids source is not split
    assert sorted(layout.owned) == [[(0, 0)], [(0, 1)], [(1, 0)]]
    rows = describe(layout, spec.source_names)
    assert len(rows) == layout.loaders and "µs per 1k tokens" in format_layout(layout, spec.source_names)[0]


@pytest.mark.ray  # joins (tries to) a Ray cluster: it must run before the session's instance starts in its process
def test_bad_ray_address_fails_fast():
    pytest.importorskip("ray")
    from plait.runtime.ray import RayRuntime, check_reachable

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    with pytest.raises(plait.PlaitError, match="cannot reach the Ray cluster"):
        check_reachable(f"ray://127.0.0.1:{port}")
    import ray

    if ray.is_initialized():  # pragma: no cover - another module's instance: the address is ignored then
        pytest.skip("a Ray instance is running in this process")
    spec = make_spec([{"name": "a", "path": "/nonexistent/*.parquet", "tokens_field": "input_ids"}])
    with pytest.raises(plait.PlaitError, match="cannot reach the Ray cluster"):
        RayRuntime(plait.load_spec(spec), address=f"127.0.0.1:{port}")
    assert time.perf_counter() - t0 < 10
    assert not ray.is_initialized()
    check_reachable("auto")  # left to Ray
    check_reachable(None)


def test_loaders_option_validated():
    pytest.importorskip("ray")
    from plait.runtime.ray import loaders_option

    assert loaders_option(None) == "auto" and loaders_option("auto") == "auto" and loaders_option(3) == 3
    for bad in (0, -1, "many", 1.5):
        with pytest.raises(plait.PlaitError, match="loaders must be"):
            loaders_option(bad)


def test_cli_loaders_option_and_layout_table(capsys):
    from plait import cli
    from plait.cli.run import print_layout
    from plait.runtime.placement import LoaderLayout

    parser = cli.build_parser()
    assert parser.parse_args(["run", "s.yaml", "--runtime", "ray"]).loaders == "auto"
    assert parser.parse_args(["run", "s.yaml", "--runtime", "ray", "--loaders", "3"]).loaders == 3
    for bad in ("0", "many"):
        with pytest.raises(SystemExit):
            parser.parse_args(["run", "s.yaml", "--runtime", "ray", "--loaders", bad])
    layout = LoaderLayout({0: 2, 1: 1}, [[(0, 0), (1, 0)], [(0, 1)]], [1.0, 0.1], [2e-6, 3e-8])
    print_layout(describe(layout, ["txt", "ids"]))
    err = capsys.readouterr().err
    assert "txt[0/2] (2000), ids (30)" in err and "txt[1/2] (2000)" in err and "0.600" in err


def test_step_time_and_partition_names_validated(tmp_path):
    pytest.importorskip("ray")
    from plait.runtime.placement import fixed_partitions
    from plait.runtime.ray import RayRuntime

    ids = token_parquet(tmp_path / "ids", name="ids", files=2, docs_per_file=20)
    spec = plait.load_spec(make_spec([ids], seq_len=64, microbatches=2, dp=1))
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(plait.PlaitError, match="step_time must be"):
            RayRuntime(spec, step_time=bad)  # refused before any Ray instance starts
    assert fixed_partitions(spec, 3) == {0: 3} and fixed_partitions(spec, {"ids": 2}) == {0: 2}
    assert fixed_partitions(spec, None) == {}
    with pytest.raises(plait.PlaitError, match="unknown sources"):
        fixed_partitions(spec, {"nope": 2})


def test_probe_times_decoding_an_image_sources_pixels(tmp_path, monkeypatch):
    """Planning reads image sizes from headers only, but a loader decodes every delivered image: the probe
    must time that decoding, or the auto layout sizes a photo source like text (one loader, starved)."""
    from mm_data import mm_spec, webdataset

    from plait.sources import Source

    spec = plait.load_spec(mm_spec([webdataset(tmp_path / "wds", shards=2, per_shard=12)]))
    decoded = []
    real = Source.image_pixels

    def counting(self, block, image):
        decoded.append(image)
        return real(self, block, image)

    monkeypatch.setattr(Source, "image_pixels", counting)
    cost, files = probe_costs(spec)
    assert files == [2] and cost[0] > 0
    assert decoded, "the probe decoded no image"
