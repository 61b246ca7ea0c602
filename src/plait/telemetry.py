"""Telemetry: Prometheus metrics of a running job, and structured event logs.

Off by default. `metrics: {port: 9400}` in the spec (or `plait run --metrics-port`) serves the figures on
`http://<address>:<port>/metrics` with `prometheus_client`: per source the tokens and samples delivered
and the records skipped; per step the planning and build time, the balance certificate and the fill;
per rank the time spent waiting for data; recovery events. Names follow Prometheus conventions
(`plait_` prefix, units in the name, counters end in `_total`). Each runtime has its own registry, so
several Loaders in one process never collide; gauges that describe a live object (buffer bytes, records
skipped) are read when scraped, from the object itself.

Events (failures, recoveries, rescaling, mixture changes) go to the `plait.events` logger; with
`PLAIT_LOG_JSON=1` (or `json_logs()`) each is one JSON line on stderr.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Callable, Iterable

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from plait.errors import PlaitError

EVENTS = logging.getLogger("plait.events")
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TOKENS_HELP = "Tokens delivered in batches, per source"
SAMPLES_HELP = "Samples (document chunks) delivered, per source"
IMAGES_HELP = "Images delivered in batches, per source"
BUILD_HELP = "Time to build one DP rank's micro-batches of a step"


class Telemetry:
    """The metric families of one runtime (one registry); cheap to update, read by a scrape."""

    def __init__(self, source_names: list[str], delivered: Callable[[], list[dict]] | None = None):
        """`delivered`: where the per-source delivery counters and the build histogram come from when the
        builds happen in other processes (the ray runtime's Constructors): a callable returning their
        `delivery_counts()`, summed at each scrape; the counters of this object then go unserved."""
        self.registry = CollectorRegistry()
        r = self.registry
        d = None if delivered is not None else r
        self.source_names = list(source_names)
        self.tokens = Counter("plait_source_tokens", TOKENS_HELP, ["source"], registry=d)
        self.samples = Counter("plait_source_samples", SAMPLES_HELP, ["source"], registry=d)
        self.images = Counter("plait_source_images", IMAGES_HELP, ["source"], registry=d)
        self.steps = Counter("plait_steps_planned", "Global steps planned", registry=r)
        self.plan_seconds = Histogram("plait_step_plan_seconds", "Time to plan one global step (metadata, "
                                      "mixture, balance)", buckets=STEP_SECONDS_BUCKETS, registry=r)
        self.build_seconds = Histogram("plait_rank_build_seconds", BUILD_HELP, buckets=STEP_SECONDS_BUCKETS,
                                       registry=d)
        if delivered is not None:
            r.register(_DeliveredCollector(self.source_names, delivered))
        self.max_over_lb = Gauge("plait_step_max_over_lower_bound", "Last step's max rank cost over the lower "
                                 "bound (1.0 is optimal)", registry=r)
        self.fill = Gauge("plait_step_fill_ratio", "Last step's tokens over its seq_len slots (1 - padding)",
                          registry=r)
        self.wait_seconds = Counter("plait_rank_wait_seconds", "Time a trainer rank waited for its next batch",
                                    ["rank"], registry=r)
        self.recoveries = Counter("plait_recovery_events", "Failures recovered from, per role", ["role"], registry=r)
        for name in self.source_names:  # every series exists from the start (a scrape sees 0, not nothing)
            self.tokens.labels(source=name)
            self.samples.labels(source=name)

    def observe_plan(self, plan, seconds: float) -> None:
        self.steps.inc()
        self.plan_seconds.observe(seconds)
        self.max_over_lb.set(plan.max_over_lb)
        self.fill.set(plan.fill)

    def observe_build(self, batches: Iterable, seconds: float) -> None:
        self.build_seconds.observe(seconds)
        n = len(self.source_names)
        tokens, samples, images = np.zeros(n), np.zeros(n), np.zeros(n)
        for mb in batches:
            tokens += np.bincount(mb.source_ids, weights=np.diff(mb.cu_seqlens), minlength=n)
            samples += np.bincount(mb.source_ids, minlength=n)
            if getattr(mb, "image_document", None) is not None and len(mb.image_document):
                images += np.bincount(mb.source_ids[mb.image_document], minlength=n)
        for i in np.flatnonzero(images):
            self.images.labels(source=self.source_names[i]).inc(float(images[i]))
        for i in np.flatnonzero(samples):
            name = self.source_names[i]
            self.tokens.labels(source=name).inc(float(tokens[i]))
            self.samples.labels(source=name).inc(float(samples[i]))

    def observe_wait(self, rank: int, seconds: float) -> None:
        self.wait_seconds.labels(rank=str(rank)).inc(seconds)

    def observe_recovery(self, role: str) -> None:
        self.recoveries.labels(role=role).inc()

    def watch_loader(self, read: Callable[[], dict]) -> None:
        """Gauges read from a live loader at scrape time: `read()` returns {"buffer_bytes": n,
        "busy_fraction": f, "skipped": {source: n}} (what SourceLoader.telemetry() gives)."""
        self.registry.register(_LoaderCollector(read))

    def watch_loaders(self, read: Callable[[], dict[str, dict]]) -> None:
        """Per-loader gauges (label `loader`) read at scrape time: `read()` returns {loader: what
        `watch_loader`'s read returns}, for the loaders that answered (the ray runtime's loader actors)."""
        self.registry.register(_LoadersCollector(read))

    def delivery_counts(self) -> dict:
        """What this object counted of the builds, as plain numbers (a ray Constructor actor's report, summed
        by the job's endpoint): {"tokens" | "samples" | "images": {source: n}, "build": {"buckets":
        [cumulative count per bound of STEP_SECONDS_BUCKETS, then +Inf], "sum": seconds}}."""
        keys = {"plait_source_tokens_total": "tokens", "plait_source_samples_total": "samples",
                "plait_source_images_total": "images"}
        out: dict = {"tokens": {}, "samples": {}, "images": {}, "build": {"buckets": [], "sum": 0.0}}
        for metric in (self.tokens, self.samples, self.images, self.build_seconds):
            for family in metric.collect():
                for s in family.samples:
                    if s.name in keys:
                        out[keys[s.name]][s.labels["source"]] = s.value
                    elif s.name == "plait_rank_build_seconds_bucket":
                        out["build"]["buckets"].append(s.value)
                    elif s.name == "plait_rank_build_seconds_sum":
                        out["build"]["sum"] = s.value
        return out

    def serve(self, port: int, address: str = "127.0.0.1") -> int:
        """Serve /metrics on (address, port); port 0 picks a free one. Returns the port; a PlaitError when
        the port cannot be had (in use, or not allowed)."""
        try:
            server, _ = start_http_server(port, addr=address, registry=self.registry)
        except OSError as e:
            raise PlaitError(
                f"cannot serve metrics on {address}:{port} ({e.strerror or e}); choose another port (metrics.port "
                "in the spec, or plait run --metrics-port), or 0 for any free one"
            ) from None
        return server.server_address[1]


class _LoaderCollector:
    def __init__(self, read: Callable[[], dict]):
        self.read = read

    def collect(self):
        now = self.read()
        yield GaugeMetricFamily("plait_loader_buffer_bytes", "Decoded data the SourceLoader holds",
                                value=float(now["buffer_bytes"]))
        yield GaugeMetricFamily("plait_loader_busy_ratio", "Fraction of wall time the SourceLoader spent reading "
                                "and decoding", value=float(now["busy_fraction"]))
        yield CounterMetricFamily("plait_loader_buffer_over_budget", "Blocks kept although they alone put a "
                                  "buffer over its budget (buffer_mb)", value=float(now.get("buffer_over_budget", 0)))
        skipped = GaugeMetricFamily("plait_source_skipped_records", "Bad records skipped (on_error: skip), "
                                    "per source", labels=["source"])
        for name, n in now["skipped"].items():
            skipped.add_metric([name], float(n))
        yield skipped


class _LoadersCollector:
    def __init__(self, read: Callable[[], dict[str, dict]]):
        self.read = read

    def collect(self):
        now = self.read()
        buffer = GaugeMetricFamily("plait_loader_buffer_bytes", "Decoded data the SourceLoader holds",
                                   labels=["loader"])
        busy = GaugeMetricFamily("plait_loader_busy_ratio", "Fraction of wall time the SourceLoader spent reading "
                                 "and decoding", labels=["loader"])
        skipped = GaugeMetricFamily("plait_source_skipped_records", "Bad records skipped (on_error: skip), "
                                    "per source", labels=["loader", "source"])
        over = CounterMetricFamily("plait_loader_buffer_over_budget", "Blocks kept although they alone put a "
                                   "buffer over its budget (buffer_mb)", labels=["loader"])
        for loader, figures in sorted(now.items()):
            buffer.add_metric([loader], float(figures["buffer_bytes"]))
            busy.add_metric([loader], float(figures["busy_fraction"]))
            over.add_metric([loader], float(figures.get("buffer_over_budget", 0)))
            for name, n in figures["skipped"].items():
                skipped.add_metric([loader, name], float(n))
        yield from (buffer, busy, skipped, over)


class _DeliveredCollector:
    """Delivery counters and the build histogram, summed over reports of `Telemetry.delivery_counts()`."""

    def __init__(self, source_names: list[str], read: Callable[[], list[dict]]):
        self.source_names = source_names
        self.read = read

    def collect(self):
        reports = self.read()
        for key, name, doc in (("tokens", "plait_source_tokens", TOKENS_HELP),
                               ("samples", "plait_source_samples", SAMPLES_HELP),
                               ("images", "plait_source_images", IMAGES_HELP)):
            totals = dict.fromkeys(self.source_names if key != "images" else [], 0.0)
            for report in reports:
                for source, n in report[key].items():
                    totals[source] = totals.get(source, 0.0) + n
            family = CounterMetricFamily(name, doc, labels=["source"])
            for source, n in totals.items():
                family.add_metric([source], n)
            yield family
        bounds = [floatToGoString(b) for b in STEP_SECONDS_BUCKETS] + ["+Inf"]
        counts = np.zeros(len(bounds))
        total = 0.0
        for report in reports:
            if len(report["build"]["buckets"]) == len(bounds):
                counts += report["build"]["buckets"]
                total += report["build"]["sum"]
        yield HistogramMetricFamily("plait_rank_build_seconds", BUILD_HELP, buckets=list(zip(bounds, counts.tolist())),
                                    sum_value=total)


class JsonLines(logging.Formatter):
    """One JSON object per event: time, level, logger, message, and the record's `event` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
               "message": record.getMessage()}
        out.update(getattr(record, "event", {}) or {})
        return json.dumps(out, default=str)


def json_logs(stream=None) -> logging.Handler:
    """Send plait's events (and recovery logs) to `stream` (stderr) as JSON lines; returns the handler."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonLines())
    for name in ("plait.events", "plait.recovery"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    return handler


def event(kind: str, message: str, **fields) -> None:
    """Log one structured event (failure, recovery, rescale, mixture change)."""
    EVENTS.info(message, extra={"event": {"event": kind, **fields}})


class Stopwatch:
    """`with Stopwatch() as t: ...; t.seconds`."""

    def __enter__(self) -> "Stopwatch":
        self.start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start


class MemoryTrace:
    """What a process holds more of over time: tracemalloc snapshots diffed against a baseline.

    Started in every plait process (driver, trainer, node host, server, Ray actors: they all import this
    module) when `PLAIT_TRACEMALLOC=DIR` is set. A daemon thread takes a baseline snapshot `every` seconds
    after the start (past imports and first compiles) and then, every `every` seconds, appends to
    DIR/<process>-<pid>.txt the traced total, the RSS and the top 20 allocation sites by growth since the
    baseline (each with its call stack). A site that keeps rising dump after dump is growth; one that
    rises once and stays is a cache or arena reaching its size. Diagnostic only: tracing slows the process
    (2-4x) and adds memory of its own, so a soak's figures are taken without it."""

    TOP = 20

    def __init__(self, folder: str, every: float, frames: int = 8):
        import tracemalloc

        self.tracemalloc = tracemalloc
        self.folder, self.every, self.frames = folder, every, frames
        self.baseline = None
        self.started = time.monotonic()

    def start(self) -> None:
        import threading

        os.makedirs(self.folder, exist_ok=True)
        self.tracemalloc.start(self.frames)
        threading.Thread(target=self._loop, name="plait-memory-trace", daemon=True).start()

    def _loop(self) -> None:
        while True:
            time.sleep(self.every)
            self.dump()

    def dump(self) -> None:
        snap = self.tracemalloc.take_snapshot()  # unfiltered: Snapshot.filter_traces is Python per trace (minutes)
        if self.baseline is None:
            self.baseline = snap
            return
        import psutil

        proc = psutil.Process()
        title = (proc.cmdline() or [proc.name()])[0]
        name = os.path.basename(title.split(" ")[0]).replace("::", "-").replace("/", "_") or "python"
        traced, peak = self.tracemalloc.get_traced_memory()
        lines = [f"=== t={time.monotonic() - self.started:.0f}s traced={traced / 2**20:.2f}MiB "
                 f"peak={peak / 2**20:.2f}MiB rss={proc.memory_info().rss / 2**20:.1f}MiB title={title[:80]}"]
        stats = [s for s in snap.compare_to(self.baseline, "traceback") if not _bookkeeping(s.traceback[-1].filename)]
        for stat in stats[: self.TOP]:
            lines.append(f"{stat.size_diff / 1024:+10.1f} KiB {stat.count_diff:+8d} blocks "
                         f"(now {stat.size / 1024:.1f} KiB)")
            # the allocating line first, then its callers (a Traceback lists the oldest frame first)
            lines.extend(f"      {frame.filename}:{frame.lineno}" for frame in reversed(list(stat.traceback)))
        with open(os.path.join(self.folder, f"{name}-{os.getpid()}.txt"), "a") as f:
            f.write("\n".join(lines) + "\n")


def _bookkeeping(filename: str) -> bool:
    """An allocation of the tracing itself or of the import machinery: not the process's data."""
    return filename.endswith(("tracemalloc.py", "fnmatch.py")) or filename.startswith("<frozen importlib")


def trace_memory_from_env() -> MemoryTrace | None:
    """Starts a MemoryTrace when PLAIT_TRACEMALLOC=DIR is set (PLAIT_TRACEMALLOC_EVERY: seconds between
    dumps, default 60; PLAIT_TRACEMALLOC_FRAMES: stack depth kept, default 8)."""
    folder = os.environ.get("PLAIT_TRACEMALLOC")
    if not folder:
        return None
    trace = MemoryTrace(folder, float(os.environ.get("PLAIT_TRACEMALLOC_EVERY", "60")),
                        int(os.environ.get("PLAIT_TRACEMALLOC_FRAMES", "8")))
    trace.start()
    return trace


if os.environ.get("PLAIT_LOG_JSON") == "1":  # opt-in for processes started by others (actors, torchrun)
    json_logs()
MEMORY_TRACE = trace_memory_from_env()  # opt-in diagnostic, in every plait process that inherits the variable
