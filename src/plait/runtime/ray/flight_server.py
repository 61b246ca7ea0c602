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
from plait.runtime.flight import PROTOCOL, loads
from plait.runtime.flight_serving import ActionServer, TokenCheck, as_flight_error, grpc_location, step_stream
from plait.runtime.ray.common import get

__all__ = ["ConstructorFlight", "RendezvousFlight", "TokenCheck", "as_flight_error", "grpc_location"]


class ConstructorFlight(flight.FlightServerBase):
    """A Constructor's builds over Flight. `build(gen, step, dp_rank, limit, cp)` is the actor's `get`.
    Listens from construction on (bound to `host`, a free port) until `shutdown()` or the process ends."""

    def __init__(self, build: Callable, host: str, token: str):
        super().__init__(grpc_location(host, 0), middleware={"token": TokenCheck(token)})
        self.build = build
        self.location = grpc_location(host, self.port)
        self.streams = 0

    def do_get(self, context, ticket):
        t = loads(ticket.ticket)
        try:
            state, batches = self.build(int(t["gen"]), int(t["step"]), int(t["dp_rank"]), t.get("limit"),
                                        tuple(int(c) for c in t["cp"]))
        except PlaitError as e:
            raise as_flight_error(e) from None
        self.streams += 1
        return step_stream(state, batches)


class RendezvousFlight(ActionServer):
    """The job's front door: `hello` (job, fingerprint, DP ranks, Constructor location per DP rank) and the
    Planner's `base`, `seek`, `seek_with_changes`, `state_at`, `set_weights`, `report`, `error_report`.
    `planner()` returns the current Planner handle (it changes if a dead Planner is recreated)."""

    def __init__(self, planner: Callable[[], Any], info: dict, location: str, token: str):
        super().__init__(location, token, info)
        self.planner = planner

    def answer(self, name: str, body: dict) -> Any:
        if name == "hello":
            return self.info
        p = self.planner()
        calls = {
            "base": lambda: p.base.remote(),
            "seek": lambda: p.seek.remote(body["state"]),
            "seek_with_changes": lambda: p.seek_with_changes.remote(body["state"]),
            "state_at": lambda: p.state_at.remote(int(body["gen"]), int(body["step"])),
            "set_weights": lambda: p.set_weights.remote(body["weights"], int(body["at_step"])),
            "report": lambda: p.report.remote(int(body["step"]), body["losses"]),
            "error_report": lambda: p.error_report.remote(),
        }
        if name not in calls:
            raise PlaitError(f"unknown action {name!r} (this server speaks plait Flight protocol {PROTOCOL})")
        return get(calls[name]())
