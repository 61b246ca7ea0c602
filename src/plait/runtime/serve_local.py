"""One process serves a whole job to thin trainer clients (`plait serve SPEC --job NAME --runtime local`).

No Ray: the local runtime's roles (plait.runtime.local.LocalRuntime: one Planner, one SourceLoader over
every source, the Constructor) run in this process, and one Arrow Flight server here speaks the protocol
of plait.runtime.flight, so trainers use `plait.Loader(spec, dp_rank, runtime="flight")` unchanged:

  * the rendezvous actions (`hello`, `base`, `seek`, `seek_with_changes`, `state_at`, `set_weights`,
    `report`, `error_report`) are answered by `LocalJob`, the shared plan stream (each step planned once
    for every rank, a window of planned steps, generations reset by `seek`), as the Ray Planner actor does;
  * `hello` names this same server as every DP rank's endpoint, and `do_get` streams one step of one rank:
    built once per (generation, step, rank), `prefetch` steps ahead in a background thread (as the Ray
    Constructor does), cut to the asking CP rank with plait.context_parallel.shard_for_rank.

The Planner and the SourceLoader are not thread-safe: one lock serialises planning, building and every
action; builds run in one background thread, so a trainer's request finds its step built already.
Memory: one process, one buffer per source (its `buffer_mb`, capped job-wide by `loading.max_buffer_mb`).
"""

from __future__ import annotations

import queue
import secrets
import socket
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any


from plait.batch import MicroBatch
from plait.context_parallel import shard_for_rank
from plait.errors import PlaitError
from plait.plan import StepPlan
from plait.runtime.flight import PROTOCOL, dumps, loads, location_of
from plait.runtime.flight_serving import (
    ActionServer,
    as_flight_error,
    grpc_location,
    split_address,
    step_stream,
    wants_state,
)
from plait.runtime.local import LocalRuntime
from plait.runtime.processes import Clients
from plait.spec import Spec, load_spec

PLAN_WINDOW = 64  # planned steps kept (the ranks of one job are at most `prefetch` steps apart)
def _same_state(a: dict, b: dict) -> bool:
    """Equal as the client sees them (a state that went through JSON has lists for tuples)."""
    return loads(dumps(a)) == loads(dumps(b))


class BuildThread:
    """One background thread that runs queued builds. Not a concurrent.futures pool: that one refuses new
    work once the interpreter starts to exit, and a node's host (plait.runtime.node_share) must keep
    building for the node's other processes while its own process is finishing."""

    def __init__(self):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._work, name="plait-build", daemon=True)
        self.thread.start()

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        self.queue.put((fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(e)

    def shutdown(self) -> None:
        """Cancel what has not started, finish what has."""
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        self.queue.put(None)
        self.thread.join()


class LocalJob:
    """A job's shared plan stream and builds over an in-process LocalRuntime (thread-safe).

    `dp`: override the topology's DP size; `prefetch`: steps built ahead of each rank's request."""

    def __init__(self, spec: Spec, *, dp: int | None = None, prefetch: int = 2, metrics_port: int | None = None):
        self.runtime = LocalRuntime(spec, dp=dp, metrics_port=metrics_port)
        self.ranks = self.runtime.planner.ranks
        self.prefetch = max(0, int(prefetch))
        self.lock = threading.RLock()
        self.gen = 0
        self.base_state = self.runtime.state_dict()
        self.window: OrderedDict[int, StepPlan] = OrderedDict()
        self.built: dict[int, set[int]] = {}  # step -> DP ranks built (the step's blocks are released then)
        self.builds: dict[tuple[int, int, int], Future] = {}  # (gen, step, dp_rank) -> (state, batches)
        self.pool = BuildThread()

    # ----- the plan stream (the Ray Planner actor's, in this process) -----------------------------------
    def base(self) -> tuple[int, dict]:
        with self.lock:
            return self.gen, self.base_state

    def seek(self, state: dict) -> int:
        """Make step state['step'] start from `state`; a no-op when the stream already does."""
        with self.lock:
            step = int(state["step"])
            plan = self.window.get(step)
            if plan is not None and _same_state(plan.state_before, state):
                return self.gen
            if plan is None and self.runtime.planner.step == step and _same_state(self.runtime.state_dict(), state):
                return self.gen
            self.runtime.load_state_dict(state)  # validates version and fingerprint
            return self._new_generation()

    def seek_with_changes(self, state: dict) -> tuple[int, list[str]]:
        with self.lock:
            changes = self.runtime.load_state_dict(state, allow_spec_change=True) or []
            return self._new_generation(), list(changes)

    def _new_generation(self) -> int:
        self.window.clear()
        self.built.clear()
        for fut in self.builds.values():
            fut.cancel()
        self.builds.clear()
        self.base_state = self.runtime.state_dict()
        self.gen += 1
        return self.gen

    def state_at(self, gen: int, step: int) -> dict:
        with self.lock:
            if gen == self.gen and step == self.base_state["step"]:
                return self.base_state
            if gen == self.gen and step == self.runtime.planner.step:
                return self.runtime.state_dict()
            return self._plan(gen, step).state_before

    def set_weights(self, weights: dict, at_step: int) -> None:
        self.runtime.set_weights(weights, at_step)  # the Planner refuses a step already planned

    def report(self, step: int, losses: dict) -> None:
        self.runtime.report(step, losses)

    def error_report(self) -> dict:
        with self.lock:
            return self.runtime.error_report()

    def _plan(self, gen: int, step: int) -> StepPlan:
        if gen != self.gen:
            raise PlaitError(f"the plan stream was reset (generation {self.gen}, asked {gen}): another trainer "
                             "loaded a different data state; resume every rank from the same state")
        if step in self.window:
            return self.window[step]
        if step < self.runtime.planner.step:
            raise PlaitError(f"step {step} left the job's plan window; resume from a saved state")
        while self.runtime.planner.step <= step:
            plan = self.runtime.plan()
            self.window[plan.step] = plan
            while len(self.window) > PLAN_WINDOW:
                old, _ = self.window.popitem(last=False)
                self.built.pop(old, None)
        self._release()
        return self.window[step]

    def _release(self) -> None:
        """The loader keeps the Planner's live blocks and those of steps some rank has not built yet."""
        self.runtime.release(*(plan for s, plan in self.window.items() if len(self.built.get(s, ())) < self.ranks))

    # ----- builds (the Ray Constructor's, in this process) ----------------------------------------------
    def _build(self, gen: int, step: int, dp_rank: int) -> tuple[dict, list[MicroBatch]]:
        with self.lock:
            plan = self._plan(gen, step)
            batches = self.runtime.build(plan, dp_rank)
            done = self.built.setdefault(step, set())
            done.add(dp_rank)
            if len(done) == self.ranks:
                self._release()
            return plan.state_before, batches

    def _ensure(self, gen: int, step: int, dp_rank: int) -> Future:
        key = (gen, step, dp_rank)
        if key not in self.builds:
            self.builds[key] = self.pool.submit(self._build, gen, step, dp_rank)
        return self.builds[key]

    def get(self, gen: int, step: int, dp_rank: int, limit: int | None = None,
            cp: tuple[int, int] = (1, 0), with_state: bool = True) -> tuple[dict | None, list[MicroBatch]]:
        """(state at the start of `step` or None without `with_state`, the rank's micro-batches of `step` cut
        to CP rank cp[1] of cp[0]); the next `prefetch` steps of the rank are queued behind it."""
        if not 0 <= dp_rank < self.ranks:
            raise PlaitError(f"dp_rank {dp_rank} is not one of this job's {self.ranks} DP ranks")
        with self.lock:
            fut = self._ensure(gen, step, dp_rank)
            for k in range(1, self.prefetch + 1):
                if limit is None or step + k < limit:
                    self._ensure(gen, step + k, dp_rank)
            # Keep a little history: other CP ranks of the replica may still ask for it.
            for key in [k for k in self.builds if k[2] == dp_rank and (k[0] != gen or k[1] < step - self.prefetch - 1)]:
                self.builds.pop(key).cancel()
        try:
            state, batches = fut.result()
        except BaseException:
            with self.lock:
                self.builds.pop((gen, step, dp_rank), None)
            raise
        return state if with_state else None, shard_for_rank(batches, *cp)

    def close(self) -> None:
        self.pool.shutdown()
        self.runtime.close()


class LocalFlight(ActionServer):
    """The job's one Flight server: rendezvous actions and every rank's `do_get`."""

    def __init__(self, job: LocalJob, info: dict, location: str, token: str):
        super().__init__(location, token, info)
        self.job = job
        self.clients = Clients()

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
            "join": lambda: self.clients.join(body["id"], int(body["pid"])),
            "leave": lambda: self.clients.leave(body["id"]),
        }
        if name not in calls:
            raise PlaitError(f"unknown action {name!r} (this server speaks plait Flight protocol {PROTOCOL})")
        return calls[name]()

    def endpoint(self, dp_rank: int) -> str:
        if str(dp_rank) not in self.info["endpoints"]:
            raise PlaitError(f"dp_rank {dp_rank} is not one of this job's {self.job.ranks} DP ranks")
        return self.info["endpoints"][str(dp_rank)]

    def do_get(self, context, ticket):
        t = loads(ticket.ticket)
        try:
            state, batches = self.job.get(int(t["gen"]), int(t["step"]), int(t["dp_rank"]), t.get("limit"),
                                          tuple(int(c) for c in t["cp"]), wants_state(t))
        except PlaitError as e:
            raise as_flight_error(e) from None
        return step_stream(state, batches)


class LocalJobServer:
    """Job `job` of `spec` in this process, served over Arrow Flight at `listen` (`host:port`, port 0 = a
    free one; `self.address` is where it listens). `token`: the job's token (default: a fresh random one,
    `self.token`). `dp`, `prefetch`, `metrics_port`: LocalJob's. `close()` ends the job."""

    def __init__(self, spec: Spec | dict | str, job: str, listen: str = "127.0.0.1:0", *, token: str | None = None,
                 dp: int | None = None, prefetch: int = 2, metrics_port: int | None = None):
        self.spec = load_spec(spec)
        host, port = split_address(listen)
        self.token = token or secrets.token_urlsafe(32)
        self.stopped = threading.Event()
        self.local = LocalJob(self.spec, dp=dp, prefetch=prefetch, metrics_port=metrics_port)
        self.ranks = self.local.ranks
        info = {"job": job, "fingerprint": self.spec.data_fingerprint(), "ranks": self.ranks,
                "cp": self.spec.topology.cp}
        try:
            self.server = LocalFlight(self.local, info, grpc_location(host, port), self.token)
        except BaseException:
            self.local.close()
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
    def clients(self) -> Clients:
        """The trainer processes that joined (plait.runtime.node_share)."""
        return self.server.clients

    def wait(self, timeout: float | None = None) -> bool:
        """Block until `close()` (or `timeout` seconds); True when closed."""
        return self.stopped.wait(timeout)

    def close(self) -> None:
        if self.stopped.is_set():
            return
        self.server.shutdown()
        self.local.close()
        self.stopped.set()

    def __enter__(self) -> "LocalJobServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

