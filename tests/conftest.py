"""Shared test setup: hypothesis settings sized for a small CI machine, `tests/` on sys.path so that test
modules can `from helpers import ...` / `from fixtures import ...`, the repository root on it so that the
tests of the measurement suite can import `benchmarks`, and the session's one Ray instance."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

settings.register_profile(
    "plait", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "plait"))

# Ray's token authentication on, as users run it (Ray 2.59+ turns it on for a local instance by default).
# Ray reads its authentication mode once per process, so one mode for the whole session keeps the Ray modules
# independent of their order (a process that joined a head without token auth could not authenticate to a
# local instance started later). One token for the session, inherited by every process the tests start (Ray
# heads, trainers): no ~/.ray/auth_token is read or written. A module that tests another token sets its own.
os.environ["RAY_AUTH_MODE"] = "token"
if not os.environ.get("RAY_AUTH_TOKEN"):
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(16)
os.environ.pop("RAY_AUTH_TOKEN_PATH", None)  # the token from one source (as Ray's own test utilities set it)


# One local Ray instance for the whole test session. Modules that run on it take the `ray_session` fixture
# (its GCS address), never ray.init/shutdown of their own. Their modules run last (see the hook below), so
# the tests that need no Ray in this process (plait starting and releasing its own instance, a `ray start
# --head` cluster joined by address, a bad address failing fast) run before it starts.
RAY_OPTIONS = {"num_cpus": 2, "include_dashboard": False, "namespace": "plait", "log_to_driver": False,
               "configure_logging": False}

# Under xdist each worker runs one Ray group first (the hook below), then tests that need no Ray: the instances
# of that group (ray_session, ray_head) are released when the worker leaves it, not at the session's end
# (an idle instance costs ~0.03-0.05 CPU-s a second; ~150-190 s of a run's end). A test that needs one after
# its release fails saying so.
RELEASE_WITH_GROUP: dict = {}  # fixture name -> how to release what it started
RELEASED: set[str] = set()
RAY_GROUP_OF = pytest.StashKey[dict]()  # module path -> its Ray group, where one Ray group of each kind runs


# numba's kernels compiled into its on-disk cache once per test session, so that no test process compiles them
# itself (~40 s of CPU each on a fresh clone). Where the install's compile still runs (.ci/warm_kernels.py:
# `make` starts it and does not wait), the session uses that one; otherwise it compiles them in a process of
# its own (the same script). Its test processes run uncompiled (plait.jit's tiers) except a few:
# a worker whose kernels pass plait.jit's budget, and the subprocesses of tests/balance/test_jit_tiers.py
# (a census of a whole run: those, nothing else). So the tests start at once, beside the compile, and wait
# for it only where they would compile (compile_after_the_sessions, numba_compiled), with xdist or without.
DEMO_DIR = "PLAIT_TEST_DEMO_DIR"  # under xdist: the session's demo corpus folder, shared by the workers
NUMBA_READY = "PLAIT_TEST_NUMBA_READY"  # the file written when the compile is done ("ok" or why not)
NUMBA_PID = "PLAIT_TEST_NUMBA_PID"  # the process that writes it
COMPILING: list[tuple[subprocess.Popen, str]] = []  # the session's own compile and its folder, until the end
WARM_KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".ci", "warm_kernels.py")
PID_FILE, DONE_FILE = "numba-warmup.pid", "numba-warmup.done"  # what WARM_KERNELS writes in its folder


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended and not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def install_compile() -> tuple[str, int] | None:
    """(the file it will write, its pid) of the install's compile where it still runs (.ci/warm_kernels.py)."""
    pid_file, done = os.path.join(sys.prefix, PID_FILE), os.path.join(sys.prefix, DONE_FILE)
    try:
        pid = int(open(pid_file).read())
    except (OSError, ValueError):
        return None
    return (done, pid) if alive(pid) and not os.path.exists(done) else None


def wait_for_compile(ready: str, pid: int, timeout: float = 600) -> str:
    """What the compile wrote, once it has (or why it wrote nothing)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(ready) and alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if os.path.exists(ready):
        return open(ready).read()
    return "ended without a result" if not alive(pid) else "still running after 10 minutes"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist starts its workers (they inherit the environment)
def pytest_sessionstart(session):
    if hasattr(session.config, "workerinput"):
        return
    if getattr(session.config.option, "numprocesses", None):
        os.environ[DEMO_DIR] = tempfile.mkdtemp(prefix="plait-demo-")
        if bytecode_cold() and not sys.dont_write_bytecode:  # (where none is written, none is read either)
            os.environ[COLLECTED] = os.path.join(os.environ[DEMO_DIR], "collected")
    running = install_compile()
    if running is None:  # the install's compile, in a folder of the session's
        folder = tempfile.mkdtemp(prefix="plait-numba-")
        COMPILING.append((subprocess.Popen([sys.executable, WARM_KERNELS, folder], stdout=subprocess.DEVNULL), folder))
        running = (os.path.join(folder, DONE_FILE), COMPILING[-1][0].pid)
    os.environ[NUMBA_READY], os.environ[NUMBA_PID] = running[0], str(running[1])


# In a fresh clone or venv no module has its bytecode yet: collecting the suite then took ~32 CPU-s instead
# of ~10 (pytest rewrites every test module's asserts; torch, sympy, transformers, Ray compile as they are
# first imported), and xdist's workers, collecting at once, each did all of it. So there the other workers
# collect once the first has (they read the bytecode it wrote), while numba's compile runs beside it.
COLLECTED = "PLAIT_TEST_COLLECTED"  # the file the first worker writes once it has collected, where it waits
TESTS = os.path.dirname(os.path.abspath(__file__))


def bytecode_cold() -> bool:
    """No test module has pytest's rewritten bytecode yet (the first collection of this checkout)."""
    cache = os.path.join(TESTS, "core", "__pycache__")
    return not (os.path.isdir(cache) and any("-pytest-" in name for name in os.listdir(cache)))


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    marker = os.environ.get(COLLECTED)
    worker = getattr(session.config, "workerinput", {}).get("workerid")
    if not marker or worker is None:
        return (yield)
    if worker != "gw0":
        deadline = time.monotonic() + 300  # the first worker's collection failed or hung: collect anyway
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        return (yield)
    try:
        items = yield
    finally:
        open(marker, "w").close()
    # No test starts before every worker has collected: the first writes the demo corpus meanwhile (its folder
    # DEMO_DIR is set wherever COLLECTED is).
    if any("demo_spec_path" in getattr(i, "fixturenames", ()) for i in session.items):
        shared_demo_corpus()
    return items


def pytest_sessionfinish(session):
    """The controller removes the workers' shared demo corpus (a few MiB under /tmp) once they are done,
    and the folder of its own compile."""
    if hasattr(session.config, "workerinput"):
        return
    import shutil

    if os.environ.get(DEMO_DIR):
        shutil.rmtree(os.environ.pop(DEMO_DIR), ignore_errors=True)
    for proc, folder in COMPILING:
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def compile_after_the_sessions():
    """This test process (an xdist worker or the session) switching its kernels to compiled (plait.jit.compile_now, on its budget or a
    large call) first waits for the session's compile (pytest_sessionstart), then loads its cache."""
    ready = os.environ.get(NUMBA_READY)
    if not ready:
        yield
        return
    from plait import jit

    compile_now = jit.compile_now

    def after_the_sessions() -> bool:
        if not jit.TIER.compiled:
            wait_for_session_compile()
        return compile_now()

    jit.compile_now = after_the_sessions  # compiled() and hint() call it by its module name
    yield
    jit.compile_now = compile_now


def wait_for_session_compile() -> None:
    ready = os.environ.get(NUMBA_READY)
    outcome = wait_for_compile(ready, int(os.environ[NUMBA_PID])) if ready else "ok"
    if outcome != "ok":
        warnings.warn(f"numba's compile before the tests {outcome}: each process compiles its own")


@pytest.fixture(scope="session")
def numba_compiled():
    """The session's numba compile is done (pytest_sessionstart): for tests whose processes compile."""
    wait_for_session_compile()


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        from plait.runtime.ray.common import LOG_MONITOR_ENV
        from plait.runtime.ray.instance import daemon_env

        with daemon_env(LOG_MONITOR_ENV):  # as in the instance plait starts: its log monitor rescans less
            ray.init(**RAY_OPTIONS)
        RELEASE_WITH_GROUP["ray_session"] = ray.shutdown
    yield ray.get_runtime_context().gcs_address
    RELEASE_WITH_GROUP.pop("ray_session", None)
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_head():
    """One `ray start --head` cluster for the modules that join a cluster by its address (test_ray_jobs,
    test_flight; one xdist group, so one head for both instead of one each: ~15 s of a worker's wall):
    the session's token auth, 2 CPUs, no dashboard and no log monitor (docs/ray-long-runs.md), a free
    port, its own temp dir and session; stopped at the session's end (SIGINT: `--block` then ends what it
    started). Yields {address, env, pid}: `env` is the environment of the head, for the processes a test
    starts beside it."""
    import shutil
    import socket
    import subprocess

    from helpers import free_port, stop_ray_head

    port = free_port()
    temp = tempfile.mkdtemp(prefix="plait-ray-", dir="/tmp")  # short: Ray's socket paths live there
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PLAIT_TOKEN", None)
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    proc = subprocess.Popen([ray_bin, "start", "--head", "--block", "--port", str(port), "--num-cpus", "2",
                             "--include-dashboard", "false", "--include-log-monitor", "false",
                             "--disable-usage-stats", "--temp-dir", temp],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "ray start --head failed"
                time.sleep(0.1)
        RELEASE_WITH_GROUP["ray_head"] = lambda: stop_ray_head(proc, grace=1.0)
        yield {"address": f"127.0.0.1:{port}", "env": env, "pid": proc.pid}
    finally:
        RELEASE_WITH_GROUP.pop("ray_head", None)
        stop_ray_head(proc, grace=1.0)  # nothing needs its clean stop: its session is killed
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="session")
def demo_spec_path(tmp_path_factory):
    """The demo corpus (`plait demo`'s text sources, ~8 s of CPU to write), generated once per session and only
    read by the tests that take it."""
    if not os.environ.get(DEMO_DIR):  # under xdist: one folder for every worker, written by the first
        from plait.cli.demo_data import generate

        return generate(tmp_path_factory.mktemp("demo"))
    return shared_demo_corpus()


def shared_demo_corpus():
    """The workers' demo corpus (its spec's path), written by the first that asks."""
    import fcntl

    from plait.cli.demo_data import generate

    shared = os.environ[DEMO_DIR]
    with open(os.path.join(shared, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the others wait for the first writer, then find it written
        return generate(shared)


@pytest.hookimpl(tryfirst=True)  # the ray mark is added before `-m ray` / `-m "not ray"` selects on it
def pytest_collection_modifyitems(config, items):
    """Whole modules that use the session's Ray instance go last, in their order; each gets the `ray` mark.
    `make test-split` runs `-m ray` and `-m "not ray"` as two processes at once: only the first starts Ray."""
    shared = {item.path for item in items if "ray_session" in getattr(item, "fixturenames", ())}
    for item in items:
        if item.path in shared and "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
    items[:] = [i for i in items if i.path not in shared] + [i for i in items if i.path in shared]
    # Under pytest-xdist (`make test`, --dist loadgroup) the Ray tests form groups, each run by one worker: the
    # modules on the session's instance (one instance per worker that runs them) and those that start or
    # join a Ray of their own. As many groups as workers, the largest scopes, so xdist hands each worker one
    # group first and no worker runs a group of the other kind after (a test that needs no Ray in its process
    # never meets a session instance started there). Two local instances side by side are separate clusters
    # (a `ray start` head of a test lives in its own temp dir: never found by another process's ray.init()).
    # The other tests fill the workers as they come.
    workers = worker_count(config)
    if workers < 2:
        return
    own = {item.path for item in items if item.path not in shared and item.get_closest_marker("ray") is not None}
    group_of = {**spread(items, shared, "ray-session", (workers + 1) // 2), **spread(items, own, "ray-own", workers // 2)}
    # xdist hands out the scopes with the most tests first: a module of a few slow tests (torchrun examples,
    # trainer subprocesses: 20-50 s) came last, one worker running it alone while the others had finished.
    # Grouped (as many groups as workers), they are handed out early, among the large scopes.
    few_slow = {path for path, n in Counter(item.path for item in items).items()
                if path not in group_of and n <= FEW_TESTS} & {item.path for item in items if is_slow(item)}
    group_of.update(spread(items, few_slow, "few-slow", workers, weigh=is_slow))
    for item in items:
        if item.path in group_of:
            item.add_marker(pytest.mark.xdist_group(group_of[item.path]))
    ray_groups = {g for path, g in group_of.items() if path in shared or path in own}
    if len(ray_groups) == 2:  # one of each kind: a worker that leaves its Ray group is handed no other
        config.stash[RAY_GROUP_OF] = {path: group_of[path] for path in shared | own}


@pytest.hookimpl(trylast=True)  # after the module fixtures' teardown (pytest's own implementation)
def pytest_runtest_teardown(item, nextitem):
    ray_group_of = item.config.stash.get(RAY_GROUP_OF, {})
    group = ray_group_of.get(item.path)
    if group is None or nextitem is None or ray_group_of.get(nextitem.path) == group:
        return
    for name in list(RELEASE_WITH_GROUP):
        RELEASE_WITH_GROUP.pop(name)()
        RELEASED.add(name)


def pytest_runtest_setup(item):
    gone = RELEASED & set(getattr(item, "fixturenames", ()))
    if gone:
        pytest.fail(f"{item.nodeid} needs {sorted(gone)}, released when this worker left its Ray group "
                    f"(tests/conftest.py: a Ray module outside the Ray groups?)", pytrace=False)


def worker_count(config) -> int:
    """pytest-xdist's workers: in a worker, how many there are; in the controller, `-n`."""
    if hasattr(config, "workerinput"):
        return int(config.workerinput["workercount"])
    return int(getattr(config.option, "numprocesses", 0) or 0)


FEW_TESTS = 12  # a module of more tests is handed out early anyway


def is_slow(item) -> bool:
    return any(item.get_closest_marker(mark) is not None for mark in ("slow", "subprocess"))


def spread(items, modules: set, name: str, groups: int, weigh=lambda item: item.get_closest_marker("ray")) -> dict:
    """Whole modules (a module's Ray head or job is module-scoped) into `groups` groups of about equal weight,
    the weight of a module being its tests that `weigh` (its Ray tests: they take ~90% of a Ray module's time);
    the same on every worker, as xdist requires."""
    weight = {path: 0 for path in modules}
    for item in items:
        if item.path in weight and weigh(item):
            weight[item.path] += 1
    load = [0] * groups
    group_of = {}
    for path in sorted(weight, key=lambda p: (-weight[p], str(p))):
        g = load.index(min(load))
        load[g] += weight[path]
        group_of[path] = name if groups == 1 else f"{name}-{g}"
    return group_of


UNGROUPED = pytest.StashKey[str]()  # why pytest-xdist did not group this worker's tests, if it did not


def pytest_collection_finish(session):
    """Notice when pytest-xdist's loadgroup did not group. It sends a group's tests to one worker by the
    `@group` its own collection hook appends to their ids; from pytest 9.2 that append no longer takes
    (pytest-dev/pytest-xdist#1386: pytest's ids became structured) and every test goes to whichever worker
    is free, silently: each Ray module's instance and module fixtures then start on both workers."""
    config = session.config
    if not hasattr(config, "workerinput") or not config.getvalue("loadgroup"):
        return
    lost = [item.nodeid for item in session.items
            if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid.rsplit("]", 1)[-1]]
    if lost:
        config.stash[UNGROUPED] = (
            f"pytest-xdist did not group {len(lost)} tests marked xdist_group (e.g. {lost[0]}): this pytest "
            f"({pytest.__version__}) and pytest-xdist do not work together for --dist loadgroup "
            f"(pytest-dev/pytest-xdist#1386); install the versions in constraints-dev.txt (make venv)")


@pytest.fixture(scope="session", autouse=True)
def xdist_grouped(request):
    """Every test of a worker whose tests were not grouped errors with the reason (an error raised during a
    worker's collection reaches the user as an INTERNALERROR without it)."""
    why = request.config.stash.get(UNGROUPED, None)
    if why:
        pytest.fail(why, pytrace=False)
