"""The batch stream is a pure function of (spec, seed, data)."""

from __future__ import annotations

import re

import pytest
import yaml

import plait
from plait import cli
from plait.runtime.local import LocalRuntime
from helpers import batch_digest, make_spec, text_source, token_jsonl, token_parquet


@pytest.fixture(scope="module")
def spec_dict(tmp_path_factory):
    root = tmp_path_factory.mktemp("det")
    a = token_parquet(root / "a", name="a", files=3, docs_per_file=10, row_group_size=4, lo=5, hi=200)
    b = text_source(root / "b", fmt="jsonl.zst", name="b", files=2, docs_per_file=12, eos=300)
    c = token_jsonl(root / "c", name="c", files=2, docs_per_file=8, compression="gz", weight=0.5)
    return make_spec([a, b, c], seq_len=128, microbatches=2, dp=2, seed=11)


def all_ranks_digest(spec, steps: int = 6, max_cached_blocks: int | None = None) -> list[str]:
    rt = LocalRuntime(plait.load_spec(spec))
    if max_cached_blocks is not None:
        rt.loader.max_cached_blocks = max_cached_blocks
    per_rank: dict[int, list] = {}
    for _ in range(steps):
        plan = rt.plan()
        for r in range(plan.ranks):
            per_rank.setdefault(r, []).extend(rt.build(plan, r))
        rt.release()
    rt.close()
    return [batch_digest(per_rank[r]) for r in sorted(per_rank)]


def test_two_runs_identical(spec_dict):
    assert all_ranks_digest(spec_dict) == all_ranks_digest(spec_dict)


def test_seed_changes_the_stream(spec_dict):
    assert all_ranks_digest(spec_dict) != all_ranks_digest({**spec_dict, "seed": 12})


def test_cache_size_does_not_change_the_stream(spec_dict):
    """Evicting decoded blocks (re-reading them) must not change a single token."""
    assert all_ranks_digest(spec_dict, max_cached_blocks=1) == all_ranks_digest(spec_dict)


def test_loader_prefetch_does_not_change_the_stream(spec_dict):
    digests = {p: batch_digest(plait.Loader(spec_dict, dp_rank=1, steps=5, read_ahead=p)) for p in (0, 1, 3)}
    assert len(set(digests.values())) == 1


def test_client_stream_equals_the_runtime_stream(spec_dict):
    """Each rank's Loader (which plans on its own) gets exactly its share of the global plan."""
    expected = all_ranks_digest(spec_dict, steps=4)
    got = [batch_digest(plait.Loader(spec_dict, dp_rank=r, steps=4, read_ahead=0)) for r in range(2)]
    assert got == expected


def test_plait_run_digest_twice(spec_dict, tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec_dict))
    outs = []
    for _ in range(2):
        assert cli.main(["run", str(path), "--digest", "--steps", "5", "--quiet"]) == 0
        outs.append(capsys.readouterr().out)
    digests = [re.findall(r"^digest: ([0-9a-f]{64})$", o, re.M) for o in outs]
    assert len(digests[0]) == 1 and digests[0] == digests[1]
    assert re.findall(r"^rank 1: [0-9a-f]{64}$", outs[0], re.M)
    assert cli.main(["run", str(path), "--digest", "--steps", "4", "--quiet"]) == 0
    assert re.findall(r"^digest: ([0-9a-f]{64})$", capsys.readouterr().out, re.M) != digests[0]
