"""`plait top`: a live terminal view of a running job, from its Prometheus endpoints.

It scrapes `/metrics` of each address it is given (a `plait run --metrics-port P` process, every
trainer process of a local-runtime job — ports P, P+1, … — or a ray job's endpoint) once a second and
shows rates between two scrapes: tokens and samples per second per source, records skipped, the
loader's buffer and busy ratio (per loader on ray), steps planned and the last step's balance and fill,
and the share of time each rank waited for data. An argument without `:port` names a ray job: its
Planner is asked for its endpoint (joining the cluster at `--address`, as `plait jobs` does).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from plait.errors import PlaitError

HELP = "live view of a running job: sources, loaders, ranks waiting, balance (from its /metrics)"
DESCRIPTION = (
    "Scrape the Prometheus endpoint(s) of a running job (plait run --metrics-port P, or every trainer process "
    "of a job with `metrics: {port: P}`) every second and show per-source rates, loaders, waits and balance. "
    "An argument without `:port` is a ray job's name: its Planner's endpoint is scraped."
)


def add_arguments(p) -> None:
    p.add_argument("addresses", nargs="+", metavar="ADDRESS", help="host:port of a /metrics endpoint (several: one "
                   "per process), or the name of a ray job (`plait jobs` lists them)")
    p.add_argument("--address", dest="ray_address", default="auto", help="the Ray cluster of a job named as ADDRESS "
                   "(default: auto, the running one)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p.add_argument("--once", action="store_true", help="print one view (rates over one interval) and exit")


@dataclass
class Sample:
    """The figures of one scrape, summed over endpoints: {(metric, labels) -> value}."""

    at: float
    values: dict[tuple[str, tuple], float] = field(default_factory=dict)

    def get(self, name: str, **labels) -> float:
        return self.values.get((name, tuple(sorted(labels.items()))), 0.0)

    def series(self, name: str, label: str) -> dict[str, float]:
        """{value of `label`: the sum of the series of `name` with it} (summed over other labels)."""
        out: dict[str, float] = {}
        for (metric, labels), v in self.values.items():
            key = dict(labels).get(label)
            if metric == name and key is not None:
                out[key] = out.get(key, 0.0) + v
        return out

    def total(self, name: str) -> float:
        """The sum of every series of `name`, whatever its labels."""
        return sum(v for (metric, _), v in self.values.items() if metric == name)


def is_endpoint(address: str) -> bool:
    """A URL or `host:port`; anything else names a ray job."""
    if address.startswith(("http://", "https://")):
        return True
    _, sep, port = address.rpartition(":")
    return bool(sep) and port.isdigit()


def resolve(addresses: list[str], ray_address: str = "auto") -> list[str]:
    """Endpoints as given; a job's name becomes its Planner's metrics address (asked on the cluster)."""
    jobs = [a for a in addresses if not is_endpoint(a)]
    if not jobs:
        return list(addresses)
    from plait.cli.jobs import join_cluster
    from plait.runtime.ray.common import NAMESPACE, get, planner_name, ray_module

    joined = join_cluster(ray_address)
    ray = ray_module()
    found = {}
    try:
        for job in jobs:
            try:
                planner = ray.get_actor(planner_name(job), namespace=NAMESPACE)
                found[job] = get(planner.metrics_address.remote(), timeout=30)
            except (ValueError, ray.exceptions.RayError):
                raise PlaitError(f"no job named {job!r} answers on the Ray cluster (`plait jobs` lists them; "
                                 "an endpoint is host:port)") from None
            if not found[job]:
                raise PlaitError(f"job {job!r} serves no metrics: set `metrics: {{port: 0}}` (or a port) in its spec")
    finally:
        if joined:
            ray.shutdown()
    return [found.get(a, a) for a in addresses]


def scrape(addresses: list[str], timeout: float = 2.0) -> Sample:
    sample = Sample(time.perf_counter())
    for address in addresses:
        url = address if address.startswith("http") else f"http://{address}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                text = response.read().decode()
        except (urllib.error.URLError, OSError) as e:
            raise PlaitError(f"cannot read metrics at {url}: {getattr(e, 'reason', e)} (is the job running with "
                             "a metrics port?)") from None
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                sample.values[key] = sample.values.get(key, 0.0) + s.value
    return sample


def render(before: Sample, now: Sample) -> Group:
    dt = max(now.at - before.at, 1e-9)
    sources = Table(title="sources", title_justify="left")
    for col in ("source", "tokens/s", "samples/s", "tokens total", "skipped"):
        sources.add_column(col, justify="left" if col == "source" else "right")
    skipped = now.series("plait_source_skipped_records", "source")
    for name, total in sorted(now.series("plait_source_tokens_total", "source").items()):
        rate = (total - before.get("plait_source_tokens_total", source=name)) / dt
        srate = (now.get("plait_source_samples_total", source=name)
                 - before.get("plait_source_samples_total", source=name)) / dt
        sources.add_row(name, f"{rate:,.0f}", f"{srate:,.1f}", f"{total:,.0f}", f"{skipped.get(name, 0):.0f}")
    job = Table(title="job", title_justify="left", show_header=False)
    job.add_column("figure")
    job.add_column("value", justify="right")
    steps = now.get("plait_steps_planned_total")
    job.add_row("steps planned (per s)", f"{steps:,.0f} ({(steps - before.get('plait_steps_planned_total')) / dt:.2f})")
    job.add_row("last step: max rank cost / lower bound", f"{now.get('plait_step_max_over_lower_bound'):.4f}")
    job.add_row("last step: fill (1 - padding)", f"{now.get('plait_step_fill_ratio'):.4f}")
    busy = now.series("plait_loader_busy_ratio", "loader")
    job.add_row("loader buffer", f"{now.total('plait_loader_buffer_bytes') / 2**20:,.1f} MiB")
    job.add_row("loader busy ratio" + (" (mean)" if busy else ""),
                f"{sum(busy.values()) / len(busy) if busy else now.get('plait_loader_busy_ratio'):.3f}")
    ranks = Table(title="ranks", title_justify="left")
    ranks.add_column("rank")
    ranks.add_column("waiting for data (share of time)", justify="right")
    waits = now.series("plait_rank_wait_seconds_total", "rank")
    for rank, total in sorted(waits.items(), key=lambda kv: int(kv[0])):
        share = (total - before.get("plait_rank_wait_seconds_total", rank=rank)) / dt
        ranks.add_row(rank, f"{share:.1%}")
    if not waits:
        ranks.add_row("-", "no trainer rank reports here (`plait run` drives the ranks itself; a ray job's trainers "
                      "serve their waits on their own endpoints, runtime option metrics_port)")
    if not busy:
        return Group(sources, job, ranks)
    loaders = Table(title="loaders", title_justify="left")
    for col in ("loader", "buffer MiB", "busy"):
        loaders.add_column(col, justify="left" if col == "loader" else "right")
    buffers = now.series("plait_loader_buffer_bytes", "loader")
    for name in sorted(busy, key=lambda k: (len(k), k)):
        loaders.add_row(name, f"{buffers.get(name, 0) / 2**20:,.1f}", f"{busy[name]:.3f}")
    return Group(sources, loaders, job, ranks)


def run(args) -> int:
    console = Console()
    args.addresses = resolve(args.addresses, args.ray_address)
    before = scrape(args.addresses)
    if args.once:
        time.sleep(args.interval)
        console.print(render(before, scrape(args.addresses)))
        return 0
    with Live(render(before, before), console=console, refresh_per_second=4) as live:
        while True:
            time.sleep(args.interval)
            now = scrape(args.addresses)
            live.update(render(before, now))
            before = now
