"""The local runtime on a node with several trainer processes: one data plane per node, not per process.

Run alone, the local runtime makes every trainer process plan the step, read every source and hold
every source's reader and buffer: under torchrun with 8 processes a node holds 8 copies of everything,
and memory grows as sources x ranks. Here the node's first process (LOCAL_RANK 0) hosts the job's roles
(plait.runtime.serve_local.LocalJobServer: one Planner, one SourceLoader over every source, the
Constructor) in background threads, with a fresh per-job token; every local rank, the host's own too,
reads its micro-batches as a thin client. By default from shared memory (plait.runtime.node_shm_host
writes each rank's step once into a segment, plait.runtime.node_shm_client maps it as numpy views; a
thin rank imports neither pyarrow nor the sources); with transport="flight" (or PLAIT_NODE_TRANSPORT)
over Arrow Flight on loopback (plait.runtime.flight), as clients on other machines read. The host starts
its Flight server only when such a rank first asks for it (or at once where there is no shared memory):
a node whose ranks all read shared memory opens no port. Memory on a node
then grows as sources + ranks.

Every node plans the whole step itself from the same spec, seed and data, exactly as every process did
before: nodes agree without talking, and the stream is the local runtime's bit for bit (same digest).

Which launches share (`share=` of plait.Loader with runtime="local", or PLAIT_LOCAL_SHARE):
  auto     (default) share when torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE say there are 2+ processes here
  node     share (an error outside torchrun's environment)
  process  every process is its own loader (the local runtime alone)

Rendezvous: the host writes {address, token, pid} to a file named by a hash of the launch (torchrun's run
id, master address and port, node rank and restart count), the job name and the spec's data fingerprint,
in a folder only this user can read (PLAIT_NODE_DIR, default <tmp>/plait-<uid>, mode 0700). The other
processes wait for it (`join_timeout`, default 300 s), check the served job's spec, and join. The host keeps
serving after its own Loader closes (or its script ends with the Loader open) until every process of the
node that joined has left (or died), or until all LOCAL_WORLD_SIZE processes have had `DRAIN_GRACE`
seconds to join: its process waits for that at exit, so a rank that finishes first does not cut the
others off.

A host whose own trainer dies of an uncaught exception (sys.excepthook) does not serve on: it stops at
once, tells the node's other processes why (the rendezvous file says so; each logs a warning naming the
host and its next batch raises a PlaitError saying it), waits a few seconds for them to hear it, and exits,
so that torchrun sees a failed worker and ends the job instead of the other ranks waiting in their
collectives for gloo's or NCCL's timeout. (A trainer that ends with sys.exit(1) is not seen: it exits as
a finished one.) A process that sees its host die, or stop, logs it the same way.

Ranks may read at different speeds: the host's plan window (plait.job.window) makes a rank that runs
more than the window ahead of the slowest live one wait, and logs whom it waits for; a rank whose process
died or that left stops holding it (docs/serving.md).

The trade-off: one process builds the node's batches (a few build threads, as `plait serve --runtime
local`), where each process built its own before. For sources whose preprocessing is heavy (many images),
use the ray runtime (loaders scaled per source) or share="process".
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from plait.batch import MicroBatch
from plait.errors import PlaitError
from plait.runtime.node_shm import shm_dir
from plait.runtime.options import renamed
from plait.spec import Spec

SHARES = ("auto", "node", "process")
SHARE_ENV = "PLAIT_LOCAL_SHARE"
TRANSPORTS = ("shm", "flight")
TRANSPORT_ENV = "PLAIT_NODE_TRANSPORT"
DIR_ENV = "PLAIT_NODE_DIR"
JOIN_TIMEOUT = 300.0  # seconds a process waits for its node's host (the host's first plan reads every source)
DRAIN_GRACE = 60.0  # seconds the host waits, at most, for node processes that never joined
DRAIN_TIMEOUT = 3600.0  # seconds the host waits, at most, for joined processes to leave
FAILED_GRACE = 10.0  # seconds a host whose trainer raised waits, at most, for the node's processes to hear it
WATCH_S = 0.25  # how often a process looks whether its node's host stopped or died

log = logging.getLogger("plait.node")


@dataclass(frozen=True)
class NodeLaunch:
    """Where this process sits in its launch: its rank on the node, how many processes the node has, and
    what names the launch (torchrun's environment)."""

    local_rank: int
    local_world_size: int
    launch: str

    @classmethod
    def from_env(cls, env: dict | None = None) -> "NodeLaunch | None":
        env = os.environ if env is None else env
        if "LOCAL_RANK" not in env or "LOCAL_WORLD_SIZE" not in env:
            return None
        try:
            local_rank, size = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
        except ValueError:
            raise PlaitError(f"LOCAL_RANK={env['LOCAL_RANK']!r} / LOCAL_WORLD_SIZE={env['LOCAL_WORLD_SIZE']!r} "
                             "are not integers") from None
        if not 0 <= local_rank < size:
            raise PlaitError(f"LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE={size}")
        parts = [env.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                                           "TORCHELASTIC_RESTART_COUNT")]
        return cls(local_rank, size, "|".join(parts))


def node_launch(share: str) -> NodeLaunch | None:
    """The launch to share a data plane in, or None: this process loads alone (see the module's doc)."""
    if share == "auto":
        share = os.environ.get(SHARE_ENV) or "auto"
    if share not in SHARES:
        raise PlaitError(f"share={share!r} is not one of {', '.join(SHARES)} (also from {SHARE_ENV})")
    if share == "process":
        return None
    launch = NodeLaunch.from_env()
    if launch is None:
        if share == "node":
            raise PlaitError("share='node' needs torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE in the environment "
                             "(use share='process' outside torchrun)")
        return None
    if share == "auto" and launch.local_world_size < 2:
        return None
    return launch


def rendezvous_dir() -> Path:
    """A folder only this user can enter (the rendezvous file holds the job's token)."""
    path = Path(os.environ.get(DIR_ENV) or Path(tempfile.gettempdir()) / f"plait-{os.getuid()}")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PlaitError(f"{path} (the node rendezvous folder) must belong to this user with mode 0700; set "
                         f"{DIR_ENV} to a private folder")
    return path


def rendezvous_path(launch: NodeLaunch, job: str, spec: Spec) -> Path:
    key = "|".join([launch.launch, job, spec.data_fingerprint(), str(spec.topology.dp)])
    return rendezvous_dir() / f"node-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


# ----- the host (LOCAL_RANK 0): one LocalJobServer per rendezvous, shared by the process's Loaders ---------
class _Host:
    def __init__(self, spec: Spec, job: str, path: Path, serving: dict):
        """`serving`: LocalJobServer's options (expected, metrics_port, build_ahead)."""
        from plait.runtime.serve_local import LocalJobServer  # pyarrow.flight: loaded only where it serves

        folder = shm_dir()
        shm_here = folder is not None and sys.platform.startswith("linux")  # abstract unix sockets: Linux only
        # Flight starts when a rank first asks for it (transport="flight"), or at once where there is no shm
        self.server = LocalJobServer(spec, job, "127.0.0.1:0", flight=not shm_here, **serving)
        self.path, self.expected, self.users = path, serving["expected"], 0
        self.shm = None  # the shared-memory server for this machine's ranks, where the platform has one
        if shm_here:
            from plait.runtime.node_shm_host import NodeShmServer

            try:
                self.shm = NodeShmServer(self.server, folder, path.stem.removeprefix("node-")[:10])
            except BaseException:
                self.server.close()
                raise
        remove_stale_rendezvous(path.parent)
        self.write()

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
        self.server.close()

    def drain(self) -> None:
        """Serve until the node's processes have left, then close (unless a new Loader took the host); stop
        at once when this process's trainer raised."""
        start = time.monotonic()
        while time.monotonic() - start < DRAIN_TIMEOUT:
            if TRAINER_FAILURE:
                self.stop_failed(TRAINER_FAILURE[0])
                return
            with _HOSTS_LOCK:
                if self.users > 0:
                    return
            clients = self.server.clients
            waiting = clients.live(exclude_pid=os.getpid()) > 0 or (clients.joined_processes() < self.expected
                                             and time.monotonic() - start < DRAIN_GRACE)
            if not waiting:
                break
            time.sleep(0.1)
        with _HOSTS_LOCK:
            if self.users > 0:
                return
            _HOSTS.pop(self.path, None)
        self.remove_file()
        self.close()

    def stop_failed(self, failure: str) -> None:
        """This process's trainer raised: refuse every request with why, say it in the rendezvous file (the
        node's processes watch it), give them FAILED_GRACE seconds to hear it and leave, then close."""
        with _HOSTS_LOCK:
            _HOSTS.pop(self.path, None)
        reason = (f"this node's data host, the trainer process with LOCAL_RANK 0 (pid {os.getpid()}), stopped "
                  f"because its trainer raised {failure}; the job cannot go on without it (torchrun ends it: "
                  "resume from the last checkpoint)")
        self.server.service.stop(reason)
        self.write({"stopped": reason})
        deadline = time.monotonic() + FAILED_GRACE
        while self.server.clients.live(exclude_pid=os.getpid()) > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.remove_file()
        self.close()

    def write(self, extra: dict | None = None) -> None:
        """The rendezvous file: where the host listens, its token and process (and `extra`)."""
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            shm = None if self.shm is None else {"address": self.shm.address, "dir": str(self.shm.segments.folder),
                                                 "pid": os.getpid()}
            json.dump({"address": self.server.address, "token": self.server.token, "pid": os.getpid(),
                       "job": self.server.job, "shm": shm, **(extra or {})}, f)
        os.replace(tmp, self.path)

    def remove_file(self) -> None:
        """Remove the rendezvous file when it is still this process's (a later host may have replaced it)."""
        try:
            if json.loads(self.path.read_text()).get("pid") == os.getpid():
                self.path.unlink()
        except (OSError, ValueError):
            pass


def remove_stale_rendezvous(folder: Path) -> None:
    """Remove the rendezvous files (and half-written ones) of hosts that died without removing theirs
    (SIGKILL, a crash): a process that waits for its node's host must never find a dead one's address."""
    from plait.job.consumers import process_alive

    for path in folder.glob("node-*"):
        try:
            if path.suffix == ".tmp":
                pid = int(path.suffixes[-2].lstrip("."))
            else:
                pid = int(json.loads(path.read_text())["pid"])
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            continue  # being written, or not ours: leave it
        if not process_alive(pid):
            path.unlink(missing_ok=True)


def _remove_files_on_sigterm() -> None:
    """torchrun ends its workers with SIGTERM: remove this process's rendezvous files first, then die of
    the signal as before. Only where SIGTERM still has its default action (a trainer's own handler wins)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum, frame):
        for host in list(_HOSTS.values()):
            host.remove_file()
            if host.shm is not None:
                host.shm.segments.close()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_sigterm)


_HOSTS: dict[Path, _Host] = {}
_HOSTS_LOCK = threading.Lock()
TRAINER_FAILURE: list[str] = []  # the uncaught exception that ended this process's trainer, once it has


def _watch_own_trainer() -> None:
    """Chain sys.excepthook (once): an uncaught exception ends this process's trainer, and a host then
    stops instead of serving on (drain sees TRAINER_FAILURE). Its traceback is printed first, as before."""
    previous = sys.excepthook
    if getattr(previous, "plait_node_host", False):
        return

    def on_uncaught(exc_type, exc, tb):
        try:
            previous(exc_type, exc, tb)
        finally:
            TRAINER_FAILURE.append(f"{exc_type.__name__}: {exc}"[:500])

    on_uncaught.plait_node_host = True  # type: ignore[attr-defined]
    sys.excepthook = on_uncaught


def _acquire_host(spec: Spec, job: str, path: Path, serving: dict) -> _Host:
    with _HOSTS_LOCK:
        host = _HOSTS.get(path)
        if host is None:
            host = _HOSTS[path] = _Host(spec, job, path, serving)
            # weakref.finalize registers its exit hook at the first finalizer a process makes; pyarrow's
            # Flight server makes one when it starts, which may come later (when a rank asks for Flight):
            # that hook would then run before this one and stop the server while this one still serves.
            # A finalizer made first registers it first (numba's import used to do it by chance).
            weakref.finalize(_serve_on_at_exit, _nothing)
            atexit.unregister(_serve_on_at_exit)
            atexit.register(_serve_on_at_exit)
            _remove_files_on_sigterm()
            _watch_own_trainer()
        host.users += 1
        return host


def _nothing() -> None:
    pass


def _serve_on_at_exit() -> None:
    """A host process that exits with its Loader still open serves the node's other processes first.
    Registered when the first host starts, after pyarrow.flight's own exit hooks: atexit runs the last
    registered first, so this runs while the Flight server still serves."""
    with _HOSTS_LOCK:
        held = [h for h in _HOSTS.values() if h.users > 0]
        for host in held:
            host.users = 0
    for host in held:
        host.drain()


def _release_host(host: _Host) -> None:
    with _HOSTS_LOCK:
        host.users -= 1
        if host.users > 0:
            return
    # Not a daemon: when the host's script ends first, its process serves on until the node is done with it.
    threading.Thread(target=host.drain, name="plait-node-drain", daemon=False).start()


# ----- every local rank: a thin client of its node's host -----------------------------------------------
def node_client_class():
    """The thin client of this node's data host, whose failures are said in torchrun's terms (the user
    ran a trainer, not `plait serve`)."""
    from plait.runtime.flight import FlightRuntime, ServerHints

    class NodeHostClient(FlightRuntime):
        hints = ServerHints(
            token="the token in this node's rendezvous file is not the running host's: a stale file of an "
                  "earlier launch, or two launches sharing PLAIT_NODE_DIR and run id",
            down="this node's data host, the trainer process with LOCAL_RANK 0, has ended or died: every "
                 "process of the node reads its batches from it, so restart the launch (share='process' "
                 "makes each process load alone)",
        )

    return NodeHostClient


class HostWatch:
    """In a process its node's host serves (not the host's own): looks every WATCH_S seconds whether the
    host stopped (its trainer raised: the rendezvous file says why) or its process is gone. Then it logs a
    warning naming the host, once (a rank waiting in a collective would otherwise say nothing), keeps the
    reason (`stopped`: the error this process's next batch raises) and calls `on_stop` (to leave, so the
    host need not wait for it)."""

    def __init__(self, path: Path, pid: int, on_stop):
        self.path, self.pid, self.on_stop = path, pid, on_stop
        self.stopped: str | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="plait-host-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(WATCH_S):
            reason = self._look()
            if reason is not None:
                self.stopped = reason
                log.warning("plait: %s", reason)
                self.on_stop()
                return

    def _look(self) -> str | None:
        from plait.job.consumers import process_alive

        try:
            info = json.loads(self.path.read_text())
            if isinstance(info, dict) and info.get("pid") == self.pid and info.get("stopped"):
                return str(info["stopped"])
        except (OSError, ValueError):
            pass  # removed (the host closed) or being replaced: its process says more
        if not process_alive(self.pid):
            return (f"this node's data host, the trainer process with LOCAL_RANK 0 (pid {self.pid}), has ended or "
                    "died while this process still reads from it: its batches stop here (torchrun ends the job; "
                    "resume from the last checkpoint)")
        return None

    def close(self) -> None:
        self.done.set()


def node_transport(transport: str | None) -> str:
    """How this process reads from its node's host: `shm` (default; Flight where the host offers no shared
    memory) or `flight` (to compare), from the option or PLAIT_NODE_TRANSPORT."""
    transport = transport or os.environ.get(TRANSPORT_ENV) or "shm"
    if transport not in TRANSPORTS:
        raise PlaitError(f"transport={transport!r} is not one of {', '.join(TRANSPORTS)} (also from {TRANSPORT_ENV})")
    return transport


def _client_of(spec: Spec, job: str, info: dict, transport: str):
    if transport == "shm" and info.get("shm"):
        from plait.runtime.node_shm_client import ShmNodeClient

        return ShmNodeClient(spec, info["shm"], info["token"], job=job)
    address = info.get("address")
    if address is None:  # the host serves shared memory only until a rank asks it to start Flight
        from plait.runtime.node_shm_client import ShmChannel

        channel = ShmChannel(info["shm"]["address"], info["token"])
        try:
            address = channel.call("flight", None)
        finally:
            channel.close()
    return node_client_class()(spec, job_address=address, token=info["token"], job=job)


def join_host(spec: Spec, job: str, path: Path, timeout: float, transport: str = "shm"):
    """(a thin client of the node's host, the host's process id)."""
    from plait.job.consumers import process_alive


    deadline = time.monotonic() + timeout
    last = "its rendezvous file did not appear"
    while True:
        stopped = None
        try:
            info = json.loads(path.read_text())
            alive = process_alive(int(info["pid"]))
            # its host's trainer raised: that launch is over -- while the host lives; a file its dead host left
            # behind (a kill in its grace period) is stale, and a relaunch waits for its new host
            stopped = info.get("stopped") if alive else None
            if not alive:
                last = f"the host process {info['pid']} that wrote it is gone"
            elif not stopped:
                return _client_of(spec, job, info, transport), int(info["pid"])
        except (OSError, ValueError, KeyError, AttributeError):
            pass
        except PlaitError as e:  # a stale file, or a host still starting or already closing
            last = str(e)
        if stopped:
            raise PlaitError(str(stopped))
        if time.monotonic() > deadline:
            raise PlaitError(
                f"this node's data plane for job {job!r} did not answer within {timeout:.0f} s ({path}: {last}). "
                "LOCAL_RANK 0 hosts it: every process of the node must create the same Loader (same spec, job "
                "and topology); share='process' makes each process load alone"
            )
        time.sleep(0.05)


class NodeRuntime:
    """The runtime interface (plait.runtime) for one process of a node whose LOCAL_RANK 0 hosts the data
    plane (see the module's doc). Options: `job` (names the node's job; default from the launch),
    `metrics_port` (the host's Prometheus endpoint), `join_timeout` (seconds to wait for the host;
    `timeout` is its deprecated name), `share` (as plait.Loader's), `transport` (`shm`, the default: read
    micro-batches from shared memory; `flight`: over Arrow Flight on loopback, as before; node_transport), `build_ahead` (steps the host builds
    ahead for each rank, default 2; only LOCAL_RANK 0's value counts: it hosts the job)."""

    @staticmethod
    def option_names() -> list[str]:
        return ["job", "metrics_port", "join_timeout", "share", "timeout", "transport", "build_ahead"]

    def __init__(self, spec: Spec, *, job: str | None = None, metrics_port: int | None = None,
                 join_timeout: float | None = None, share: str = "node", timeout: float | None = None,
                 transport: str | None = None, build_ahead: int | None = None):
        transport = node_transport(transport)
        timeout = renamed("timeout", timeout, "join_timeout", join_timeout)
        timeout = JOIN_TIMEOUT if timeout is None else timeout
        launch = node_launch(share)
        if launch is None:
            raise PlaitError("the node runtime needs torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE (share='process' "
                             "or runtime='local' outside torchrun)")
        job = job or "plait-node-" + hashlib.sha256(launch.launch.encode()).hexdigest()[:12]
        path = rendezvous_path(launch, job, spec)
        serving = {"expected": launch.local_world_size, "metrics_port": metrics_port, "build_ahead": build_ahead}
        self._host = _acquire_host(spec, job, path, serving) if launch.local_rank == 0 else None
        try:
            self.client, host_pid = join_host(spec, job, path, timeout, transport)
            self.client.control.action("join", {"id": self.client.client_id, "pid": os.getpid()})
        except BaseException:
            if self._host is not None:
                _release_host(self._host)
            raise
        self.job, self._closed = job, False
        self.watch = None if self._host is not None else HostWatch(path, host_pid, self._leave)

    @property
    def loader(self):
        """The node's SourceLoader where this process hosts it (LOCAL_RANK 0), else None."""
        return None if self._host is None else self._host.server.service.roles.loader

    def serving_stats(self) -> dict | None:
        """The node's plan window and builds (plait.job.service.JobService.stats) where this process hosts
        them, else None."""
        return None if self._host is None else self._host.server.service.stats()

    # ----- the runtime interface: the thin client's -------------------------------------------------------
    def iter_rank(self, dp_rank: int, start_state: dict, start_micro: int, max_steps: int | None,
                  cp_rank: int = 0) -> Iterator[tuple[dict, MicroBatch]]:
        with self._said():
            stream = self.client.iter_rank(dp_rank, start_state, start_micro, max_steps, cp_rank=cp_rank)
        return self._said_stream(stream)

    def _said_stream(self, stream: Iterator) -> Iterator:
        with self._said():
            yield from stream

    @contextlib.contextmanager
    def _said(self):
        """A failure once the host stopped or died says why (the watch's reason), not how the call failed."""
        try:
            yield
        except PlaitError:
            stopped = self.watch.stopped if self.watch is not None else None
            if stopped is None:
                raise
            raise PlaitError(stopped) from None

    def state_dict(self) -> dict:
        return self.client.state_dict()

    def state_after(self, step: int) -> dict | None:
        return self.client.state_after(step)

    def load_state_dict(self, state: dict, *, allow_spec_change: bool = False) -> list[str]:
        return self.client.load_state_dict(state, allow_spec_change=allow_spec_change)

    def replan_after(self, state: dict, layout: dict) -> dict:
        return self.client.replan_after(state, layout)

    def set_weights(self, weights: dict[str, float], at_step: int) -> None:
        """As the local runtime's: call it identically on every rank (the node's Planner records it once)."""
        self.client.set_weights(weights, at_step)

    def report(self, step: int, losses: dict[str, float]) -> None:
        """As the local runtime's: every rank reports the same losses (recorded once per step and source)."""
        self.client.report(step, losses)

    def error_report(self) -> dict:
        return self.client.error_report()

    def scaling_report(self) -> dict:
        return self.client.scaling_report()

    def _leave(self) -> None:
        try:
            self.client.control.action("leave", {"id": self.client.client_id})
        except PlaitError:
            pass  # the host is gone already
        if hasattr(self.client, "remove_host_leftovers"):  # a dead host's unmapped segments go with it
            self.client.remove_host_leftovers()

    def close(self) -> None:
        """Leave the node's job; the host's process serves on until the node's other processes are done."""
        if self._closed:
            return
        self._closed = True
        if self.watch is not None:
            self.watch.close()
        self._leave()
        self.client.close()
        if self._host is not None:
            _release_host(self._host)
