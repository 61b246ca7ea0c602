"""The Flight servers of a job served to thin trainer clients (plait.runtime.flight is the client and
describes the protocol).

  * `ConstructorFlight` lives in a Constructor actor's process (started by its `serve_flight`): `do_get`
    streams one step of one rank's micro-batches, built by the actor's own `get` (the build shared with
    the replica's other ranks, cut to the asking CP rank), straight from the build's numpy arrays.
  * `RendezvousFlight` lives in the process that serves the job (`plait serve`): the job's one address.
    `hello` tells a client its job and each DP rank's Constructor location; the other actions forward
    to the job's Planner.

Both refuse a call without the job's token (`TokenCheck`, plait.runtime.flight_serving: Ray-free pieces
shared with the one-process server, plait.runtime.serve_local).
"""

from __future__ import annotations

from typing import Any, Callable

import pyarrow.flight as flight

from plait.errors import PlaitError
from plait.runtime.flight import PROTOCOL
from plait.runtime.ray.common import ray_module
from plait.runtime.flight_serving import (
    ActionServer,
    TokenCheck,
    as_flight_error,
    grpc_location,
    peer_host,
    serve_step,
)

__all__ = ["ConstructorFlight", "RendezvousFlight", "TokenCheck", "as_flight_error", "grpc_location"]


class ConstructorFlight(flight.FlightServerBase):
    """A Constructor's builds over Flight. `build(gen, step, dp_rank, limit, cp, with_state, client)` is the
    actor's `get`.
    Listens from construction on (bound to `host`, a free port) until `shutdown()` or the process ends."""

    def __init__(self, build: Callable, host: str, token: str):
        super().__init__(grpc_location(host, 0), middleware={"token": TokenCheck(token)})
        self.build = build
        # Bound to every interface: tell clients this node's address (trainers on other nodes connect).
        advertised = ray_module().util.get_node_ip_address() if host in ("0.0.0.0", "::") else host
        self.location = grpc_location(advertised, self.port)
        self.streams = 0

    def do_get(self, context, ticket):
        stream = serve_step(self.build, ticket)
        self.streams += 1
        return stream


class RendezvousFlight(ActionServer):
    """The job's front door: `hello` (job, fingerprint, DP ranks, Constructor location per DP rank) and the
    Planner's `base`, `seek`, `seek_with_changes`, `state_at`, `set_weights`, `report`, `error_report`.
    `ask(method, *args)` calls the job's Planner (its standby's successor if it died: RayRuntime.ask_planner);
    `serving` (a JobServer, optional): `reconnect(dp_rank, step)` replaces the Constructor of a rank whose
    client lost it, if it died, and returns every rank's endpoint (`reconnect` action); `attach(dp_rank,
    node, peer_ip)` returns the rank's endpoint on the trainer's node (`attach` action)."""

    def __init__(self, ask: Callable[..., Any], info: dict, location: str, token: str, serving=None):
        super().__init__(location, token, info)
        self.ask = ask
        self.serving = serving

    def answer(self, name: str, body: dict, peer: str) -> Any:
        if name == "hello":
            return self.info
        if name == "reconnect":
            if self.serving is not None:
                self.info["endpoints"] = self.serving.reconnect(int(body["dp_rank"]), int(body["step"]))
            return self.info["endpoints"]
        if name == "attach":
            rank = int(body["dp_rank"])
            if self.serving is None:
                return self.info["endpoints"][str(rank)]
            location, self.info["endpoints"] = self.serving.attach(rank, body.get("node"), peer_host(peer))
            return location
        calls = {
            "base": lambda: (),
            "seek": lambda: (body["state"],),
            "seek_with_changes": lambda: (body["state"],),
            "state_at": lambda: (int(body["gen"]), int(body["step"])),
            "set_weights": lambda: (body["weights"], int(body["at_step"])),
            "report": lambda: (int(body["step"]), body["losses"]),
            "error_report": lambda: (),
        }
        if name not in calls:
            raise PlaitError(f"unknown action {name!r} (this server speaks plait Flight protocol {PROTOCOL})")
        return self.ask(name, *calls[name]())
