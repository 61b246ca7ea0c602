"""A Ray instance plait starts is plait's to release: shared by the runtimes of a process,
shut down by the last close, and a close never starts anything. Join failures name their cause."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

import plait  # noqa: E402
from plait.runtime.ray.runtime import explain_join_failure  # noqa: E402
from helpers import make_spec, token_parquet  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


def test_two_loaders_share_the_instance_plait_started_and_the_last_close_releases_it(tmp_path):
    assert not ray.is_initialized(), "this test needs no Ray running in the process"
    ds = token_parquet(tmp_path / "a", files=2, docs_per_file=20, row_group_size=5, lo=4, hi=40)
    spec = make_spec([ds], seq_len=64, microbatches=2, dp=1)
    first = plait.Loader(spec, runtime="ray", loaders=1, steps=2)
    second = plait.Loader(spec, runtime="ray", loaders=1, steps=2)
    try:
        assert len(list(first)) == 4  # 2 steps x 2 micro-batches
        first.close()
        assert ray.is_initialized(), "closing one Loader must not pull Ray from under the other"
        assert len(list(second)) == 4
    finally:
        second.close()
    assert not ray.is_initialized(), "the last close releases the instance plait started"
    first.close()
    second.close()
    assert not ray.is_initialized(), "a close never starts anything"


@pytest.mark.parametrize("said, cause", [
    ("gcs_client.cc:210: Failed to get cluster ID from GCS server: Unauthenticated: RPC error: InvalidAuthToken",
     "authentication failed"),
    ("Version mismatch: The cluster was started with Ray 2.9 Python 3.10", "version mismatch"),
    ("", "no Ray head answered there"),
])
def test_a_failed_join_names_its_cause(said, cause):
    message = explain_join_failure("10.0.0.1:6379", ConnectionError("Failed to connect to Ray cluster"), said)
    assert cause in message and "10.0.0.1:6379" in message
