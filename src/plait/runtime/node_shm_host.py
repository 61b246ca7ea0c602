"""The node's data host, serving the trainers on its machine through shared memory (plait.runtime.node_shm).

The host (plait.runtime.node_share) listens on a unix-domain socket of the abstract namespace
(`multiprocessing.connection`, authenticated with the job's token; the kernel removes the name with the
process); its Flight server starts only when a rank asks for it (request `flight`: a rank with
transport="flight"). Each trainer opens two connections: control (the actions of the Flight protocol,
answered by the same action table: plait.runtime.flight_serving.answer_action) and data (one step of one
rank at a time). For a step the host writes the rank's micro-batches once into a segment and answers its
name and layout; the trainer maps it and says so (`mapped`).

Lifetime: a segment is unlinked as soon as every connection that has read its (DP rank, CP rank) has
mapped it (the TP and PP ranks of a replica read one segment; a reader is known from its first request, so
a peer whose first request comes after the write gets a copy of its own, and a peer that stays connected
without reading holds its rank's segments until its connection closes), when the connection that waits for it closes (a
trainer that died: its socket closes with it), when the stream starts a new generation, and when the host
closes. Back-pressure is the plan window's: a request waits in JobService.get, never here. A host killed
outright leaves at most the segments written and not yet mapped; its lock beside them is free once it is
gone, and whoever sees that removes them (node_shm.remove_leftovers).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import secrets
import threading
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener, Pipe, wait
from pathlib import Path

from plait.errors import PlaitError
from plait.runtime.flight_serving import answer_action
from plait.runtime.node_shm import hold_host_lock, release_host_lock, remove_leftovers, segment_prefix, write_segment

log = logging.getLogger("plait.node")
Key = tuple  # (gen, step, dp_rank, cp size, cp rank): one segment serves every reader of it


@dataclass
class Held:
    """A written segment whose name still exists: who must map it before it goes."""

    name: str
    gen: int
    reads: tuple[int, int]  # (DP rank, CP rank) of its readers
    reply: tuple  # (name or None, size, layouts)
    mapped_by: set[int] = field(default_factory=set)


class Segments:
    """The host's written, not yet fully mapped segments, and which connection reads which rank."""

    def __init__(self, folder: Path, prefix: str):
        self.folder, self.prefix = folder, prefix
        try:
            self.host_lock: int | None = hold_host_lock(folder, prefix)  # held while this process lives (node_shm)
        except OSError:
            self.host_lock = None  # no folder to write in: the first write says so, naming the remedies
        self.lock = threading.Lock()
        self.held: dict[Key, Held] = {}
        self.readers: dict[int, tuple[int, int]] = {}  # connection id -> (DP rank, CP rank) it reads
        self.counter = itertools.count()

    def get(self, conn_id: int, key: Key, batches: list) -> tuple:
        """The segment of `key` for connection `conn_id`: the one held (another reader of the rank's step
        asked first), else `batches` written now."""
        gen, reads = key[0], (key[2], key[4])
        with self.lock:
            self.readers[conn_id] = reads
            for old in [k for k, h in self.held.items() if h.gen < gen]:  # an older generation is never read
                self._drop(old)
            held = self.held.get(key)
            if held is not None:
                return held.reply
            name = f"{self.prefix}{next(self.counter)}"
            try:
                size, layouts = write_segment(self.folder / name, batches)
            except OSError as e:  # a container's /dev/shm is often 64 MiB
                raise PlaitError(
                    f"this node's data host cannot write step {key[1]} of DP rank {key[2]} into {self.folder}: "
                    f"{e.strerror or e}. Give the node more shared memory (docker --shm-size), point "
                    "PLAIT_SHM_DIR at a larger tmpfs, or read over Flight (PLAIT_NODE_TRANSPORT=flight)") from None
            reply = (name if size else None, size, layouts)
            if size:
                self.held[key] = Held(name, gen, reads, reply)
            return reply

    def mapped(self, conn_id: int, name: str) -> None:
        with self.lock:
            for key, held in list(self.held.items()):
                if held.name == name:
                    held.mapped_by.add(conn_id)
                    self._settle(key)

    def forget(self, conn_id: int) -> None:
        """A connection closed: it maps nothing more."""
        with self.lock:
            self.readers.pop(conn_id, None)
            for key in list(self.held):
                self._settle(key)

    def _settle(self, key: Key) -> None:
        held = self.held[key]
        waiting = {c for c, reads in self.readers.items() if reads == held.reads}
        if waiting <= held.mapped_by:
            self._drop(key)

    def _drop(self, key: Key) -> None:
        held = self.held.pop(key)
        (self.folder / held.name).unlink(missing_ok=True)

    def close(self) -> None:
        with self.lock:
            for key in list(self.held):
                self._drop(key)
        for path in self.folder.glob(self.prefix + "*"):  # one written while closing
            path.unlink(missing_ok=True)
        if self.host_lock is not None:
            release_host_lock(self.folder, self.prefix, self.host_lock)
            self.host_lock = None

    def __len__(self) -> int:
        return len(self.held)


class Waiters:
    """Daemon threads for the requests that may wait (a step beyond the window, a build not finished, an
    action): as many as wait at once, reused when idle. Never bounded: a full pool would queue the slowest
    rank's request behind the faster ranks' requests that wait for it. They only wait and answer; the
    connections' I/O and the segments' writes stay on the serving thread."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.idle = self.threads = 0

    def submit(self, work, deliver) -> None:
        """`deliver(work())` on a waiter thread."""
        with self.lock:
            if self.idle:
                self.idle -= 1
            else:
                self.threads += 1
                threading.Thread(target=self._run, name="plait-shm-wait", daemon=True).start()
        self.jobs.put((work, deliver))

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            work, deliver = job
            result = work()
            with self.lock:  # idle before the answer leaves: the request it lets a trainer send reuses this thread
                self.idle += 1
            deliver(result)

    def close(self) -> None:
        with self.lock:
            for _ in range(self.threads):
                self.jobs.put(None)


class NodeShmServer:
    """Serves `server` (a plait.runtime.serve_local.LocalJobServer: its JobService and its action table)
    to this machine's trainers through segments in `folder`. `address` (abstract socket name) and `token`
    go into the node's rendezvous file.

    Threads: one accepts, one serves every connection (`multiprocessing.connection.wait` over them all: it
    reads requests, writes segments and sends answers), and Waiters run what may wait. Not two threads per
    connection: each thread that mallocs large buffers gets a glibc arena of its own, and 16 such arenas
    kept the host's RSS 10-160 MiB above Flight's."""

    def __init__(self, server, folder: Path, job_tag: str):
        self.server, self.service = server, server.service
        self.token = server.token
        remove_leftovers(folder)  # of earlier hosts that were killed
        self.segments = Segments(folder, segment_prefix(os.getpid(), job_tag))
        self.address = f"\0plait-{os.getpid()}-{job_tag}-{secrets.token_hex(4)}"
        self.listener = Listener(self.address, family="AF_UNIX", authkey=self.token.encode())
        self.closed = threading.Event()
        self.conn_ids = itertools.count()
        self.conns: dict[Connection, int] = {}  # open connection -> its id (touched by the serving thread only)
        self.arrived: queue.SimpleQueue = queue.SimpleQueue()  # new connections, and finished answers
        self.wake_recv, self.wake_send = Pipe(duplex=False)  # tells the serving thread to look at `arrived`
        self.waiters = Waiters()
        self.serving = threading.Thread(target=self._serve, name="plait-shm-serve", daemon=True)
        self.serving.start()
        threading.Thread(target=self._accept, name="plait-shm-accept", daemon=True).start()

    def _post(self, item) -> None:
        self.arrived.put(item)
        try:
            self.wake_send.send_bytes(b"")
        except OSError:
            pass  # closed: the serving thread has stopped

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn = self.listener.accept()
            except (OSError, EOFError, AuthenticationError):  # a peer without the token, or one that left
                if self.closed.is_set():
                    return
                continue
            if self.closed.is_set():
                conn.close()
                return
            self._post(("open", conn, None))

    def _serve(self) -> None:
        try:
            while not self.closed.is_set():
                for ready in wait([self.wake_recv, *self.conns]):
                    if ready is self.wake_recv:
                        ready.recv_bytes()
                        self._take_arrived()
                    elif ready in self.conns:
                        self._receive(ready)
        finally:
            self._take_arrived()  # a connection accepted while closing is closed with the others
            for conn in list(self.conns):
                self._drop(conn)

    def _take_arrived(self) -> None:
        while not self.arrived.empty():
            kind, conn, value = self.arrived.get()
            if kind == "open":
                self.conns[conn] = next(self.conn_ids)
            elif conn in self.conns:  # an answer; a connection closed meanwhile gets none (and no segment)
                self._reply(conn, value)

    def _receive(self, conn: Connection) -> None:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):  # the trainer closed, or its process died
            self._drop(conn)
            return
        conn_id = self.conns[conn]
        if op == "mapped":  # no answer: the reader goes on at once
            self.segments.mapped(conn_id, args)
            return
        self.waiters.submit(lambda: self._answer(conn_id, op, args), lambda answer: self._post(("answer", conn, answer)))

    def _answer(self, conn_id: int, op: str, args) -> tuple:
        """("ok", value) or ("error", message); a get's value is (state, (conn id, key, batches)), its
        segment written by the serving thread."""
        try:
            if op == "get":  # the job service's, as Flight's do_get: the window, the build cache, the CP cut
                gen, step, dp_rank, limit, cp, with_state, client = args
                state, batches = self.service.get(gen, step, dp_rank, limit, tuple(cp), with_state, client)
                return "get", (state, (conn_id, (gen, step, dp_rank, *cp), batches))
            if op == "action":
                name, body = args
                return "ok", answer_action(self.server.answerers, name, body, "")
            if op == "flight":  # a rank of this machine reads over Flight (transport="flight"): start it now
                return "ok", self.server.start_flight()
            raise PlaitError(f"unknown request {op!r} to this node's data host")
        except PlaitError as e:
            return "error", str(e)
        except Exception as e:  # noqa: BLE001 - a bug here must reach the trainer, not kill the host
            log.exception("plait: the node's shared-memory server failed on %s", op)
            return "error", f"this node's data host failed: {type(e).__name__}: {e}"

    def _reply(self, conn: Connection, reply: tuple) -> None:
        kind, value = reply
        if kind == "get":
            state, (conn_id, key, batches) = value
            try:
                reply = ("ok", (state, self.segments.get(conn_id, key, batches)))
            except PlaitError as e:
                reply = ("error", str(e))
        try:
            conn.send(reply)
        except (EOFError, OSError):
            self._drop(conn)

    def _drop(self, conn: Connection) -> None:
        conn_id = self.conns.pop(conn, None)
        if conn_id is not None:
            self.segments.forget(conn_id)
        conn.close()

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        try:  # wake the accepting thread
            Client(self.address, family="AF_UNIX", authkey=self.token.encode()).close()
        except (OSError, EOFError, AuthenticationError):
            pass  # not listening any more
        self.listener.close()
        self.wake_send.send_bytes(b"")  # the serving thread sees `closed` and closes the connections
        self.serving.join(timeout=10)
        if not self.serving.is_alive():
            self.wake_recv.close()
            self.wake_send.close()
        self.waiters.close()
        self.segments.close()
