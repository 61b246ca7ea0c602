"""The job's error report from a trainer process, whatever builds its batches.

One rule for counting bad records (plait.sources.bad_records): each bad sample once per epoch, over the
whole job. A runtime whose roles serve the whole job reports that already: ray (the Planner merges every
loader's report), a thin client of `plait serve`, and node-shared local on a single node (its host builds
every rank). Where the job's batches are built in several places that never talk -- every torchrun
process loading alone (`share="process"`), or one data plane per node on several nodes -- each place
knows only the records it read and the media it decoded, so the trainer's process group gathers their
reports (one `all_gather_object`) and merges them: then `error_report()` is a collective, called on every
rank, and gives every rank the same report.
"""

from __future__ import annotations

import os

from plait.sources.bad_records import merge_reports


def partial_processes(runtime_kind: str) -> bool:
    """Whether this process's report may miss what other processes of the job met (module docstring):
    the local runtime in a job of several processes, or node-shared data planes on several nodes."""
    dist = _initialized_dist()
    if dist is None or dist.get_world_size() < 2:
        return False
    if runtime_kind == "local":
        return True
    if runtime_kind == "node":
        return dist.get_world_size() > int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return False


def job_error_report(report: dict, runtime_kind: str) -> dict:
    """{source: {"skipped", "bad_records", "messages"}}: `report` (this process's runtime's, with its `records`), merged
    with every other process's when they are partial (a collective then), without the records."""
    if partial_processes(runtime_kind):
        dist = _initialized_dist()
        reports: list = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)
        report = merge_reports(reports)
    kept = ("skipped", "bad_records", "messages", "placeholder_documents")
    return {name: {k: r[k] for k in kept if k in r} for name, r in report.items()}


def _initialized_dist():
    """torch.distributed when torch is installed and a process group is up; None otherwise."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None
