"""`plait jobs`: list the plait jobs running on a Ray cluster; `plait jobs stop NAME` ends one."""

from __future__ import annotations

import os
import time

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from plait.cli.common import table_console
from plait.errors import PlaitError

HELP = "list the plait jobs running on Ray (`plait jobs stop NAME` ends one)"
DESCRIPTION = (
    "List the plait jobs running on a Ray cluster: name, age, attached trainers, idle time and the "
    "resident memory of their actors, and the address of the job's metrics endpoint (`plait top JOB` reads it; "
    "set by `metrics: {port: ...}` in the spec). `plait jobs stop NAME` ends a job: its Constructors, SourceLoaders, "
    "shadows and Planner, and their object-store data. A job also ends by itself when every trainer has "
    "closed its Loader, or when no trainer was seen for its job_idle_timeout."
)


def add_arguments(p) -> None:
    p.add_argument("action", nargs="?", choices=["list", "stop"], default="list",
                   help="list (default) or stop")
    p.add_argument("name", nargs="?", help="stop: the job's name")
    p.add_argument("--address", default="auto", help="the Ray cluster (default: auto, the running one)")


def run(args) -> int:
    if args.action == "stop" and not args.name:
        raise PlaitError("`plait jobs stop` needs the job's name (`plait jobs` lists them)")
    if args.action == "list" and args.name:
        raise PlaitError(f"unexpected argument {args.name!r}: did you mean `plait jobs stop {args.name}`?")
    from plait.runtime.ray import jobs

    joined = join_cluster(args.address)
    try:
        if args.action == "stop":
            n = jobs.stop_job(args.name)
            Console().print(f"stopped job {escape(args.name)} ({n} named actor{'' if n == 1 else 's'} ended)",
                            highlight=False)
        else:
            print_jobs(jobs.list_jobs(), args.address)
    finally:
        if joined:
            from plait.runtime.ray.common import ray_module

            ray_module().shutdown()
    return 0


def join_cluster(address: str) -> bool:
    """Connect this process to the cluster at `address` (True), or use the connection it has (False)."""
    from plait.runtime.ray import NAMESPACE, check_reachable
    from plait.runtime.ray.common import ray_module
    from plait.runtime.ray.instance import StderrCapture, explain_join_failure

    ray = ray_module()
    if ray.is_initialized():
        return False
    if address == "auto":  # Ray retries a stale address for minutes: check it answers first
        running = running_cluster()
        try:
            if running is not None:
                check_reachable(running)
        except PlaitError:
            running = None
        if running is None:
            raise PlaitError("no Ray cluster is running on this machine, so no plait job either (start one with "
                             "`ray start --head`, or pass --address to look at another cluster)")
    else:
        check_reachable(address)
    with StderrCapture() as said:
        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
            error = None
        except (ConnectionError, RuntimeError) as e:
            error = e
            said.failed()
    if error is None:
        return True
    raise PlaitError(explain_join_failure(address, error, said.text) + said.where_said()) from None


def running_cluster() -> str | None:
    """The address `--address auto` means: RAY_ADDRESS, else the one Ray records for this machine's
    latest cluster (`<RAY_TMPDIR or /tmp>/ray/ray_current_cluster`); None when neither is set."""
    from plait.runtime.ray.instance import recorded_cluster

    return os.environ.get("RAY_ADDRESS") or recorded_cluster()


def print_jobs(rows: list[dict], address: str) -> None:
    from plait.runtime.ray.planner_actor import format_age

    out = table_console()
    if not rows:
        out.print(f"no plait jobs are running on the cluster at {escape(address)}", highlight=False)
        return
    table = Table(title="plait jobs")
    for col in ("job", "age", "trainers", "idle", "idle timeout", "actors", "memory (RSS)", "step", "metrics"):
        table.add_column(col, justify="left" if col == "job" else "right",
                         overflow="fold" if col == "metrics" else "ellipsis")  # an address is never cut short
    for r in rows:
        if r["state"] != "running":
            table.add_row(escape(r["job"]), "-", "-", "-", "-", str(r["named_actors"]), "-", escape(r["state"]), "-")
            continue
        timeout = r.get("idle_timeout")
        table.add_row(escape(r["job"]), format_age(time.time() - r["started"]), str(r["clients"]),
                      format_age(r["idle_s"]), format_age(timeout) if timeout else "never",
                      f"{r['actors']}/{r['actors_asked']}", f"{r['rss'] / 2**20:.0f} MiB", str(r["step"]),
                      escape(r.get("metrics") or "-"))
    out.print(table)
