"""A ray job's Prometheus endpoint, served by its Planner actor (plait.telemetry names the series).

One endpoint per job, when the spec sets `metrics.port` (0: any free port; `metrics.address`, loopback by
default): the Planner observes its own planning (steps, plan time, certificate, fill) and the recoveries
(loaders and shadows it replaces; Planner and Constructor recoveries reported by the trainer processes);
at each scrape it asks, with a short timeout, the loader actors for their live figures (label `loader`:
buffer bytes, busy ratio, skipped records per source) and the Constructor actors for what they built (per
source tokens, samples and images, build time), summed. An actor that is dead or does not answer in time
is left out of that scrape, not an error. The endpoint's `host:port` is `PlannerActor.metrics_address()`
(`plait jobs` shows it, `plait top JOB` scrapes it).
"""

from __future__ import annotations

import logging
from typing import Callable

from plait.runtime.ray.common import NAMESPACE, ray_module
from plait.spec import Spec
from plait.telemetry import Telemetry

log = logging.getLogger("plait.telemetry")
SCRAPE_TIMEOUT_S = 2.0  # how long a scrape waits for the actors' answers


def ask(refs: list, timeout: float = SCRAPE_TIMEOUT_S) -> list:
    """Each ref's value, or None where its actor is dead, failed or did not answer within `timeout`."""
    ray = ray_module()
    if not refs:
        return []
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    done = set(ready)
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref) if ref in done else None)
        except Exception:  # noqa: BLE001 - a dead actor is skipped
            out.append(None)
    return out


class JobMetrics:
    """The job's Telemetry (its plan and recovery figures observed here, the rest collected at scrape) and,
    when the spec asks, its HTTP endpoint."""

    def __init__(self, spec: Spec, loader_handles: Callable[[], list], constructor_names: Callable[[], list[str]]):
        self.loader_handles = loader_handles
        self.constructor_names = constructor_names
        self.telemetry = Telemetry(spec.source_names, delivered=self.delivered)
        self.telemetry.watch_loaders(self.loaders)
        self.address: str | None = None
        port, host = spec.metrics.port, spec.metrics.address
        if port is None:
            return
        try:
            port = self.telemetry.serve(port, host)
        except OSError as e:  # a metrics port in use must not take the job down
            log.warning("cannot serve the job's metrics on %s:%s: %s", host, port, e)
            return
        self.address = f"{advertised_host(host)}:{port}"

    def loaders(self) -> dict[str, dict]:
        """{loader index: its SourceLoader.telemetry()} for the loaders that answered."""
        handles = list(self.loader_handles())
        figures = ask([h.telemetry.remote() for h in handles])
        return {str(k): f for k, f in enumerate(figures) if f is not None}

    def delivered(self) -> list[dict]:
        """The Constructors' `telemetry()` reports (plait.telemetry.Telemetry.delivery_counts)."""
        ray = ray_module()
        handles = []
        try:
            names = list(self.constructor_names())
        except RuntimeError:  # the set changed while read (a Constructor registering): next scrape
            names = []
        for name in names:
            try:
                handles.append(ray.get_actor(name, namespace=NAMESPACE))
            except ValueError:  # gone (being replaced)
                pass
        return [r for r in ask([h.telemetry.remote() for h in handles]) if r is not None]


def advertised_host(host: str) -> str:
    """Where others reach an endpoint bound to `host`: this node's IP for a wildcard address."""
    if host in ("", "0.0.0.0", "::"):
        return ray_module().util.get_node_ip_address()
    return f"[{host}]" if ":" in host else host
