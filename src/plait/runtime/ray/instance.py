"""Joining a Ray cluster, or starting the local instance a trainer process uses, with one-sentence errors
when that fails (Ray's own output goes to a log file named in the error, not before it).

A local instance is started for a long job (plait.runtime.ray.common.long_run_settings) and shared by
every RayRuntime of the process (`LocalInstance`: the last one to close shuts it down).
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import sys
import tempfile

from plait.errors import PlaitError
from plait.runtime.ray import jobs
from plait.runtime.ray.common import NAMESPACE, long_run_settings, malloc_env, ray_module

def check_reachable(address: str | None, timeout: float = 3.0, told_by: str = "address") -> None:
    """Fail fast on an explicit cluster address nobody listens on (Ray itself retries for a long time).

    Only `host:port` and `ray://host:port` are checked (one TCP connect); `auto`, `local` and None are
    left to Ray. `told_by` says where the address came from (`address`, RAY_ADDRESS, `ray start`'s record):
    the advice differs.
    """
    if not address or address in ("auto", "local"):
        return
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.rstrip("/").rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise PlaitError(f"cannot reach the Ray cluster at {address!r} (from {told_by}): {e.strerror or e} "
                         f"(is `ray start --head` running there? {ADVICE.get(told_by, ADVICE['address'])})") from None


ADVICE = {  # how to start a local instance instead, by where the unreachable address came from
    "address": "leave --address unset to start a local instance",
    "RAY_ADDRESS": "unset RAY_ADDRESS to start a local instance",
    "ray start's record": "`ray stop` clears the record of a cluster that is gone",
}


def ray_user_temp_dir() -> str:
    """Where Ray keeps its per-user files, in Ray's own order: RAY_TMPDIR, else TMPDIR on Linux (as most
    HPC schedulers set it), else /tmp (macOS and Linux), else the platform's temp folder."""
    if os.environ.get("RAY_TMPDIR"):
        return os.environ["RAY_TMPDIR"]
    if sys.platform.startswith("linux") and os.environ.get("TMPDIR"):
        return os.environ["TMPDIR"]
    if sys.platform.startswith(("linux", "darwin")):
        return "/tmp"
    return tempfile.gettempdir()


def recorded_cluster() -> str | None:
    """The cluster `ray start --head` last recorded on this machine (`<Ray's temp dir>/ray/
    ray_current_cluster`, Ray's own record, cleared by `ray stop`), None when there is none."""
    record = os.path.join(ray_user_temp_dir(), "ray", "ray_current_cluster")
    try:
        with open(record) as f:
            return f.read().strip() or None
    except OSError:
        return None


def cluster_to_join(address: str | None) -> tuple[str | None, str]:
    """(the existing cluster `ray.init(address=address)` joins, where that address came from); None when
    it starts a local instance. Ray's own order: an explicit address, else RAY_ADDRESS (what `ray start`,
    `ray job submit` and most clusters set), else, for None and "auto", the cluster `ray start` recorded on
    this machine. Start-only options (`_system_config`, resources) must not reach a join."""
    if address == "local":
        return None, "address"
    if address not in (None, "auto"):
        return address, "address"
    env = os.environ.get("RAY_ADDRESS")
    if env:
        return (None if env == "local" else env), "RAY_ADDRESS"
    recorded = recorded_cluster()
    if recorded:
        return recorded, "ray start's record"
    return ("auto" if address == "auto" else None), "address"


class StderrCapture:
    """Collects what this process writes to file descriptor 2 (C++ logs included) while active. Afterwards
    it passes it on to the real stderr, or, when `failed()` was called, keeps it in a log file (`log_path`,
    named by `where_said()`): a user reads plait's one-sentence error first, not Ray's twenty lines of
    warnings before it. Nothing is hidden either way."""

    def __enter__(self) -> "StderrCapture":
        sys.stderr.flush()
        self.text = ""
        self.quiet = False
        self.log_path: str | None = None
        self._saved = os.dup(2)
        self._file = tempfile.TemporaryFile()
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc) -> None:
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        self.text = self._file.read().decode(errors="replace")
        self._file.close()
        if not self.quiet:
            sys.stderr.write(self.text)
        elif self.text.strip():
            fd, self.log_path = tempfile.mkstemp(prefix="plait-ray-", suffix=".log")
            with os.fdopen(fd, "w") as f:
                f.write(self.text)

    def failed(self) -> None:
        self.quiet = True

    def where_said(self) -> str:
        return f" (Ray's own output: {self.log_path})" if self.log_path else ""


def explain_join_failure(address: str | None, error: Exception, said: str) -> str:
    """One sentence naming why joining a Ray cluster failed, from Ray's exception and its logs."""
    text = f"{error}\n{said}"
    lowered = text.lower()
    if "invalidauthtoken" in lowered or "unauthenticated" in lowered:
        cause = ("authentication failed: the cluster uses Ray's token authentication and this process has no "
                 "token or another one (set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH as on "
                 "the head)")
    elif "version mismatch" in lowered or "mismatched version" in lowered:
        cause = (f"version mismatch: this process runs Ray {ray_module().__version__} on Python "
                 f"{platform.python_version()}; the cluster runs another (use the same versions)")
    else:
        cause = ("no Ray head answered there (is `ray start --head` running, and is the port right? leave "
                 "--address unset to start a local instance)")
    return f"cannot join the Ray cluster at {address!r}: {cause}. Ray said: {str(error).strip()[:300]}"


def ray_initialized() -> bool:
    """Whether this process is connected to Ray, without importing Ray (RAY_AUTH_MODE is read at import)."""
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


class LocalInstance:
    """The local Ray instance plait started in this process, shared by every RayRuntime that uses it:
    the last one to close shuts it down (an earlier close must not pull Ray from under the others)."""

    users = 0

    @classmethod
    def attach(cls) -> None:
        cls.users += 1

    @classmethod
    def detach(cls) -> bool:
        """True when the caller was the last user (and should shut the instance down)."""
        cls.users = max(0, cls.users - 1)
        return cls.users == 0


class RayUse:
    """One runtime's use of Ray in this process: it joins the running instance, or the local one the job's
    creator on this machine published (`attach` without an address), or starts one (published under the
    job's name for the trainers that attach); `release` leaves it, shutting down a local instance when its
    last user leaves."""

    def __init__(self, address: str | None, attach: bool, job: str | None, init_options: dict | None = None,
                 dashboard: bool = False):
        self.job = job
        self.uses_local = self.published = False
        if address is None and attach and cluster_to_join(None)[0] is None and not ray_initialized():
            # The job's creator on this machine started Ray: its address, and its authentication mode set
            # before this process imports Ray (Ray reads RAY_AUTH_MODE once, at import).
            address = jobs.local_instance_address(job)
        ray = ray_module()
        if not ray.is_initialized():
            self.uses_local = start_ray(address, init_options, dashboard)
            self.published = self.uses_local and job is not None
            if self.published:
                jobs.publish_local_instance(job)
        elif LocalInstance.users > 0:  # the instance another plait runtime of this process started
            self.uses_local = True
        if self.uses_local:
            LocalInstance.attach()

    def release(self) -> None:
        ray = ray_module()
        if not ray.is_initialized():  # Ray is gone already: a call now would start a new instance
            if self.uses_local:
                LocalInstance.detach()
            return
        if self.published:
            jobs.unpublish_local_instance(self.job)
        if self.uses_local and LocalInstance.detach():
            ray.shutdown()


def start_ray(address: str | None, init_options: dict | None = None, dashboard: bool = False) -> bool:
    """Join the cluster at `address` (or the one Ray finds without it: cluster_to_join), or start a local
    Ray instance; True when one was started.

    A local instance is set up for a long job (long_run_settings: no dashboard unless `dashboard`, bounded
    task events and logs; its processes start with malloc_env(), daemon_env); `init_options` (ray.init's keyword arguments) override those settings. Ray
    (2.59+) protects its servers with token authentication by default. Ray's own gRPC servers still listen
    on every interface (README, Ray)."""
    ray = ray_module()
    joining, told_by = cluster_to_join(address)
    check_reachable(joining, told_by=told_by)
    kwargs = {"log_to_driver": False}
    started = joining is None
    if started:
        settings, env = long_run_settings(dashboard)
        for name, value in env.items():  # read by Ray's processes as they start; the user's own values win
            os.environ.setdefault(name, value)
        user = dict(init_options or {})
        settings["_system_config"].update(user.pop("_system_config", None) or {})
        kwargs.update(settings)
        kwargs.update(user)
    else:
        kwargs.update(init_options or {})
    with StderrCapture() as said, daemon_env(malloc_env() if started else {}):
        try:  # Ray's core logs the real cause of a failed join to stderr only
            # a start says "local": Ray then looks for no cluster of its own, so the start-only options
            # above can never reach a join that Ray found where plait did not
            ray.init(address="local" if started else joining, namespace=NAMESPACE, **kwargs)
        except (ConnectionError, RuntimeError, ValueError) as e:
            error = e
            said.failed()
        else:
            error = None
    if error is not None and started:
        raise PlaitError(f"cannot start a local Ray instance: {' '.join(str(error).split())[:400]} (is another "
                         f"Ray instance using its ports? `ray stop` ends local ones){said.where_said()}") from None
    if error is not None:
        raise PlaitError(explain_join_failure(joining, error, said.text) + said.where_said()) from None
    serialization_without_arrow()
    return started


@contextlib.contextmanager
def daemon_env(variables: dict):
    """`variables` in os.environ while Ray starts its processes (gcs_server, raylet, and the workers the
    raylet starts inherit them), then as they were: the trainer's process and what it starts later keep
    their own environment. A variable already set is left as the user set it."""
    added = {k: v for k, v in variables.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def serialization_without_arrow() -> None:
    """Create this process's Ray serialization context without importing pyarrow, if nothing has yet.

    Ray imports pyarrow (about 25-40 MiB resident, mostly libarrow) when it creates a process's
    serialization context, only to register reducers for Arrow tables and JSON options. A trainer
    process that Ray was started in by plait exchanges numpy arrays and plain objects with plait's
    actors, never Arrow data, so the context is created (by a first `ray.put`) while pyarrow reads as
    absent (Ray then skips those reducers; Arrow objects still serialize, by pickle). Where pyarrow is
    already imported, or PLAIT_RAY_ARROW=1, nothing changes.
    """
    if "pyarrow" in sys.modules or os.environ.get("PLAIT_RAY_ARROW") == "1":
        return
    sys.modules["pyarrow"] = None  # `import pyarrow` raises ModuleNotFoundError meanwhile
    try:
        ray_module().put(None)
    except Exception:  # noqa: BLE001 - created normally on first use instead
        pass
    finally:
        if "pyarrow" in sys.modules and sys.modules["pyarrow"] is None:
            del sys.modules["pyarrow"]

