"""A trainer on its node's data host's machine: micro-batches from shared memory (plait.runtime.node_shm).

The thin client of plait.runtime.node_shm_host, a stream as plait.runtime.flight.FlightRuntime is (same
actions, same plan stream, same checks of the served spec), over two `multiprocessing.connection`
connections instead of Flight: control (actions) and data (steps: a segment's name and layout, which it
maps and says `mapped`). It imports numpy and the standard library only: no pyarrow, no gRPC.
"""

from __future__ import annotations

import functools
import os
import threading
import uuid
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any, Iterator

from plait.batch import MicroBatch
from plait.errors import PlaitError
from plait.job.stream import asked, read_rank
from plait.runtime.node_shm import map_segment, remove_leftovers
from plait.runtime.served_calls import ServedJobCalls
from plait.spec import Spec
from plait.state.log import StateRef

HOST_DOWN = ("this node's data host, the trainer process with LOCAL_RANK 0, has ended or died: every process of "
             "the node reads its batches from it, so restart the launch (share='process' makes each process "
             "load alone)")


class ShmChannel:
    """One authenticated connection to the node's host: a request and its answer at a time."""

    def __init__(self, address: str, token: str):
        try:
            self.conn = Client(address, family="AF_UNIX", authkey=token.encode())
        except (OSError, EOFError) as e:
            raise PlaitError(f"no data host answers on this node's socket ({type(e).__name__}: {e}): "
                             f"{HOST_DOWN}") from None
        except AuthenticationError as e:  # another launch's host
            raise PlaitError(f"this node's data host refused the token in its rendezvous file ({e}): a stale "
                             "file of an earlier launch, or two launches sharing PLAIT_NODE_DIR and run id") from None
        self.lock = threading.Lock()

    def call(self, op: str, args: Any) -> Any:
        with self.lock:
            try:
                self.conn.send((op, args))
                kind, value = self.conn.recv()
            except (EOFError, OSError):
                raise PlaitError(HOST_DOWN) from None
        if kind == "error":
            raise PlaitError(value)
        return value

    def tell(self, op: str, args: Any) -> None:
        """A message without an answer."""
        with self.lock:
            try:
                self.conn.send((op, args))
            except OSError:
                raise PlaitError(HOST_DOWN) from None

    def action(self, name: str, body: dict | None = None) -> Any:
        """One action of the Flight protocol (plait.runtime.flight), answered by the host's action table."""
        return self.call("action", (name, body or {}))

    def close(self) -> None:
        self.conn.close()


class ShmNodeClient(ServedJobCalls):
    """One trainer process's stream from its node's host through shared memory. `shm`: the rendezvous
    file's {"address", "dir", "pid"}; `token`: the job's."""

    def __init__(self, spec: Spec, shm: dict, token: str, job: str | None = None):
        self.spec = spec
        self.folder, self.host_pid = Path(shm["dir"]), int(shm["pid"])
        self.client_id = uuid.uuid4().hex
        self._closed = False
        self.control = ShmChannel(shm["address"], token)
        try:
            self.data = ShmChannel(shm["address"], token)
            self.info = self.control.action("hello")
            self._check(job)
            self._start_from_base()
        except BaseException:
            self.close()
            raise

    def _check(self, job: str | None) -> None:
        info, spec = self.info, self.spec
        if job is not None and job != info["job"]:
            raise PlaitError(f"this node's data host serves job {info['job']!r}, not {job!r}")
        if info["fingerprint"] != spec.data_fingerprint() or info.get("mixture") != spec.mixture_fingerprint():
            raise PlaitError(f"this node's data host serves job {info['job']!r} with another spec (its data or "
                             "mixture differ): every process of the node must create the same Loader")
        if int(info["ranks"]) != spec.topology.dp:
            raise PlaitError(f"job {info['job']!r} plans for {info['ranks']} DP ranks, this process's topology has "
                             f"{spec.topology.dp}: every trainer process of a job must use the same spec and layout")

    def iter_rank(self, dp_rank: int, start_state: dict, start_micro: int, max_steps: int | None,
                  cp_rank: int = 0) -> Iterator[tuple[dict, MicroBatch]]:
        self._seek(start_state)

        def receive(step: int, _: int) -> tuple[dict | StateRef, list[MicroBatch]]:
            ask = (self._gen, step, dp_rank, max_steps, (self.spec.topology.cp, cp_rank), False, self.client_id)
            state, (name, size, layouts) = self.data.call("get", ask)
            batches = self._map(name, size, layouts)
            if state is None:  # fetched only if the trainer checkpoints during this step
                state = StateRef(step, functools.partial(self.state_at, self._gen, step))
            self._next_step = step + 1
            return state, batches

        return read_rank(asked, receive, int(start_state["step"]), start_micro, max_steps)

    def _map(self, name: str | None, size: int, layouts: list) -> list[MicroBatch]:
        try:
            batches = map_segment(None if name is None else self.folder / name, size, layouts)
        except OSError as e:
            raise PlaitError(f"cannot map segment {name} of this node's data host in {self.folder}: "
                             f"{e.strerror or e}") from None
        if name is not None:
            self.data.tell("mapped", name)  # its name may go: this mapping keeps the pages
        return batches

    def remove_host_leftovers(self) -> None:
        """The segments a dead host left (written, never mapped); nothing while it lives."""
        remove_leftovers(self.folder, only_pid=self.host_pid)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for channel in (getattr(self, "control", None), getattr(self, "data", None)):
            if channel is not None:
                channel.close()
        if self.host_pid != os.getpid():
            self.remove_host_leftovers()
