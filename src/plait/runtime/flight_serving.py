"""Ray-free pieces every plait Flight server shares (the Ray-served job's, plait.runtime.ray.flight_server,
and the one-process server, plait.runtime.serve_local): the token check, locations, errors as the client
reads them, and one step as a Flight stream (plait.runtime.flight describes the protocol)."""

from __future__ import annotations

import hmac
from typing import Callable

import pyarrow.flight as flight

from plait.batch import MicroBatch
from plait.errors import PlaitError
from plait.runtime.flight import ERROR_MARK, PROTOCOL, dumps, encode_batch, loads, step_schema


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


ACTIONS = [("hello", "the job and its endpoints"), ("base", "generation and its start state"),
           ("seek", "continue from a data state"), ("seek_with_changes", "continue under a changed spec"),
           ("state_at", "data state at a step"), ("set_weights", "run-time mixture weights"),
           ("report", "per-source losses"), ("error_report", "records skipped"),
           ("reconnect", "the DP ranks' Constructor endpoints, a dead Constructor replaced"),
           ("attach", "a DP rank's Constructor endpoint, on the asking trainer's node"),
           ("join", "a trainer process starts reading (one-process server)"),
           ("leave", "a trainer process is done (one-process server)")]


class ActionServer(flight.FlightServerBase):
    """A job's Flight front door (the Ray-served rendezvous and the one-process server): refuses calls
    without the job's token and answers the plait actions (ACTIONS) through `answer(name, body, peer)`
    (`peer`: the caller's gRPC address, e.g. "ipv4:10.0.0.7:51234"), a PlaitError becoming the error the
    client reads. `info` is what `hello` returns."""

    def __init__(self, location: str, token: str, info: dict):
        super().__init__(location, middleware={"token": TokenCheck(token)})
        self.info = {**info, "protocol": PROTOCOL}

    def do_action(self, context, action):
        body = loads(action.body.to_pybytes()) or {}
        try:
            result = self.answer(action.type, body, context.peer())
        except PlaitError as e:
            raise as_flight_error(e) from None
        return [dumps(result)]

    def list_actions(self, context):
        return ACTIONS

    def answer(self, name: str, body: dict, peer: str):
        raise NotImplementedError


def peer_host(peer: str) -> str | None:
    """The IP address in a gRPC peer string ("ipv4:10.0.0.7:51234", "ipv6:[::1]:51234"); None for others."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host = rest.rpartition(":")[0]
    return host.strip("[]") or None
