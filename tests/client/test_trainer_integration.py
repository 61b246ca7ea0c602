"""What a torchrun user needs: ranks from the environment, a topology that is checked, no silent
no-op on load_state_dict, tensors only from to_torch, runtime options that are checked."""

from __future__ import annotations

import pytest

import plait
from plait.errors import PlaitError
from plait.topology import Layout, ParallelRanks, layout_for_world
from helpers import make_spec, token_parquet


@pytest.fixture
def spec(tmp_path):
    ds = token_parquet(tmp_path / "a", files=2, docs_per_file=30, row_group_size=6, lo=4, hi=40)
    s = make_spec([ds], seq_len=64, microbatches=2)
    s.pop("topology", None)  # a spec that leaves the layout to the launcher
    return s


def test_megatron_rank_order_round_trips():
    layout = Layout(dp=3, tp=2, pp=2, cp=2)
    seen = set()
    for g in range(layout.world_size):
        r = layout.ranks_of(g)
        assert layout.global_rank(r) == g
        seen.add((r.dp, r.tp, r.pp, r.cp))
    assert len(seen) == layout.world_size
    # tensor-parallel ranks are consecutive (one node), then CP, then DP, then PP
    assert layout.ranks_of(1) == ParallelRanks(dp=0, tp=1, pp=0, cp=0)
    assert layout.ranks_of(2) == ParallelRanks(dp=0, tp=0, pp=0, cp=1)
    assert layout.ranks_of(4) == ParallelRanks(dp=1, tp=0, pp=0, cp=0)
    assert layout.ranks_of(12) == ParallelRanks(dp=0, tp=0, pp=1, cp=0)


def test_world_that_does_not_divide_is_refused():
    with pytest.raises(PlaitError, match="not a multiple of tp\\*pp\\*cp"):
        layout_for_world(6, tp=4)


def test_from_torchrun_reads_ranks_and_fills_topology(spec, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    with plait.Loader.from_torchrun(spec, tp=2, steps=1) as loader:
        assert loader.spec.topology.dp == 2 and loader.spec.topology.tp == 2
        assert (loader.dp_rank, loader.tp_rank) == (1, 1)
        batches = list(loader)
    assert batches and all(b.dp_rank == 1 for b in batches)


def test_from_torchrun_lets_the_launch_decide_dp_over_the_spec(spec, monkeypatch, caplog):
    """The demo spec pins dp: 8; on 4 processes the launch's dp=4 is used (said at info), not refused."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    spec["topology"] = {"dp": 8}
    with caplog.at_level("INFO", logger="plait.loader"):
        with plait.Loader.from_torchrun(spec, steps=1, share="process") as loader:
            assert loader.spec.topology.dp == 4 and loader.dp_rank == 3
    assert any("says dp: 8" in r.message and "makes dp=4" in r.message for r in caplog.records)
    spec["topology"] = {"dp": 8, "tp": 2}
    with pytest.raises(PlaitError, match="tp=1 was passed but the spec's topology says tp: 2"):
        plait.Loader.from_torchrun(spec, tp=1)  # a stated tp/pp/cp that contradicts the call still is


def test_from_torchrun_outside_torchrun_says_so(spec, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(PlaitError, match="RANK is not set"):
        plait.Loader.from_torchrun(spec)


def test_load_state_dict_while_iterating_is_an_error(spec):
    loader = plait.Loader(spec, steps=4)
    state = loader.state_dict()
    it = iter(loader)
    next(it)
    with pytest.raises(PlaitError, match="being iterated"):
        loader.load_state_dict(state)
    it.close()
    loader.load_state_dict(state)  # after the loop: fine, and the stream restarts from it
    assert next(iter(loader)).step == 0


def test_an_option_the_runtime_does_not_take_is_named(spec):
    with pytest.raises(PlaitError, match="local runtime does not take the option\\(s\\) job, loaders"):
        plait.Loader(spec, runtime="local", loaders=2, job="x")


def test_ids_at_or_above_vocab_size_are_bad_records(tmp_path):
    ds = token_parquet(tmp_path / "v", files=1, docs_per_file=40, row_group_size=40, lo=2, hi=6, vocab=520)
    spec = make_spec([ds], seq_len=64, microbatches=2, vocab_size=500)
    with pytest.raises(PlaitError, match="outside the vocabulary \\(vocab_size 500\\)"):
        list(plait.Loader(spec, steps=1))
    spec["sources"][0]["on_error"] = "skip"
    loader = plait.Loader(spec, steps=4)
    batches = list(loader)
    assert batches and max(b.max_token_id for b in batches) < 500
    assert all(b.stats["vocab_size"] == 500 for b in batches)
    report = loader.error_report()[spec["sources"][0]["name"]]
    assert report["skipped"] > 0 and "outside the vocabulary" in report["messages"][0]


def test_torch_distributed_checkpoint_round_trip(spec, tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.stateful import Stateful

    loader = plait.Loader(spec, steps=6, read_ahead=0)
    it = iter(loader)
    consumed = [next(it) for _ in range(3)]
    it.close()
    saved = plait.DistributedCheckpoint(loader)
    assert isinstance(saved, Stateful)
    with pytest.warns(UserWarning):  # no process group: DCP runs in its single-process mode
        dcp.save({"data": saved}, checkpoint_id=str(tmp_path / "ckpt"))
    fresh = plait.Loader(spec, steps=6, read_ahead=0)
    with pytest.warns(UserWarning):
        dcp.load({"data": plait.DistributedCheckpoint(fresh)}, checkpoint_id=str(tmp_path / "ckpt"))
    rest = [(b.step, b.microbatch) for b in fresh]
    full = [(b.step, b.microbatch) for b in plait.Loader(spec, steps=6, read_ahead=0)]
    assert [(b.step, b.microbatch) for b in consumed] + rest == full


def test_a_dict_spec_with_a_relative_path_names_the_directory_it_looked_in(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = {"sources": [{"name": "x", "path": "data/*.parquet", "tokens_field": "ids"}]}
    with pytest.raises(PlaitError, match=f"current directory {tmp_path}.*base_dir"):
        plait.Loader(spec)
