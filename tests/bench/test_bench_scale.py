"""`python -m benchmarks.scale` at a reduced size: the real Planner and placement over synthetic metadata give
sane scaling figures (plan time, bytes between roles, actors, memory, connections)."""

from __future__ import annotations

import json

import numpy as np

from benchmarks import scale as scale_module  # the benchmark under test
from benchmarks.common import main as bench_main
from benchmarks.synthetic import SyntheticMetadata, SyntheticSources

DP, SOURCES, STEPS = 64, 50, 3


def test_synthetic_metadata_is_deterministic_and_walks_every_block():
    cat = SyntheticSources(4, files=2, blocks_per_file=3, block_tokens=1 << 16)
    a, b = SyntheticMetadata(cat), SyntheticMetadata(cat)
    for s in range(4):
        key, seen = a.first_key(s), []
        while key[0] == 0:
            m1, m2 = a.block_meta(s, key), b.block_meta(s, key)
            assert np.array_equal(m1.lengths, m2.lengths) and np.array_equal(m1.rows, m2.rows)
            assert (m1.lengths > 0).all() and np.all(np.diff(m1.positions) > 0)
            seen.append(key)
            key = m1.next_key
        assert len(seen) == int(cat.num_files[s]) * 3  # one epoch: every block of every file once
    # another epoch: the same documents of a block, in another order
    e0, e1 = a.block_meta(0, (0, 0, 0)), a.block_meta(0, (1, 0, 0))
    if e0.shard == e1.shard:
        assert sorted(e0.lengths.tolist()) == sorted(e1.lengths.tolist())


def test_bench_scale_reduced_size(tmp_path):
    out = tmp_path / "scale.json"
    rc = bench_main(scale_module, ["--dp", str(DP), "--sources", str(SOURCES), "--steps", str(STEPS),
                                        "--step-time", "0.05", "--quiet", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    fig = {r["figure"].strip(): r for r in data["rows"]}
    per = data["per_step"]
    # the standby receives a diff of each step's state: never more than the state itself, and not nothing
    assert 0 < fig["Planner -> standby: state diff"]["value"] <= max(per["state_bytes"])
    for r in data["rows"]:
        assert r["how"] in ("given", "measured", "computed") and r["unit"] and r["note"]

    assert fig["GPUs"]["value"] == DP * 8 and fig["sources"]["value"] == SOURCES
    # thin clients fetch the state at a checkpoint (every process once); Ray-attached trainers every step
    state = fig["data state (JSON)"]["value"]
    assert fig["Planner -> trainers: data state"]["unit"] == "B/checkpoint"
    assert fig["Planner -> trainers: data state"]["value"] == state * DP * 8
    assert fig["Ray-attached trainers instead"]["value"] == state * DP
    assert fig["tokens per step"]["value"] == DP * 8 * 8192
    # the real Planner planned every step: nearly full steps, balanced, in measurable time
    assert len(per["plan_cpu_ms"]) == STEPS and min(per["plan_cpu_ms"]) > 0
    assert fig["plan time per step"]["value"] > 0
    assert 0 <= fig["drawing (mixture, chunks)"]["value"] <= fig["plan time per step"]["value"]
    assert min(per["tokens"]) > 0.95 * DP * 8 * 8192 and max(per["max_over_lb"]) < 1.05
    # metadata flows: every source's first block at step 1, then only new blocks
    assert per["meta_blocks"][0] == SOURCES and per["meta_bytes"][0] > 0
    assert max(per["meta_bytes"][1:]) < per["meta_bytes"][0]
    assert fig["loaders -> Planner: block metadata"]["value"] > 0
    rank_plans = fig["Planner -> Constructors: rank plans"]["value"]
    assert 0 < rank_plans < 200 * max(per["items"])  # a few int64 columns per chunk, not payloads
    assert fig["loaders -> Constructors: payloads"]["value"] == DP * 8 * 8192 * 4
    # the data state is small and flat in steps: cursors (about 100 B per source) plus a bounded carry
    cursors = per["cursor_state_bytes"]
    assert cursors[-1] < 300 * SOURCES and cursors[-1] <= 1.05 * cursors[0]
    assert fig["data state (JSON)"]["value"] < 50_000
    # actors: one Planner, loaders from the measured demand, one Constructor per node (8 GPUs, TP 8)
    loaders = fig["SourceLoaders"]["value"]
    assert 1 <= loaders <= SOURCES * 16 and fig["Planner"]["value"] == 2
    assert fig["Constructors"]["value"] == DP and fig["shadows"]["value"] == 0
    assert data["sources_per_loader"] == SOURCES / loaders
    # memory: measured Planner growth holds the block metadata; loaders hold live blocks
    assert fig["of which block metadata held"]["value"] > 0
    assert fig["SourceLoader: live blocks (busiest)"]["value"] > 0
    # connections: each node talks to the Planner and at most every loader, at least one
    conn = fig["per node (Constructor -> loaders + Planner)"]["value"]
    assert 2 <= conn <= loaders + 1 and max(per["conn_max"]) <= loaders
    assert 1 <= fig["per loader (nodes it serves)"]["value"] <= DP
