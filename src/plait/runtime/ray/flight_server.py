"""The Flight servers of a job served on Ray to thin trainer clients: the one plait Flight server
(plait.runtime.flight_serving.JobFlight) over the Ray job's parts; plait.runtime.flight is the client and
describes the protocol.

  * `ConstructorFlight` lives in a Constructor actor's process (started by its `serve_flight`): it
    streams one step of one rank's micro-batches, built by the actor's own `get` (the build shared with
    the replica's other ranks, cut to the asking CP rank), straight from the build's numpy arrays.
  * `RendezvousFlight` lives in the process that serves the job (`plait serve`): the job's one address.
    Its answerers are the JobServer (plait.runtime.ray.serving: `hello`, `attach`, `reconnect`,
    `replan_after`) and the job's Planner (`PlannerCalls`: the Planner's methods of the actions' names).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from plait.runtime.flight_serving import JobFlight, TokenCheck, as_flight_error, grpc_location
from plait.runtime.ray.common import ray_module

__all__ = ["ConstructorFlight", "PlannerCalls", "RendezvousFlight", "TokenCheck", "as_flight_error", "grpc_location"]

# The actions the job's Planner answers itself (its methods of the same names).
PLANNER_ACTIONS = ("base", "seek", "seek_with_changes", "state_at", "set_weights", "report", "error_report")


class ConstructorFlight(JobFlight):
    """A Constructor's builds over Flight (`build(gen, step, dp_rank, limit, cp, with_state, client)` is the
    actor's `get`), listening from construction on (bound to `host`, a free port) until `shutdown()` or
    the process ends; `location` is where clients reach it."""

    def __init__(self, build: Callable, host: str, token: str):
        super().__init__(grpc_location(host, 0), token, get=build)
        # Bound to every interface: tell clients this node's address (trainers on other nodes connect).
        advertised = ray_module().util.get_node_ip_address() if host in ("0.0.0.0", "::") else host
        self.location = grpc_location(advertised, self.port)


class PlannerCalls:
    """The job's Planner as an answerer: `ask(method, *args)` calls it (its standby's successor if it died:
    RayRuntime.ask_planner)."""

    def __init__(self, ask: Callable[..., Any]):
        self.ask = ask

    def __getattr__(self, name: str):
        if name not in PLANNER_ACTIONS:
            raise AttributeError(name)
        return functools.partial(self.ask, name)


class RendezvousFlight(JobFlight):
    """The job's front door: `serving` (the JobServer) answers `hello`, `attach`, `reconnect` and
    `replan_after`, the Planner (through `ask`) the rest."""

    def __init__(self, ask: Callable[..., Any], serving, location: str, token: str):
        super().__init__(location, token, (serving, PlannerCalls(ask)))
