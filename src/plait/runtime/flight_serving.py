"""The one plait Flight server (`JobFlight`) and what every use of it shares, without Ray: the token check,
locations, errors as the client reads them, the action table and one step as a Flight stream
(plait.runtime.flight describes the protocol). The Ray-served job (plait.runtime.ray.flight_server) and
the one-process server (plait.runtime.serve_local) are the same server over different answerers."""

from __future__ import annotations

import abc
import hmac
import threading
from typing import Callable

import pyarrow.flight as flight

from plait.batch import MicroBatch
from plait.errors import PlaitError
from plait.runtime.flight import ERROR_MARK, PROTOCOL, dumps, encode_batch, loads, location_of, step_schema


class TokenCheck(flight.ServerMiddlewareFactory):
    """Refuses (UNAUTHENTICATED) every call whose `authorization` header is not `Bearer <token>`."""

    def __init__(self, token: str):
        super().__init__()
        self.expected = b"Bearer " + token.encode()

    def start_call(self, info, headers):
        values = headers.get("authorization") or [b""]
        given = values[0] if isinstance(values[0], bytes) else str(values[0]).encode()
        if not hmac.compare_digest(given, self.expected):
            raise flight.FlightUnauthenticatedError("plait: this job's token was not given")
        return None


def grpc_location(host: str, port: int) -> str:
    return f"grpc+tcp://[{host}]:{port}" if ":" in host else f"grpc+tcp://{host}:{port}"


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit():
        raise PlaitError(f"--address {address!r} is not host:port (e.g. 127.0.0.1:8815; port 0: a free one)")
    return host, int(port)


def listen_address(host: str, port: int) -> str:
    """`host:port` as a client writes it (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ServedJob(abc.ABC):
    """What the owner of a served job offers, whoever serves it (plait.runtime.serve_local's one process,
    plait.runtime.ray.serving's Ray job): `address` (where its rendezvous listens), `token`, `wait()`,
    `close()` (once; `stop()` is the serving's own end) and the context manager."""

    address: str
    token: str

    def __init__(self):
        self.stopped = threading.Event()

    @property
    def location(self) -> str:
        return location_of(self.address)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until `close()` (or `timeout` seconds); True when closed."""
        return self.stopped.wait(timeout)

    @abc.abstractmethod
    def stop(self) -> None:
        """End the serving (the job's own end: its server, its roles or actors)."""

    def close(self) -> None:
        if self.stopped.is_set():
            return
        try:
            self.stop()
        finally:
            self.stopped.set()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def as_flight_error(e: PlaitError) -> flight.FlightServerError:
    """A plait error as the client will read it (plait.runtime.flight.plait_error)."""
    return flight.FlightServerError(ERROR_MARK + str(e).replace("\n", " "))


def step_stream(state: dict | None, batches: list[MicroBatch]) -> flight.GeneratorStream:
    """One step of one rank as do_get's answer: one record batch per micro-batch, zero-copy over its arrays
    (and the data state at the step's start, unless None: the ticket did not ask for it)."""
    schema = step_schema(state, batches)
    return flight.GeneratorStream(schema, (encode_batch(schema, mb) for mb in batches))


def wants_state(ticket: dict) -> bool:
    """Whether a do_get ticket asks for the data state with the step (absent: yes, as protocol 1 began)."""
    return bool(ticket.get("state", True))


def serve_step(get: Callable, ticket: flight.Ticket) -> flight.GeneratorStream:
    """do_get of every plait Flight server: the ticket's step of one rank from `get(gen, step, dp_rank,
    limit, cp, with_state, client)` (plait.job.service.JobService.get, or a Ray Constructor's), as a stream."""
    t = loads(ticket.ticket)
    try:
        state, batches = get(int(t["gen"]), int(t["step"]), int(t["dp_rank"]), t.get("limit"),
                             tuple(int(c) for c in t["cp"]), wants_state(t), t.get("client"))
    except PlaitError as e:
        raise as_flight_error(e) from None
    return step_stream(state, batches)


# The action table of every plait Flight server: each action's arguments from its JSON body and the
# caller's gRPC address (`peer`), and what it is for. A server answers an action with the method of that
# name of the first of its answerers that has one (JobFlight).
ACTION_ARGS: dict[str, Callable[[dict, str], tuple]] = {
    "hello": lambda b, peer: (),
    "base": lambda b, peer: (),
    "seek": lambda b, peer: (b["state"],),
    "seek_with_changes": lambda b, peer: (b["state"],),
    "state_at": lambda b, peer: (int(b["gen"]), int(b["step"])),
    "replan_after": lambda b, peer: (b["state"], b["layout"]),
    "set_weights": lambda b, peer: (b["weights"], int(b["at_step"])),
    "report": lambda b, peer: (int(b["step"]), b["losses"]),
    "error_report": lambda b, peer: (),
    "reconnect": lambda b, peer: (int(b["dp_rank"]), int(b["step"])),
    "attach": lambda b, peer: (int(b["dp_rank"]), b.get("node"), peer_host(peer)),
    "join": lambda b, peer: (b["id"], int(b["pid"])),
    "leave": lambda b, peer: (b["id"],),
}
ACTIONS = [("hello", "the job and its endpoints"), ("base", "generation and its start state"),
           ("seek", "continue from a data state"), ("seek_with_changes", "continue under a changed spec"),
           ("state_at", "data state at a step"), ("replan_after", "the data state after a step, re-planned on "
                                                  "the layout it ran on (elastic resume)"),
           ("set_weights", "run-time mixture weights"), ("report", "per-source losses"),
           ("error_report", "records skipped"),
           ("reconnect", "the DP ranks' Constructor endpoints, a dead Constructor replaced"),
           ("attach", "a DP rank's Constructor endpoint, on the asking trainer's node"),
           ("join", "a trainer process starts reading (one-process server)"),
           ("leave", "a trainer process is done (one-process server)")]


def answer_action(answerers: tuple, name: str, body: dict, peer: str):
    """Action `name` (ACTION_ARGS) answered by the first of `answerers` that has a method of its name: what
    a JobFlight answers, and what a node's shared-memory server answers without one (no Flight port)."""
    args = ACTION_ARGS.get(name)
    method = next((getattr(a, name) for a in answerers if hasattr(a, name)), None)
    if args is None or method is None:
        raise PlaitError(f"unknown action {name!r} (this server speaks plait Flight protocol {PROTOCOL})")
    return method(*args(body, peer))


class JobFlight(flight.FlightServerBase):
    """The one plait Flight server shell, over any job: refuses calls without the job's token, answers
    the plait actions (ACTION_ARGS) with the first of `answerers` that has a method of the action's name
    (a plait.job.service.JobService, or a Ray-served job's front: plait.runtime.ray.flight_server), and
    streams steps with `get(gen, step, dp_rank, limit, cp, with_state, client)` (serve_step). A server
    without answerers serves steps only (a Ray Constructor's), one without `get` actions only. A
    PlaitError becomes the error the client reads."""

    def __init__(self, location: str, token: str, answerers: tuple = (), get: Callable | None = None):
        super().__init__(location, middleware={"token": TokenCheck(token)})
        self.answerers, self.get = tuple(answerers), get
        self.streams = 0  # steps streamed

    def do_action(self, context, action):
        body = loads(action.body.to_pybytes()) or {}
        try:
            result = self.answer(action.type, body, context.peer())
        except PlaitError as e:
            raise as_flight_error(e) from None
        return [dumps(result)]

    def answer(self, name: str, body: dict, peer: str):
        return answer_action(self.answerers, name, body, peer)

    def list_actions(self, context):
        return [a for a in ACTIONS if any(hasattr(x, a[0]) for x in self.answerers)]

    def do_get(self, context, ticket):
        if self.get is None:
            raise as_flight_error(PlaitError("this server streams no steps: ask the endpoint `hello` names"))
        stream = serve_step(self.get, ticket)
        self.streams += 1
        return stream


def peer_host(peer: str) -> str | None:
    """The IP address in a gRPC peer string ("ipv4:10.0.0.7:51234", "ipv6:[::1]:51234"); None for others."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host = rest.rpartition(":")[0]
    return host.strip("[]") or None
