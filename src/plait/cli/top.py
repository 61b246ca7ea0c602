"""`plait top`: a live terminal view of a running job, from its Prometheus endpoints.

It scrapes `/metrics` of each address it is given (a `plait run --metrics-port P` process, every
trainer process of a local-runtime job — ports P, P+1, … — or a ray job's endpoint) once a second and
shows rates between two scrapes: tokens and samples per second per source, records skipped, the
loader's buffer and busy ratio, steps planned and the last step's balance and fill, and the share of
time each rank waited for data.
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
    "of a job with `metrics: {port: P}`) every second and show per-source rates, loaders, waits and balance."
)


def add_arguments(p) -> None:
    p.add_argument("addresses", nargs="+", metavar="ADDRESS", help="host:port of a /metrics endpoint (several: one "
                   "per process)")
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
        return {dict(k[1])[label]: v for k, v in self.values.items() if k[0] == name and label in dict(k[1])}


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
    job.add_row("loader buffer", f"{now.get('plait_loader_buffer_bytes') / 2**20:,.1f} MiB")
    job.add_row("loader busy ratio", f"{now.get('plait_loader_busy_ratio'):.3f}")
    ranks = Table(title="ranks", title_justify="left")
    ranks.add_column("rank")
    ranks.add_column("waiting for data (share of time)", justify="right")
    waits = now.series("plait_rank_wait_seconds_total", "rank")
    for rank, total in sorted(waits.items(), key=lambda kv: int(kv[0])):
        share = (total - before.get("plait_rank_wait_seconds_total", rank=rank)) / dt
        ranks.add_row(rank, f"{share:.1%}")
    if not waits:
        ranks.add_row("-", "no trainer rank reports here (`plait run` drives the ranks itself)")
    return Group(sources, job, ranks)


def run(args) -> int:
    console = Console()
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
