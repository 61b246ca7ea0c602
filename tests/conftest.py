"""Shared test setup: hypothesis settings sized for a small CI machine, and `tests/` on sys.path so
that test modules can `from helpers import ...`."""

from __future__ import annotations

import os
import sys

from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))

settings.register_profile(
    "plait", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "plait"))

# Ray reads its authentication mode once per process: a module that joins a head started without token
# auth would leave this process unable to authenticate to a local instance started later (its GCS then
# "fails to start"). One mode for the whole test session keeps the Ray modules independent of their order.
os.environ["RAY_AUTH_MODE"] = "disabled"
