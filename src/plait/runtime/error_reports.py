"""The job's error report from a trainer process, whatever builds its batches.

One rule for counting bad records (plait.sources.bad_records): each bad sample once per epoch, over the
whole job. A runtime whose roles serve the whole job reports that already: ray (the Planner merges every
loader's report), a thin client of `plait serve`, and node-shared local on a single node (its host builds
every rank). Where the job's batches are built in several places that never talk -- every torchrun
process loading alone (`share="process"`), or one data plane per node on several nodes -- each place
knows only the records it read and the media it decoded. There `error_report(gather=True)` gathers the
reports over the trainer's process group (one `all_gather_object`) and merges them: a collective, so it
must be called on every rank, and it gives every rank the same report. The gather is opt-in because a
collective that one rank alone enters (a report printed on rank 0 only, the usual place) waits for the
others forever; without it a partial report is this process's own, and says so once in the log.
"""

from __future__ import annotations

import logging
import os
import sys

from plait.sources.bad_records import merge_reports

log = logging.getLogger("plait.data")
_warned_partial = False  # one warning per process: a report read every step would repeat it every step


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


def job_error_report(report: dict, runtime_kind: str, gather: bool = False) -> dict:
    """{source: {"skipped", "bad_records", "messages"}}: `report` (this process's runtime's, with its
    `records`), without the records; with `gather`, merged with every other process's when they are
    partial (a collective then: every rank must call it)."""
    if partial_processes(runtime_kind):
        if gather:
            dist = _initialized_dist()
            reports: list = [None] * dist.get_world_size()
            dist.all_gather_object(reports, report)
            report = merge_reports(reports)
        else:
            _warn_partial()
    kept = ("skipped", "bad_records", "messages", "placeholder_documents")
    return {name: {k: r[k] for k in kept if k in r} for name, r in report.items()}


def _warn_partial() -> None:
    global _warned_partial
    if not _warned_partial:
        _warned_partial = True
        log.warning("error_report() holds only the bad records this process met: this job's batches are built "
                    "by several processes; call error_report(gather=True) on every rank for the whole job's")


def _initialized_dist():
    """torch.distributed when a process group is up; None otherwise. Only where the trainer imported it:
    no process group exists without it, and importing torch to find that out cost a report ~1.5 s of CPU."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None
