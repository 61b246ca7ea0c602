"""`plait run`: stream a spec for every DP rank of its topology, as a job would, and report."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from plait.cli.common import console, loaders_arg, positive_int
from plait.cli.stream import print_summary, stream
from plait.errors import PlaitError
from plait.metrics import combined_digest
from plait.spec import load_spec
from plait.telemetry import json_logs

HELP = "stream a spec for every DP rank and report"
DESCRIPTION = (
    "Stream SPEC for every DP rank of its topology, as a job would, and report "
    "throughput, mixture and balance. --digest prints a sha256 of each rank's batch stream."
)


def add_arguments(p) -> None:
    p.add_argument("spec", help="the spec (YAML)")
    p.add_argument("--steps", type=positive_int, default=None, help="global steps (default: the spec's `steps`, else 100)")
    p.add_argument("--dp", type=positive_int, default=None, help="override topology.dp")
    p.add_argument("--digest", action="store_true", help="print a stable sha256 of every rank's batch stream")
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    p.add_argument("--runtime", choices=["local", "ray"], default="local", help="where the roles run")
    p.add_argument("--address", default=None, help="Ray cluster address (auto, ray://...); default: start a local one")
    p.add_argument("--dashboard", action="store_true",
                   help="ray runtime: start Ray's dashboard with the local instance (off by default: a long job's Ray "
                   "stays flat without it)")
    p.add_argument("--loaders", type=loaders_arg, default="auto",
                   help="ray runtime: SourceLoader actors, `auto` (default: from each source's measured cost and "
                   "mixture share) or a number")
    p.add_argument("--step-time", type=float, default=None, metavar="S",
                   help="ray runtime, --loaders auto: seconds per training step the loaders must keep up with "
                   "(default 1)")
    p.add_argument("--resume", metavar="STATE", help="start from a data state saved with --save-state")
    p.add_argument("--save-state", metavar="PATH", help="write the data state after the last step (JSON)")
    p.add_argument("--allow-spec-change", action="store_true",
                   help="with --resume: continue under a changed mixture or set of sources (unchanged sources "
                   "continue exactly, added ones start at their beginning; changed files or seed are refused)")
    p.add_argument("--report", metavar="PATH", help="write the achieved share per source over 100-step windows "
                   "against its schedule, and the weight changes: PATH (.json) and a PNG beside it")
    p.add_argument("--steps-log", metavar="PATH", help="write one JSON line per step (balance, tokens per source, "
                   "weights) to PATH as it runs; the driver itself keeps only running totals and the last 10,000 "
                   "steps")
    p.add_argument("--quiet", action="store_true", help="no progress bar or tables")
    p.add_argument("--metrics-port", type=int, default=None, metavar="P",
                   help="serve Prometheus metrics on 127.0.0.1:P/metrics while running (watch with `plait top`)")
    p.add_argument("--log-json", action="store_true", help="events (failures, recoveries, ...) as JSON lines on stderr")
    p.add_argument("--autoscale", action="store_true",
                   help="ray runtime: re-partition sources over more or fewer SourceLoaders while running, following "
                   "the measured demand (the stream does not change); prints the events and the layout over time")
    p.add_argument("--autoscale-interval", type=float, default=None, metavar="S",
                   help="with --autoscale: seconds per control interval (default 2)")
    p.add_argument("--max-loader-cpus", type=float, default=None, metavar="N",
                   help="with --autoscale: at most this many loader CPUs (default: the cluster's)")
    p.add_argument("--plot", metavar="PATH", help="ray runtime: draw SourceLoaders per source and waits per step "
                   "over time (PNG)")


def run(args) -> int:
    spec = load_spec(args.spec)
    if args.dp:
        spec = spec.with_overrides(topology={"dp": args.dp})
    if args.metrics_port is not None:
        spec = spec.with_overrides(metrics={"port": args.metrics_port})
        console.print(f"metrics: http://{spec.metrics.address}:{args.metrics_port}/metrics "
                      f"(plait top {spec.metrics.address}:{args.metrics_port})")
    if args.log_json:
        json_logs()
    resume = read_state(args.resume) if args.resume else None
    options = {}
    if args.runtime == "ray":
        options = {k: v for k, v in (("address", args.address), ("loaders", args.loaders),
                                     ("step_time", args.step_time)) if v is not None}
        if args.dashboard:
            options["dashboard"] = True
        if not args.quiet:
            options["on_layout"] = print_layout
        autoscale = autoscale_option(args)
        if autoscale is not None:
            options["autoscale"] = autoscale
    elif args.autoscale or args.plot:
        raise PlaitError("--autoscale and --plot need --runtime ray (the local runtime has one loader)")
    summary = stream(
        spec, steps=args.steps or spec.steps or 100, runtime=args.runtime, progress=not args.quiet,
        resume=resume, save_state=args.save_state, runtime_options=options,
        allow_spec_change=args.allow_spec_change, outputs={"report": args.report, "steps_log": args.steps_log},
    )
    if not args.quiet:
        print_summary(spec, summary, console=Console())
        print_scaling(summary.get("scaling") or {})
    if args.plot:
        plot_scaling(summary.get("scaling") or {}, args.plot)
        console.print(f"scaling plot: {args.plot}")
    if args.digest:
        for rank, d in summary["digests"].items():
            print(f"rank {rank}: {d}")
        print(f"digest: {combined_digest(summary['digests'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


def print_layout(rows: list[dict]) -> None:
    """The ray runtime's loader layout: which sources and partitions each SourceLoader owns."""
    table = Table(title="SourceLoaders (ray)")
    for col in ("loader", "sources [partitions/of] (measured µs per 1k tokens)", "demand (cores)"):
        table.add_column(escape(col), justify="left" if col.startswith("sources") else "right")
    for r in rows:
        dem = "-" if math.isnan(r["demand"]) else f"{r['demand']:.3f}"
        table.add_row(str(r["loader"]), escape(r["sources"]), dem)
    console.print(table)


def autoscale_option(args) -> dict | None:
    """RayOptions.autoscale from --autoscale and its knobs (None: off); a knob without --autoscale is refused."""
    knobs = {k: v for k, v in (("interval_s", args.autoscale_interval), ("max_loader_cpus", args.max_loader_cpus))
             if v is not None}
    if not args.autoscale:
        if knobs:
            raise PlaitError("--autoscale-interval and --max-loader-cpus need --autoscale")
        return None
    return knobs


def print_scaling(report: dict) -> None:
    """The ray runtime's rescaling events and the layout over time (nothing when it never changed)."""
    events, timeline = report.get("events") or [], report.get("timeline") or []
    if not events and not timeline:
        return
    if events:
        table = Table(title="SourceLoader rescaling")
        for col in ("t (s)", "step", "kind", "loaders", "partitions", "reason"):
            table.add_column(col, justify="right" if col in ("t (s)", "step", "loaders") else "left")
        for e in events:
            parts = " ".join(f"{n}:{k}" for n, k in e["partitions"].items())
            table.add_row(f"{e['t']:.1f}", str(e["step"]), e["kind"], str(e["loaders"]), escape(parts),
                          escape(e["reason"]))
        console.print(table)
    if timeline:
        table = Table(title="layout over time (one row per change of loaders, and the last interval)")
        for col in ("t (s)", "step", "loaders", "loaders per source", "waited (s)", "steps", "max busy"):
            table.add_column(col, justify="left" if col == "loaders per source" else "right")
        shown = [r for i, r in enumerate(timeline) if i == 0 or i == len(timeline) - 1
                 or r["loaders_per_source"] != timeline[i - 1]["loaders_per_source"]]
        for r in shown:
            per = " ".join(f"{n}:{v:g}" for n, v in r["loaders_per_source"].items())
            table.add_row(f"{r['t']:.1f}", str(r["step"]), str(r["loaders"]), escape(per), f"{r['wait_s']:.3f}",
                          str(r["steps"]), f"{max(r['busy'], default=0):.0%}")
        console.print(table)


def plot_scaling(report: dict, path: str) -> None:
    """Loaders per source, and the seconds waited per consumed step, over time (PNG at `path`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = report.get("timeline") or []
    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    if timeline:
        t = [r["t"] for r in timeline]
        for name in timeline[0]["loaders_per_source"]:
            a.step(t, [r["loaders_per_source"][name] for r in timeline], where="post", label=name)
        a.step(t, [r["loaders"] for r in timeline], where="post", color="black", linestyle="--", label="all loaders")
        b.plot(t, [r["wait_s"] / max(1, r["steps"]) for r in timeline], marker=".")
    for e in report.get("events") or []:
        for ax in (a, b):
            ax.axvline(e["t"], color="grey", alpha=0.4)
    a.set_ylabel("SourceLoaders")
    a.set_title("SourceLoaders per source (events: grey lines)" if timeline else "no autoscaling timeline "
                "(run with --autoscale)")
    if timeline:
        a.legend(loc="upper left", fontsize="small")
    b.set_ylabel("waited per step (s)")
    b.set_xlabel("seconds since the job started")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def read_state(path: str) -> dict:
    """A state file (--save-state output or a Loader.state_dict()), or a PlaitError saying what is wrong."""
    try:
        state = json.loads(Path(path).read_text())
    except OSError as e:
        raise PlaitError(f"cannot read the state file {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlaitError(f"the state file {path} is not JSON ({e})") from None
    if not isinstance(state, dict):
        raise PlaitError(f"the state file {path} holds a {type(state).__name__}, not a plait state (a JSON object)")
    return state
