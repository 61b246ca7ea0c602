"""A Ray instance plait starts is plait's to release: shared by the runtimes of a process,
shut down by the last close, and a close never starts anything. Join failures name their cause."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

import plait  # noqa: E402
from plait.runtime.ray.runtime import explain_join_failure  # noqa: E402
from helpers import make_spec, token_parquet  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


@pytest.mark.parametrize("said, cause", [
    ("gcs_client.cc:210: Failed to get cluster ID from GCS server: Unauthenticated: RPC error: InvalidAuthToken",
     "authentication failed"),
    ("Version mismatch: The cluster was started with Ray 2.9 Python 3.10", "version mismatch"),
    ("", "no Ray head answered there"),
])
def test_a_failed_join_names_its_cause(said, cause):
    message = explain_join_failure("10.0.0.1:6379", ConnectionError("Failed to connect to Ray cluster"), said)
    assert cause in message and "10.0.0.1:6379" in message


def test_a_failed_join_says_plaits_advice_first_and_keeps_rays_output_in_a_file(monkeypatch, capfd):
    """Ray logs twenty lines of its own before failing a join to a token-protected cluster; plait's
    one-sentence advice comes first, and Ray's lines go to a file the error names (nothing is lost)."""
    import os

    from plait.runtime.ray.instance import start_ray

    def failing_init(*args, **kwargs):
        os.write(2, b"".join(b"W ray noise line %d: auth token check\n" % i for i in range(20)))
        raise ConnectionError("Failed to get cluster ID from GCS server: Unauthenticated: InvalidAuthToken")

    monkeypatch.setattr(ray, "init", failing_init)
    with pytest.raises(plait.PlaitError) as caught:
        start_ray("auto")
    message = str(caught.value)
    assert "authentication failed" in message and "RAY_AUTH_TOKEN" in message
    assert "ray noise line" not in capfd.readouterr().err  # not before plait's advice
    log = message.rsplit("Ray's own output: ", 1)[1].rstrip(")")
    with open(log) as f:
        assert f.read().count("ray noise line") == 20
    os.remove(log)


def test_a_local_instance_plait_starts_is_set_up_for_a_long_job_and_released_by_the_last_close(tmp_path):
    """Bounded task events in the GCS, no dashboard (nor Ray's metrics export), rotated logs, bounded malloc
    arenas; plait's actors without task events: read back from the instance plait started. Two Loaders of
    the process share that instance; closing one leaves it to the other, the last close releases it, and a
    close never starts anything. (One instance for both checks: each start costs seconds of CPU.)"""
    from ray._private import ray_constants, worker
    from ray._private.state import state

    import os

    import psutil

    from plait.runtime.ray.common import (LOG_MONITOR_ENV, LOG_ROTATION_BACKUPS, LOG_ROTATION_BYTES,
                                          TASK_EVENTS_IN_GCS)

    assert not ray.is_initialized(), "this test needs no Ray running in the process"
    ds = token_parquet(tmp_path / "a", files=2, docs_per_file=20, row_group_size=5, lo=4, hi=40)
    spec = make_spec([ds], seq_len=64, microbatches=2, dp=1)
    # a named job without its standby Planner (not the subject here: one process fewer)
    first = plait.Loader(spec, runtime="ray", loaders=1, steps=2, job="long-job", planner_standby=False)
    second = plait.Loader(spec, runtime="ray", loaders=1, steps=2)
    try:
        config = state.get_system_config()
        assert config["task_events_max_num_task_in_gcs"] == TASK_EVENTS_IN_GCS  # Ray's default: 100,000
        assert config["enable_metrics_collection"] is False
        node = worker.global_worker.node
        assert (node.max_bytes, node.backup_count) == (LOG_ROTATION_BYTES, LOG_ROTATION_BACKUPS)
        assert not node.webui_url  # no dashboard: Ray keeps only a head process of one module, without web UI
        for process in node.all_processes.get(ray_constants.PROCESS_TYPE_DASHBOARD, []):
            assert "--disable-frontend" in process.process.args
        assert len(list(first)) == 4  # 2 steps x 2 micro-batches
        # plait's actors make no task events (each call would be one more record in the GCS), on any cluster:
        # every actor plait starts takes its options from actor_options (Ray offers no public read-back)
        from plait.runtime.ray.common import actor_options

        assert actor_options("long-job/planner", lifetime="detached")["enable_task_events"] is False
        assert actor_options(num_cpus=1)["enable_task_events"] is False
        # their processes and Ray's own start with few malloc arenas (MALLOC_ARENA_MAX, read at a process's start)
        # and with Ray's jemalloc, which Ray alone would preload into its gcs_server and raylet only
        loader_pid = ray.get(ray.get_actor("long-job/loader-0", namespace="plait").stats.remote())["pid"]
        gcs_pid = node.all_processes[ray_constants.PROCESS_TYPE_GCS_SERVER][0].process.pid
        for pid in (loader_pid, gcs_pid):
            assert psutil.Process(pid).environ().get("MALLOC_ARENA_MAX") == "2"
            mapped = {m.path for m in psutil.Process(pid).memory_maps()}
            assert any(path.endswith("ray/core/libjemalloc.so") for path in mapped), pid
        # its log monitor looks for new log files every 5 s, not 10 times a second
        monitor = node.all_processes[ray_constants.PROCESS_TYPE_LOG_MONITOR][0].process.pid
        said = psutil.Process(monitor).environ()
        assert {k: said.get(k) for k in LOG_MONITOR_ENV} == LOG_MONITOR_ENV
        assert "MALLOC_ARENA_MAX" not in os.environ  # the trainer's own environment is left as it was
        assert "RAY_LD_PRELOAD_ON_WORKERS" not in os.environ

        first.close()
        assert ray.is_initialized(), "closing one Loader must not pull Ray from under the other"
        assert len(list(second)) == 4
    finally:
        second.close()
        first.close()  # (closed above unless an assertion failed first)
    assert not ray.is_initialized(), "the last close releases the instance plait started"
    first.close()
    second.close()
    assert not ray.is_initialized(), "a close never starts anything"


def test_the_allocator_of_rays_processes_is_rays_jemalloc_unless_the_user_says_glibc(monkeypatch):
    from plait.errors import PlaitError
    from plait.runtime.ray.common import ALLOCATOR_VARIABLE, malloc_env

    monkeypatch.delenv(ALLOCATOR_VARIABLE, raising=False)
    assert malloc_env() == {"MALLOC_ARENA_MAX": "2", "RAY_LD_PRELOAD_ON_WORKERS": "1"}
    monkeypatch.setenv(ALLOCATOR_VARIABLE, "glibc")  # Ray's default: jemalloc in gcs_server and raylet only
    assert malloc_env() == {"MALLOC_ARENA_MAX": "2"}
    monkeypatch.setenv(ALLOCATOR_VARIABLE, "tcmalloc")
    with pytest.raises(PlaitError, match="PLAIT_RAY_ALLOCATOR='tcmalloc': expected one of jemalloc, glibc"):
        malloc_env()


def test_ray_start_record_is_found_where_ray_looks(tmp_path, monkeypatch):
    """Ray keeps `ray start`'s record under RAY_TMPDIR, else TMPDIR on Linux, else /tmp: plait looks in the
    same place, so a job under a scheduler that sets TMPDIR joins the cluster instead of starting one."""
    import sys

    from plait.runtime.ray.instance import cluster_to_join

    if not sys.platform.startswith("linux"):
        pytest.skip("TMPDIR's rule is Linux's")
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:6390\n")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert cluster_to_join(None) == ("127.0.0.1:6390", "ray start's record")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "elsewhere"))  # RAY_TMPDIR first: no record there
    assert cluster_to_join(None) == (None, "address")  # a local instance
    assert cluster_to_join("auto") == ("auto", "address")  # Ray's own "no running instance" error
    assert cluster_to_join("local") == (None, "address")
