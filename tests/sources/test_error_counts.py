"""One rule for bad records (plait.sources.bad_records): each bad sample counts once per epoch, whether it
failed while planning or when its media were decoded for a batch, and `error_report()` gives the whole
job's on every rank, also where each torchrun process builds only its own rank (share="process": there
`error_report(gather=True)`, a collective; `error_report()` alone is the process's own and never waits)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_spawned_ranks
from mm_data import image_bytes, llava, mm_spec

import plait
from plait.runtime import make_runtime

STEPS = 6


def source_with_two_bad_records(folder: Path) -> dict:
    """A LLaVA JSONL source: record 5's JPEG is cut after its header (it fails at gather, after planning),
    record 7's image is missing (it fails while planning)."""
    src = llava(folder, n=12, max_images=1, jsonl=True)
    recs = [json.loads(line) for line in (folder / "data.jsonl").read_text().splitlines()]
    body = image_bytes(90, 70, "JPEG", seed=11)
    (folder / recs[5]["image"]).write_bytes(body[: len(body) // 2])
    (folder / recs[7]["image"]).unlink()
    return {**src, "on_error": "skip"}


def job_run(spec_dict: dict):
    """The whole job in one process: every rank built, so its report is the job's by construction."""
    rt = make_runtime(plait.load_spec(spec_dict), "local")
    dropped, epochs = 0, set()
    try:
        for _ in range(STEPS):
            plan = rt.plan()
            for rank in range(plan.ranks):
                for mb in rt.build(plan, rank):
                    dropped += mb.stats["dropped_samples"]
                    epochs.update(int(e) for e in mb.sample_ids[:, 1])
            rt.release()
        counted = set(rt.loader.sources[0].bad.seen)
        return rt.error_report(), counted, dropped, epochs
    finally:
        rt.close()


def test_each_bad_sample_counts_once_per_epoch_wherever_it_failed(tmp_path):
    report, counted, dropped, epochs = job_run(mm_spec([source_with_two_bad_records(tmp_path / "l")]))
    late = sorted(e for _, record, e in counted if record == "5")
    early = sorted(e for _, record, e in counted if record == "7")
    assert len(epochs) >= 3, "the run must cover several epochs"
    assert len(late) == dropped >= 2 and len(set(late)) == len(late)  # one per epoch it was planned in
    assert early == list(range(len(early))) and len(early) >= len(epochs)  # every epoch planning read it in
    rep = report["llava"]
    assert rep["skipped"] == len(late) + len(early) and rep["bad_records"] == 2
    assert len(rep["messages"]) == 2 and any("record 5 (epoch" in m for m in rep["messages"])


def rank_main(rank: int, spec_dict: dict, init: str, out: str) -> None:
    """One torchrun-like trainer process loading alone: its Loader builds only its own rank. Rank 0 first
    reads its own report alone (as a trainer that prints on rank 0 only): that must return, not wait in a
    collective for rank 1 (the group's timeout turns such a wait into a failure). Then every rank gathers
    the job's report."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    own = None
    try:
        with plait.Loader(spec_dict, dp_rank=rank, share="process", steps=STEPS, read_ahead=0) as loader:
            dropped = sum(mb.stats["dropped_samples"] for mb in loader)
            if rank == 0:
                own = loader.error_report()
            report = loader.error_report(gather=True)  # a collective: every rank calls it
    finally:
        dist.destroy_process_group()
    Path(out).write_text(json.dumps({"report": report, "own": own, "dropped": dropped}))


@pytest.mark.subprocess
def test_two_processes_each_building_its_rank_report_the_whole_job(tmp_path):
    pytest.importorskip("torch.multiprocessing")
    spec = mm_spec([source_with_two_bad_records(tmp_path / "l")], dp=2)
    job, _, job_dropped, _ = job_run(spec)
    ranks = run_spawned_ranks(rank_main, spec, tmp_path)
    assert sum(r["dropped"] for r in ranks) == job_dropped >= 2
    for r in ranks:  # the job's counts, not this rank's share of the late failures nor twice the planning ones
        assert r["report"]["llava"]["skipped"] == job["llava"]["skipped"]
        assert r["report"]["llava"]["bad_records"] == job["llava"]["bad_records"] == 2
        assert set(r["report"]["llava"]["messages"]) >= set(job["llava"]["messages"])
    own = ranks[0]["own"]["llava"]  # rank 0's own report, read alone: its planning failures, its late ones
    assert own["skipped"] - ranks[0]["dropped"] == job["llava"]["skipped"] - job_dropped


REPORT_ALONE = """
import json, sys
import plait
loader = plait.Loader(plait.load_spec(json.loads(sys.argv[1])), steps=2)
list(loader)
report = loader.error_report()
print(json.dumps({"torch": "torch" in sys.modules, "bad_records": report["llava"]["bad_records"]}))
"""


@pytest.mark.subprocess
def test_a_report_outside_a_process_group_leaves_torch_unimported(tmp_path):
    """Whether the report must be gathered is asked of torch.distributed only where the trainer imported
    it (no process group exists without it): importing torch for the question cost a report ~1.5 s."""
    import subprocess
    import sys

    spec = mm_spec([source_with_two_bad_records(tmp_path / "l")], dp=1)
    done = subprocess.run([sys.executable, "-c", REPORT_ALONE, json.dumps(spec)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["torch"] is False and out["bad_records"] >= 1
