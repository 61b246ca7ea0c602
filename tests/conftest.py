"""Shared test setup: hypothesis settings sized for a small CI machine, `tests/` on sys.path so that test
modules can `from helpers import ...` / `from fixtures import ...`, the repository root on it so that the
tests of the measurement suite can import `benchmarks`, and the session's one Ray instance."""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

settings.register_profile(
    "plait", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "plait"))

# Ray reads its authentication mode once per process: a module that joins a head started without token
# auth would leave this process unable to authenticate to a local instance started later (its GCS then
# "fails to start"). One mode for the whole test session keeps the Ray modules independent of their order.
os.environ["RAY_AUTH_MODE"] = "disabled"


# One local Ray instance for the whole test session. Modules that run on it take the `ray_session` fixture
# (its GCS address), never ray.init/shutdown of their own. Their modules run last (see the hook below), so
# the tests that need no Ray in this process (plait starting and releasing its own instance, a `ray start
# --head` cluster joined by address, a bad address failing fast) run before it starts.
RAY_OPTIONS = {"num_cpus": 2, "include_dashboard": False, "namespace": "plait", "log_to_driver": False,
               "configure_logging": False}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist starts its workers
def pytest_sessionstart(session):
    """numba's kernels compiled once, into its on-disk cache, before any test process needs them: on a fresh
    clone each xdist worker (and each trainer subprocess started before the cache exists) would otherwise
    compile them itself, ~25 s of CPU each. A worker finds the cache its controller wrote."""
    if hasattr(session.config, "workerinput"):
        return
    from plait.balance.warmup import warmup
    from plait.kernels import warm_up

    warmup()
    warm_up()


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(**RAY_OPTIONS)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def demo_spec_path(tmp_path_factory):
    """The demo corpus (`plait demo`'s text sources, ~8 s of CPU to write), generated once per session and only
    read by the tests that take it."""
    from plait.cli.demo_data import generate

    return generate(tmp_path_factory.mktemp("demo"))


@pytest.hookimpl(tryfirst=True)  # the ray mark is added before `-m ray` / `-m "not ray"` selects on it
def pytest_collection_modifyitems(config, items):
    """Whole modules that use the session's Ray instance go last, in their order; each gets the `ray` mark.
    `make test-split` runs `-m ray` and `-m "not ray"` as two processes at once: only the first starts Ray."""
    shared = {item.path for item in items if "ray_session" in getattr(item, "fixturenames", ())}
    for item in items:
        if item.path in shared and "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
    items[:] = [i for i in items if i.path not in shared] + [i for i in items if i.path in shared]
    # Under pytest-xdist (`make test`: two workers, --dist loadgroup) the tests on the session's instance form
    # one group and those that start or join a Ray of their own another: the two largest groups, so xdist
    # hands them to different workers first (largest scopes first), and neither worker runs a test that
    # needs no Ray in its process after the session's instance started there. Two local instances side by
    # side are separate clusters (a `ray start` head of a test lives in its own temp dir: never found by
    # another process's ray.init()). The other tests fill both workers as they come.
    for item in items:
        if item.path in shared:
            item.add_marker(pytest.mark.xdist_group("ray-session"))
        elif item.get_closest_marker("ray") is not None:
            item.add_marker(pytest.mark.xdist_group("ray-own"))
