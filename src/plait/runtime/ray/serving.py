"""Serving a job to thin trainer clients (`plait serve`): trainer processes that import no Ray.

`JobServer` creates the job on Ray (this process is its creator and keeps it alive with its heartbeat),
starts a Flight server in each Constructor actor that serves the job's DP ranks, and a rendezvous Flight
server here, at the one address the trainers are given (`PLAIT_ADDRESS`), with a per-job token
(`PLAIT_TOKEN`). Trainers then use `plait.Loader(spec, dp_rank, runtime="flight")` (plait.runtime.flight).
Everything binds to loopback unless told otherwise.

Node-local Constructors. A trainer's first request for its DP rank (`attach`) names its node: the
`PLAIT_NODE` it was given (a Ray node's id, name or IP), else the IP its connection comes from. The rank
is then served by a Constructor on that Ray node (started there, bound to that node's loopback unless
Constructors bind every interface), so a step's tokens cross the network once, loader to Constructor,
and never from one node's Constructor to another node's trainers. A trainer outside the Ray cluster, or
on the serving node, keeps the serving node's Constructor. The latest trainer to attach a rank decides
(a trainer restarted on another node moves its rank there; the ranks of one DP replica normally share a
node, and one that does not keeps reading from the Constructor it attached to).
"""

from __future__ import annotations

import ipaddress
import secrets
import threading

from plait.errors import PlaitError
from plait.runtime.flight import PROTOCOL
from plait.runtime.flight_serving import ServedJob, listen_address, split_address
from plait.runtime.ray import recovery
from plait.runtime.ray.common import get, ray_module
from plait.runtime.ray.constructor_actor import ConstructorPool
from plait.runtime.ray.flight_server import RendezvousFlight, grpc_location
from plait.runtime.ray.liveness import JobNameTaken
from plait.runtime.ray.runtime import RayRuntime
from plait.spec import Spec, load_spec


class JobServer(ServedJob):
    """Job `job` of `spec` on Ray, served over Arrow Flight at `listen` (`host:port`, port 0 = a free one;
    `self.address` is where it listens).

    `token`: the job's token (default: a fresh random one, `self.token`). `constructor_host`: where the
    Constructors' Flight servers bind (default: the rendezvous host; they run on this node with
    `constructors="node"`, a served job's default: its thin trainers may join from other nodes). Other
    keyword options are RayRuntime's (loaders, prefetch, constructors, ...; `address` is the Ray cluster's).
    `close()` ends the job.
    """

    def __init__(self, spec: Spec | dict | str, job: str, listen: str = "127.0.0.1:0", *,
                 token: str | None = None, constructor_host: str | None = None, **ray_options):
        super().__init__()
        self.spec = load_spec(spec)
        host, port = split_address(listen)
        self.token = token or secrets.token_urlsafe(32)
        ray_options.setdefault("constructors", "node")
        try:
            self.runtime = RayRuntime(self.spec, job=job, **ray_options)
        except JobNameTaken as e:  # in `plait serve` terms: it has no attach option
            raise PlaitError(f"{e.plain}: `plait serve` starts a new job, so choose another --job name, or stop "
                             f"that one first (`plait jobs stop {job}`)") from None
        self.rendezvous = None
        self.lock = threading.Lock()
        self.recoveries: list[dict] = []  # Constructors replaced for thin clients that lost theirs
        rt = self.runtime
        self.pool = ConstructorPool(rt.job, rt.constructors_mode, rt.prefetch, rt.dp, "detached")
        self.constructor_host = constructor_host or host
        self.here = ray_module().get_runtime_context().get_node_id()  # the serving node
        try:
            self.endpoints = self._serve_constructors()
            self.info = {"job": job, "fingerprint": self.spec.data_fingerprint(), "ranks": self.runtime.dp,
                         "cp": self.spec.topology.cp, "protocol": PROTOCOL, "mixture": self.spec.mixture_fingerprint()}
            self.rendezvous = RendezvousFlight(self.runtime.ask_planner, self, grpc_location(host, port), self.token)
        except BaseException:
            self.close()
            raise
        self.job = job
        self.address = listen_address(host, self.rendezvous.port)

    def _serve_constructors(self) -> dict[str, str]:
        """Each DP rank's Constructor, its Flight server started (once per actor): {dp_rank: location}."""
        rt, pool = self.runtime, self.pool
        locations: dict[str, object] = {}
        for r in range(rt.dp):
            key = pool.key(r)
            if key not in locations:
                host = self.constructor_host
                if pool.mode != "planner" and pool.node_of(r) != self.here and host not in ("0.0.0.0", "::"):
                    host = "127.0.0.1"  # another node's Constructor serves that node's trainers only
                locations[key] = pool.for_rank(r, rt.planner).serve_flight.remote(host, self.token)
        found = dict(zip(locations, get(list(locations.values()))))
        return {str(r): found[pool.key(r)] for r in range(rt.dp)}

    # ----- the rendezvous's actions (plait.runtime.flight_serving.ACTION_ARGS) -------------------------------
    def hello(self) -> dict:
        """The job, its fingerprint and DP ranks, and each rank's Constructor location."""
        with self.lock:
            return {**self.info, "endpoints": dict(self.endpoints)}

    def replan_after(self, state: dict, layout: dict) -> dict:
        """Elastic resume of a thin client: the step re-planned on its saved layout, here (plait.job.elastic)."""
        from plait.job.elastic import replan_after

        return replan_after(self.spec, state, layout)

    def reconnect(self, dp_rank: int, step: int) -> dict[str, str]:
        """A thin client lost its Constructor at `step`: if it died, a new one is started (it rebuilds the
        step from the Planner's window: the same micro-batches) and serves Flight; every rank's endpoint.
        A live one (a network blip) is kept: the client just asks again."""
        with self.lock:
            event = recovery.replace_dead_constructors(self.pool, self.runtime.planner, step, dp_rank)
            if event is not None:
                self.endpoints = self._serve_constructors()
                self.recoveries.append(event)
                self.runtime.planner.record_recovery.remote("constructor")
            return dict(self.endpoints)

    def attach(self, dp_rank: int, node: str | None, peer_ip: str | None) -> str:
        """A trainer's first request for `dp_rank`: the rank's endpoint, the rank moved to a Constructor on
        the trainer's node (`node`, else `peer_ip`) when it is another Ray node."""
        if not 0 <= dp_rank < self.runtime.dp:
            raise PlaitError(f"dp_rank {dp_rank} is not one of this job's {self.runtime.dp} DP ranks")
        with self.lock:
            target = trainer_node(node, peer_ip, self.here)
            if self.pool.mode != "planner" and target != self.pool.node_of(dp_rank):
                self.pool.place(dp_rank, target)
                self.endpoints = self._serve_constructors()
            return self.endpoints[str(dp_rank)]

    def stop(self) -> None:
        """Stop the rendezvous and end the job (its Constructors' Flight servers go with them)."""
        if self.rendezvous is not None:
            self.rendezvous.shutdown()
            self.rendezvous = None
        self.runtime.close()


def trainer_node(node: str | None, peer_ip: str | None, here: str) -> str:
    """The live Ray node a trainer runs on: the one `node` names (id, name or IP), else the one at
    `peer_ip`; `here` (the serving node) for a loopback or unknown address, and among nodes that share
    an address (several raylets on one host)."""
    alive = [n for n in ray_module().nodes() if n.get("Alive")]
    if node:
        found = [n["NodeID"] for n in alive if node in (n["NodeID"], n.get("NodeName"), n.get("NodeManagerAddress"))]
        if not found:
            names = sorted({n.get("NodeName") or n["NodeID"] for n in alive})
            raise PlaitError(f"PLAIT_NODE={node!r} names no live node of this job's Ray cluster (nodes: {names})")
    else:
        try:
            address = ipaddress.ip_address(peer_ip or "")
        except ValueError:
            return here
        address = getattr(address, "ipv4_mapped", None) or address  # "::ffff:10.0.0.7" from a dual-stack socket
        if address.is_loopback:
            return here
        peer_ip = str(address)
        found = [n["NodeID"] for n in alive if n.get("NodeManagerAddress") == peer_ip]
    return here if here in found or not found else found[0]
