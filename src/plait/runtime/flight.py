"""The thin trainer client: micro-batches over Arrow Flight from the node's Constructor; no Ray here.

    loader = plait.Loader(spec, dp_rank, runtime="flight", job_address="127.0.0.1:8815", token="...")

A job served by `plait serve SPEC --job NAME` (plait.runtime.ray.flight_server) has one front door, the
*rendezvous* Flight server of the serving process, at `address` (or `PLAIT_ADDRESS`), and one Flight
server per Constructor actor. Every call carries the job's token (`authorization: Bearer <token>`; from
`token=`, `PLAIT_TOKEN` or the file named by `PLAIT_TOKEN_FILE`); a wrong one is refused.

Protocol (version `PROTOCOL`; requests and replies of actions are JSON):
  rendezvous  action `hello`    -> {protocol, job, fingerprint, mixture, ranks, cp, endpoints: {dp_rank: location}}
              (`fingerprint`: Spec.data_fingerprint, `mixture`: Spec.mixture_fingerprint; a client whose
              spec differs in either is refused)
              actions `base`, `seek`, `seek_with_changes`, `state_at`, `set_weights`, `report`,
              `error_report`: the job's Planner's methods of the same name
              action `attach` {dp_rank, node} -> location: the rank's Constructor on the asking trainer's
              node (`node`: PLAIT_NODE, a Ray node's id, name or IP; else the connection's address)
              action `reconnect` {dp_rank, step} -> endpoints: asked by a client whose Constructor
              stopped answering; the server replaces it if it died (it rebuilds the step from the
              Planner's window), and the client repeats the step (at most RECONNECTS times)
  constructor do_get(ticket)    ticket = JSON {gen, step, dp_rank, limit, cp: [size, rank], state, client}: one step's
              micro-batches of that rank, one record batch (one row) per micro-batch. Columns: each
              array field of `plait.Batch` as list<T> (1-D) or list<fixed_size_list<T, k>> (2-D:
              sample_ids [docs, 5]); null where the field is None. Schema metadata `plait.state`: the
              data state at the step's start, only when the ticket's `state` is true (its default);
              this client asks without it and fetches it with `state_at` when the trainer checkpoints
              (StateRef): a step then carries tokens, not the state of every source. Each record
              batch's app_metadata:
              JSON {step, microbatch, num_microbatches, dp_rank, stats, shapes, dtypes}. `client` (optional)
              names the reader: a one-process server's plan window waits for its slowest live reader
              (docs/serving.md).

The client hands numpy views of the received Arrow buffers (`to_numpy(zero_copy_only=True)`): no copy
after the wire; they are read-only (`Batch.to_torch()` copies them, as it does Ray's object-store views).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import uuid
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from plait.batch import MicroBatch
from plait.errors import PlaitError
from plait.job.stream import asked, read_rank
from plait.runtime.options import renamed
from plait.runtime.served_calls import ServedJobCalls
from plait.state.log import StateRef
from plait.spec import Spec, load_spec

PROTOCOL = 1
STATE_KEY = b"plait.state"
CALL_TIMEOUT = 60.0  # seconds a control call (an action) may take
RECONNECTS = 3  # a step whose Constructor is lost is asked again this many times (each after `reconnect`)
ERROR_MARK = "PlaitError: "  # a server-side PlaitError travels as a FlightServerError with this prefix
SCALARS = ("step", "microbatch", "num_microbatches", "dp_rank")


# ----- JSON that keeps numpy arrays (stats["cp"]["cu_seqlens"]) and numpy scalars --------------------------
def _to_json(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return {"__ndarray__": x.tolist(), "dtype": x.dtype.str, "shape": list(x.shape)}
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON-serialisable")


def _from_json(d: dict) -> Any:
    if "__ndarray__" in d:
        return np.asarray(d["__ndarray__"], dtype=np.dtype(d["dtype"])).reshape(d["shape"])
    return d


def dumps(x: Any) -> bytes:
    return json.dumps(x, default=_to_json, separators=(",", ":")).encode()


def loads(b: bytes | memoryview) -> Any:
    return json.loads(bytes(b) or b"null", object_hook=_from_json)


# ----- the wire format of one step ---------------------------------------------------------------------
def array_fields() -> list[str]:
    """The fields of `plait.Batch` that may hold arrays (all but the scalars and stats)."""
    return [f.name for f in dataclasses.fields(MicroBatch) if f.name not in SCALARS and f.name != "stats"]


def _wire_array(a: np.ndarray) -> np.ndarray:
    """A contiguous array Arrow takes without copying (bool travels as uint8, restored by its dtype)."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint8) if a.dtype == np.bool_ else a


def _column_type(a: np.ndarray) -> pa.DataType:
    t = pa.from_numpy_dtype(_wire_array(a).dtype)
    if a.ndim == 2:
        return pa.list_(pa.list_(t, int(a.shape[1])))
    return pa.list_(t)


def step_schema(state: dict | None, batches: list[MicroBatch]) -> pa.Schema:
    """One list column per array field present in the step (the first batch with it gives its type); the
    data state, when asked for, in the schema's metadata."""
    cols = {}
    for name in array_fields():
        for mb in batches:
            a = getattr(mb, name, None)
            if isinstance(a, np.ndarray):
                cols[name] = _column_type(a)
                break
    return pa.schema([pa.field(n, t) for n, t in cols.items()],
                     metadata=None if state is None else {STATE_KEY: dumps(state)})


def encode_batch(schema: pa.Schema, mb: MicroBatch) -> tuple[pa.RecordBatch, pa.Buffer]:
    """A micro-batch as a one-row record batch (zero-copy over its numpy arrays) and its app_metadata."""
    arrays, shapes, dtypes = [], {}, {}
    for field in schema:
        a = getattr(mb, field.name, None)
        if a is None:
            arrays.append(pa.nulls(1, field.type))
            continue
        a = np.asarray(a)
        shapes[field.name], dtypes[field.name] = list(a.shape), a.dtype.str
        values = pa.array(_wire_array(a).reshape(-1))
        if a.ndim == 2:
            if a.shape[1] != field.type.value_type.list_size:
                raise PlaitError(f"field {field.name}: rows of {a.shape[1]} in one micro-batch of a step and of "
                                 f"{field.type.value_type.list_size} in another")
            values = pa.FixedSizeListArray.from_arrays(values, int(a.shape[1]))
        arrays.append(pa.ListArray.from_arrays(pa.array([0, len(values)], pa.int32()), values))
    meta = {k: int(getattr(mb, k)) for k in SCALARS}
    meta.update(stats=mb.stats, shapes=shapes, dtypes=dtypes)
    return pa.RecordBatch.from_arrays(arrays, schema=schema), pa.py_buffer(dumps(meta))


def _row_values(col: pa.Array) -> pa.Array:
    """The values of a one-row list column (list<T> or list<fixed_size_list<T, k>>) as a flat array view.
    Read through offsets and `.values`: `Array.flatten()` would import pyarrow.compute, ~10 MiB in every
    trainer process for nothing."""
    offsets = col.offsets
    start, end = offsets[0].as_py(), offsets[len(offsets) - 1].as_py()
    values = col.values.slice(start, end - start)
    if pa.types.is_fixed_size_list(values.type):
        width = values.type.list_size
        values = values.values.slice(values.offset * width, len(values) * width)
    return values


def decode_batch(rb: pa.RecordBatch, app_metadata) -> MicroBatch:
    """A received record batch as a `plait.Batch` whose arrays are views of the Arrow buffers."""
    meta = loads(memoryview(app_metadata))
    kwargs: dict[str, Any] = {k: int(meta[k]) for k in SCALARS}
    known = set(array_fields())
    for name in rb.schema.names:
        if name not in known:
            continue
        col = rb.column(name)
        if col.null_count:
            kwargs[name] = None
            continue
        a = _row_values(col).to_numpy(zero_copy_only=True)
        dtype = np.dtype(meta["dtypes"][name])
        if a.dtype != dtype:
            a = a.view(dtype)
        kwargs[name] = a.reshape(meta["shapes"][name])
    kwargs["stats"] = meta.get("stats") or {}
    return MicroBatch(**kwargs)


# ----- errors, addresses, tokens -------------------------------------------------------------------------
def location_of(address: str) -> str:
    """`host:port` (or a grpc:// location) as a Flight location."""
    if "://" in address:
        return address
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise PlaitError(f"address {address!r} is not host:port (e.g. 127.0.0.1:8815, as `plait serve` printed)")
    return f"grpc+tcp://{address}"


def read_token(token: str | None) -> str:
    """The job token: the argument, else PLAIT_TOKEN, else the file named by PLAIT_TOKEN_FILE."""
    token = token or os.environ.get("PLAIT_TOKEN")
    path = os.environ.get("PLAIT_TOKEN_FILE")
    if not token and path:
        try:
            token = Path(path).read_text().strip()
        except OSError as e:
            raise PlaitError(f"cannot read the job token from PLAIT_TOKEN_FILE={path!r}: {e.strerror or e}") from None
    if not token:
        raise PlaitError("the flight runtime needs the job's token: pass token=..., or set PLAIT_TOKEN (or "
                         "PLAIT_TOKEN_FILE) to what `plait serve` printed")
    return token


@dataclasses.dataclass(frozen=True)
class ServerHints:
    """What a Flight failure's sentence tells the user to check, in the terms of whoever serves the job."""

    token: str  # the server refused this client's token
    down: str  # nobody answers at the address


SERVE_HINTS = ServerHints(
    token="PLAIT_TOKEN must be the token `plait serve` printed for this job",
    down="is `plait serve` running there, and is the port right?",
)


class EndpointLost(PlaitError):
    """A Constructor's Flight server stopped answering (its process died, or the network dropped): the
    client asks the rendezvous for the rank's endpoint again (`reconnect`) and repeats the step."""


def plait_error(e: Exception, where: str, hints: ServerHints = SERVE_HINTS) -> PlaitError:
    """A Flight failure as one sentence."""
    text = str(e)
    if isinstance(e, flight.FlightUnauthenticatedError):
        return PlaitError(f"the plait job at {where} refused this client's token ({hints.token})")
    if isinstance(e, flight.FlightUnavailableError):
        return PlaitError(f"no plait job answers at {where} ({hints.down}): {text.splitlines()[0][:200]}")
    if isinstance(e, flight.FlightTimedOutError):
        return PlaitError(f"the plait job at {where} did not answer in time: {text.splitlines()[0][:200]}")
    if ERROR_MARK in text:
        msg = text.split(ERROR_MARK, 1)[1]
        for end in (". Detail:", "\nDetail:", ". gRPC client debug context", "\n"):
            msg = msg.split(end, 1)[0]
        return PlaitError(msg)
    return PlaitError(f"the plait job at {where} failed: {text.splitlines()[0][:300] if text else type(e).__name__}")


class Channel:
    """One authenticated Flight connection: JSON actions and step streams."""

    def __init__(self, location: str, token: str, timeout: float | None, hints: ServerHints = SERVE_HINTS):
        self.location = location
        self.hints = hints
        self.client = flight.FlightClient(location)
        headers = [(b"authorization", b"Bearer " + token.encode())]
        self.options = flight.FlightCallOptions(headers=headers, timeout=timeout)
        self.stream_options = flight.FlightCallOptions(headers=headers)  # a build may take long: no deadline

    def action(self, name: str, body: Any = None) -> Any:
        try:
            results = list(self.client.do_action(flight.Action(name, dumps(body)), options=self.options))
        except (flight.FlightError, pa.ArrowException) as e:
            raise plait_error(e, self.location, self.hints) from None
        return loads(memoryview(results[0].body)) if results else None

    def step(self, ticket: dict) -> tuple[dict | None, list[MicroBatch]]:
        """(state at the step's start, or None when the ticket did not ask for it; the step's micro-batches)
        for a do_get ticket."""
        try:
            reader = self.client.do_get(flight.Ticket(dumps(ticket)), options=self.stream_options)
            metadata = reader.schema.metadata or {}
            state = loads(metadata[STATE_KEY]) if STATE_KEY in metadata else None
            batches = []
            while True:
                try:
                    chunk = reader.read_chunk()
                except StopIteration:
                    break
                batches.append(decode_batch(chunk.data, chunk.app_metadata))
        except flight.FlightUnavailableError as e:  # nobody answers there (any more)
            raise EndpointLost(str(plait_error(e, self.location, self.hints))) from None
        except (flight.FlightError, pa.ArrowException) as e:
            raise plait_error(e, self.location, self.hints) from None
        return state, batches

    def close(self) -> None:
        self.client.close()


class FlightRuntime(ServedJobCalls):
    """The runtime interface (see plait.runtime) as a thin client of a job served over Arrow Flight.

    Options: `job_address` (the served job's rendezvous `host:port`; default PLAIT_ADDRESS), `token`
    (default PLAIT_TOKEN or PLAIT_TOKEN_FILE), `job` (checked against the served job's name),
    `call_timeout` (seconds a control call may take, default 60; a step's stream has none). `address`
    and `timeout` are their deprecated names. Checks that the served job runs this spec (its data and its
    mixture: a spec that differs only in weights is refused too) on the same number of DP ranks. Ray is
    never imported.
    """

    hints = SERVE_HINTS  # a client of another server (a node's data host) says its own

    @staticmethod
    def option_names() -> list[str]:
        return ["job_address", "token", "job", "call_timeout", "address", "timeout"]

    def __init__(self, spec: Spec, *, job_address: str | None = None, token: str | None = None,
                 job: str | None = None, call_timeout: float | None = None, address: str | None = None,
                 timeout: float | None = None):
        self.spec = load_spec(spec)
        address = renamed("address", address, "job_address", job_address) or os.environ.get("PLAIT_ADDRESS")
        timeout = renamed("timeout", timeout, "call_timeout", call_timeout)
        timeout = CALL_TIMEOUT if timeout is None else timeout
        if not address:
            raise PlaitError("the flight runtime needs the job's address: pass job_address='host:port' or set "
                             "PLAIT_ADDRESS (`plait serve SPEC --job NAME` prints it)")
        self.address = address
        self._token = read_token(token)
        self._timeout = timeout
        self._closed = False
        self.reconnects = 0  # steps asked again after their Constructor was lost
        self.client_id = uuid.uuid4().hex  # names this reader to the job (its window waits for slow readers)
        self._reads_control = False  # the job's one server also serves the steps (`plait serve --runtime local`)
        self._attached: set[int] = set()  # DP ranks whose endpoint was asked for this trainer's node
        self._data: dict[str, Channel] = {}
        self.control = Channel(location_of(address), self._token, timeout, self.hints)
        try:
            self.info = self.control.action("hello", {"protocol": PROTOCOL})
            self._check(job)
            self._start_from_base()
        except BaseException:
            self.close()
            raise

    def _check(self, job: str | None) -> None:
        info = self.info
        if info.get("protocol") != PROTOCOL:
            raise PlaitError(f"the job at {self.address} speaks plait Flight protocol {info.get('protocol')}, this "
                             f"client {PROTOCOL}: use the same plait version on both sides")
        if job is not None and job != info["job"]:
            raise PlaitError(f"the job at {self.address} is {info['job']!r}, not {job!r}")
        if info["fingerprint"] != self.spec.data_fingerprint():
            raise PlaitError(f"job {info['job']!r} at {self.address} runs a different spec (data fingerprint differs)")
        mixture = info.get("mixture")  # absent from a server of plait before it was checked
        if mixture is not None and mixture != self.spec.mixture_fingerprint():
            raise PlaitError(
                f"job {info['job']!r} at {self.address} runs another mixture than this client's spec (weights, "
                "schedule, source windows or online policy differ), and a thin client reads the served job's "
                "stream: give every trainer the served spec. To change the mixture, serve the new spec and resume "
                "every rank with load_state_dict(state, allow_spec_change=True); set_weights changes it while it runs"
            )
        if int(info["ranks"]) != self.spec.topology.dp:
            raise PlaitError(f"job {info['job']!r} plans for {info['ranks']} DP ranks, this client's topology has "
                             f"{self.spec.topology.dp}: every trainer process of a job must use the same spec and layout")

    def _attach(self, dp_rank: int) -> None:
        """Ask for the rank's Constructor on this trainer's node (PLAIT_NODE, else the address this
        connection comes from); the job moves the rank there on its first trainer's request."""
        if dp_rank in self._attached:
            return
        body = {"dp_rank": dp_rank, "node": os.environ.get("PLAIT_NODE") or None}
        self.info["endpoints"][str(dp_rank)] = self.control.action("attach", body)
        self._attached.add(dp_rank)

    def _channel(self, dp_rank: int) -> Channel:
        self._attach(dp_rank)
        location = self.info["endpoints"].get(str(dp_rank))
        if location is None:
            raise PlaitError(f"job {self.job!r} serves no Constructor for DP rank {dp_rank}")
        if location == self.control.location:  # one server for both (`plait serve --runtime local`)
            self._reads_control = True
            return self.control
        if location not in self._data:
            self._data[location] = Channel(location, self._token, self._timeout, self.hints)
        return self._data[location]

    # ----- what a trainer rank uses --------------------------------------------------------------------
    def iter_rank(self, dp_rank: int, start_state: dict, start_micro: int, max_steps: int | None,
                  cp_rank: int = 0) -> Iterator[tuple[dict, MicroBatch]]:
        """One rank's micro-batches from a data state on, each CP rank's shard cut by the Constructor; the
        Constructor builds steps ahead of the requests."""
        self._seek(start_state)
        channel = [self._channel(dp_rank)]  # the rank's server: replaced when it is lost

        def receive(step: int, _: int) -> tuple[dict | StateRef, list[MicroBatch]]:
            ticket = {"gen": self._gen, "step": step, "dp_rank": dp_rank, "limit": max_steps,
                      "cp": [self.spec.topology.cp, cp_rank], "state": False, "client": self.client_id}
            state, batches, channel[0] = self._fetch_step(channel[0], ticket)
            if state is None:  # fetched only if the trainer checkpoints during this step
                state = StateRef(step, functools.partial(self.state_at, self._gen, step))
            self._next_step = step + 1
            return state, batches

        return read_rank(asked, receive, int(start_state["step"]), start_micro, max_steps)

    def _fetch_step(self, channel: Channel, ticket: dict) -> tuple[dict | None, list[MicroBatch], Channel]:
        """A step from the rank's Constructor; if it is lost, the rendezvous replaces a dead one (which
        rebuilds the step from the Planner's window: the same micro-batches, none lost or repeated)."""
        for attempt in range(RECONNECTS + 1):
            try:
                state, batches = channel.step(ticket)
                return state, batches, channel
            except EndpointLost:
                if attempt == RECONNECTS:
                    raise
                if channel is not self.control:
                    self._data.pop(channel.location, None)
                    channel.close()
                self.info["endpoints"] = self.control.action(
                    "reconnect", {"dp_rank": ticket["dp_rank"], "step": ticket["step"]})
                self.reconnects += 1
                channel = self._channel(int(ticket["dp_rank"]))
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close the connections (the served job goes on: `plait serve` owns it)."""
        if self._closed:
            return
        self._closed = True
        if self._reads_control:  # a one-process server stops holding its plan window for this reader
            try:
                self.control.action("leave", {"id": self.client_id})
            except PlaitError:
                pass  # the job is gone already
        for channel in [self.control, *self._data.values()]:
            try:
                channel.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
        self._data.clear()
