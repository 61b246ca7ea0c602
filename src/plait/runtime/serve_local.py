"""One process serves a whole job to thin trainer clients (`plait serve SPEC --job NAME --runtime local`).

No Ray: the local runtime's roles (plait.runtime.local.LocalRuntime: one Planner, one SourceLoader over
every source, the Constructor) run in this process, and one Arrow Flight server here speaks the protocol
of plait.runtime.flight, so trainers use `plait.Loader(spec, dp_rank, runtime="flight")` unchanged:

  * the rendezvous actions (`hello`, `base`, `seek`, `seek_with_changes`, `state_at`, `set_weights`,
    `report`, `error_report`, `join`, `leave`) are answered by a plait.job.service.JobService: the shared
    plan stream (each step planned once for every rank, a bounded window of planned steps in which a rank
    too far ahead of the slowest waits, generations reset by `seek`);
  * `hello` names this same server as every DP rank's endpoint, and `do_get` streams one step of one rank:
    built once per (generation, step, rank), `prefetch` steps ahead on a few build threads, cut to the
    asking CP rank.

docs/serving.md describes the job service, the window's backpressure and how a gone trainer is detected.
Memory: one process, one buffer per source (its `buffer_mb`, capped job-wide by `loading.max_buffer_mb`).
"""

from __future__ import annotations

import secrets
import socket
import threading
from typing import Any


from plait.errors import PlaitError
from plait.job.consumers import Consumers
from plait.job.service import JobService
from plait.runtime.flight import PROTOCOL, location_of
from plait.runtime.flight_serving import ActionServer, grpc_location, serve_step, split_address
from plait.runtime.local import LocalRuntime
from plait.spec import Spec, load_spec


class LocalFlight(ActionServer):
    """The job's one Flight server: rendezvous actions and every rank's `do_get`."""

    def __init__(self, job: JobService, info: dict, location: str, token: str):
        super().__init__(location, token, info)
        self.job = job

    def answer(self, name: str, body: dict, peer: str) -> Any:
        job = self.job
        calls = {
            "hello": lambda: self.info,
            "base": job.base,
            "seek": lambda: job.seek(body["state"]),
            "seek_with_changes": lambda: job.seek_with_changes(body["state"]),
            "state_at": lambda: job.state_at(int(body["gen"]), int(body["step"])),
            "set_weights": lambda: job.set_weights(body["weights"], int(body["at_step"])),
            "report": lambda: job.report(int(body["step"]), body["losses"]),
            "error_report": job.error_report,
            "reconnect": lambda: self.info["endpoints"],  # one process: nothing to replace
            "attach": lambda: self.endpoint(int(body["dp_rank"])),  # every rank is served here
            "join": lambda: job.join(body["id"], int(body["pid"])),
            "leave": lambda: job.leave(body["id"]),
        }
        if name not in calls:
            raise PlaitError(f"unknown action {name!r} (this server speaks plait Flight protocol {PROTOCOL})")
        return calls[name]()

    def endpoint(self, dp_rank: int) -> str:
        if str(dp_rank) not in self.info["endpoints"]:
            raise PlaitError(f"dp_rank {dp_rank} is not one of this job's {self.job.ranks} DP ranks")
        return self.info["endpoints"][str(dp_rank)]

    def do_get(self, context, ticket):
        return serve_step(self.job.get, ticket)


class LocalJobServer:
    """Job `job` of `spec` in this process, served over Arrow Flight at `listen` (`host:port`, port 0 = a
    free one; `self.address` is where it listens). `token`: the job's token (default: a fresh random one,
    `self.token`). `dp`, `metrics_port`: LocalRuntime's; `prefetch`, `expected`: JobService's. `close()`
    ends the job."""

    def __init__(self, spec: Spec | dict | str, job: str, listen: str = "127.0.0.1:0", *, token: str | None = None,
                 dp: int | None = None, prefetch: int = 2, metrics_port: int | None = None, expected: int = 0):
        self.spec = load_spec(spec)
        host, port = split_address(listen)
        self.token = token or secrets.token_urlsafe(32)
        self.stopped = threading.Event()
        self.service = JobService(LocalRuntime(self.spec, dp=dp, metrics_port=metrics_port), prefetch=prefetch,
                                  expected=expected)
        self.ranks = self.service.ranks
        info = {"job": job, "fingerprint": self.spec.data_fingerprint(), "ranks": self.ranks,
                "cp": self.spec.topology.cp}
        try:
            self.server = LocalFlight(self.service, info, grpc_location(host, port), self.token)
        except BaseException:
            self.service.close()
            raise
        # Every rank's steps come from this same server, at an address the trainers can reach.
        advertised = socket.gethostname() if host in ("0.0.0.0", "::") else host
        here = grpc_location(advertised, self.server.port)
        self.server.info["endpoints"] = {str(r): here for r in range(self.ranks)}
        self.job = job
        self.address = f"[{host}]:{self.server.port}" if ":" in host else f"{host}:{self.server.port}"

    @property
    def location(self) -> str:
        return location_of(self.address)

    @property
    def clients(self) -> Consumers:
        """The trainer processes that joined and how far each has read (plait.runtime.node_share)."""
        return self.service.consumers

    def wait(self, timeout: float | None = None) -> bool:
        """Block until `close()` (or `timeout` seconds); True when closed."""
        return self.stopped.wait(timeout)

    def close(self) -> None:
        if self.stopped.is_set():
            return
        self.server.shutdown()
        self.service.close()
        self.stopped.set()

    def __enter__(self) -> "LocalJobServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

