"""One process serves a whole job to thin trainer clients (`plait serve SPEC --job NAME --runtime local`).

No Ray: the local runtime's roles (plait.runtime.local.LocalRoles: one Planner, one SourceLoader over
every source, the Constructor) run in this process, and one Arrow Flight server here speaks the protocol
of plait.runtime.flight, so trainers use `plait.Loader(spec, dp_rank, runtime="flight")` unchanged:

  * the rendezvous actions (`hello`, `base`, `seek`, `seek_with_changes`, `state_at`, `set_weights`,
    `report`, `error_report`, `join`, `leave`) are answered by a plait.job.service.JobService: the shared
    plan stream (each step planned once for every rank, a bounded window of planned steps in which a rank
    too far ahead of the slowest waits, generations reset by `seek`);
  * `hello` names this same server as every DP rank's endpoint, and `do_get` streams one step of one rank:
    built once per (generation, step, rank), `build_ahead` steps ahead on a few build threads, cut to the
    asking CP rank.

docs/serving.md describes the job service, the window's backpressure and how a gone trainer is detected.
Memory: one process, one buffer per source (its `buffer_mb`, capped job-wide by `loading.max_buffer_mb`).
"""

from __future__ import annotations

import secrets
import socket
import threading

from plait.errors import PlaitError
from plait.job.consumers import Consumers
from plait.job.service import JobService
from plait.runtime.options import renamed
from plait.runtime.flight import PROTOCOL
from plait.runtime.flight_serving import JobFlight, ServedJob, grpc_location, listen_address, split_address
from plait.runtime.local import LocalRoles
from plait.spec import Spec, load_spec


BUILD_AHEAD = 2  # steps built ahead of each rank's request


class OneServer:
    """The actions of a job whose one server serves every rank: `hello`, and every rank's endpoint is
    this server (the job service answers the other actions)."""

    def __init__(self, info: dict, ranks: int):
        self.info, self.ranks = info, ranks

    def hello(self) -> dict:
        return self.info

    def reconnect(self, dp_rank: int, step: int) -> dict[str, str]:
        return self.info["endpoints"]  # one process: nothing to replace

    def attach(self, dp_rank: int, node: str | None, peer_ip: str | None) -> str:
        if str(dp_rank) not in self.info["endpoints"]:
            raise PlaitError(f"dp_rank {dp_rank} is not one of this job's {self.ranks} DP ranks")
        return self.info["endpoints"][str(dp_rank)]


class LocalJobServer(ServedJob):
    """Job `job` of `spec` in this process, served over Arrow Flight at `listen` (`host:port`, port 0 = a
    free one; `self.address` is where it listens). `token`: the job's token (default: a fresh random one,
    `self.token`). `dp`, `metrics_port`: LocalRoles's; `build_ahead` (steps built ahead of each rank's request;
    `prefetch`, its old name, is deprecated), `expected`: JobService's. `flight=False`: no Flight server
    until `start_flight()` (actions through `answerers` meanwhile). `close()` ends the job."""

    def __init__(self, spec: Spec | dict | str, job: str, listen: str = "127.0.0.1:0", *, token: str | None = None,
                 dp: int | None = None, build_ahead: int | None = None, metrics_port: int | None = None,
                 expected: int = 0, prefetch: int | None = None, flight: bool = True):
        build_ahead = renamed("prefetch", prefetch, "build_ahead", build_ahead)
        super().__init__()
        self.spec = load_spec(spec)
        host, port = split_address(listen)
        self.token = token or secrets.token_urlsafe(32)
        # Its readers are whichever trainers connect: a rank nobody reads must not pin blocks.
        self.service = JobService(LocalRoles(self.spec, dp=dp, metrics_port=metrics_port), expected=expected,
                                  build_ahead=BUILD_AHEAD if build_ahead is None else build_ahead,
                                  every_rank_reads=False)
        self.ranks = self.service.ranks
        info = {"job": job, "fingerprint": self.spec.data_fingerprint(), "mixture": self.spec.mixture_fingerprint(),
                "ranks": self.ranks,
                "cp": self.spec.topology.cp, "protocol": PROTOCOL}
        self.front = OneServer(info, self.ranks)
        self.answerers = (self.front, self.service)  # the action table's (flight_serving.answer_action)
        self.job, self.listen = job, (host, port)
        self.server: JobFlight | None = None
        self.address: str | None = None  # where Flight listens, once started
        self._flight_lock = threading.Lock()
        if flight:
            try:
                self.start_flight()
            except BaseException:
                self.service.close()
                raise

    def start_flight(self) -> str:
        """Start the Flight server (once; a node's host starts it when a reader first asks for it, its
        ranks reading shared memory otherwise) and return where it listens."""
        with self._flight_lock:
            if self.server is None:
                host, port = self.listen
                self.server = JobFlight(grpc_location(host, port), self.token, self.answerers, get=self.service.get)
                # Every rank's steps come from this same server, at an address the trainers can reach.
                advertised = socket.gethostname() if host in ("0.0.0.0", "::") else host
                here = grpc_location(advertised, self.server.port)
                self.front.info["endpoints"] = {str(r): here for r in range(self.ranks)}
                self.address = listen_address(host, self.server.port)
            return self.address

    @property
    def clients(self) -> Consumers:
        """The trainer processes that joined and how far each has read (plait.runtime.node_share)."""
        return self.service.consumers

    def stop(self) -> None:
        with self._flight_lock:
            if self.server is not None:
                self.server.shutdown()
        self.service.close()
