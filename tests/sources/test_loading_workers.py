"""A SourceLoader's preprocessing pool (loading.workers): images decode on several threads, the batches
are the same bytes for any number of workers, a gather's pixels are written once (decoded straight into
the payload's buffer, never copied per rank), and the spec field is validated at load time."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest
from mm_data import llava, mm_spec, parquet, webdataset

import plait
from plait.errors import SpecError
from plait.metrics import batch_digest_update
from plait.runtime.local import LocalRoles, LocalRuntime
from plait.job.service import JobService
from plait.media import image  # the image medium decodes through image.decode
from plait.sources.workers import WorkerPool, resolve_workers


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    base = tmp_path_factory.mktemp("mmw")
    return [llava(base / "l", n=30), webdataset(base / "w", shards=3, per_shard=8), parquet(base / "p", n=16)]


def run(spec_dict: dict, workers, steps: int = 3) -> tuple[str, LocalRuntime]:
    spec = plait.load_spec({**spec_dict, "loading": {"workers": workers}})
    rt = LocalRuntime(spec)
    h = hashlib.sha256()
    for _ in range(steps):
        plan = rt.plan()
        for r in range(plan.ranks):
            for mb in rt.build(plan, r):
                batch_digest_update(h, mb)
        rt.release()
    return h.hexdigest(), rt


def test_worker_count_changes_no_digest(sources, monkeypatch):
    threads: set[str] = set()
    real = image.decode

    def watched(*args, **kw):
        threads.add(threading.current_thread().name)
        return real(*args, **kw)

    monkeypatch.setattr(image, "decode", watched)
    spec = mm_spec(sources)
    digests = {}
    for workers in (1, 2, 4):
        threads.clear()
        digests[workers], rt = run(spec, workers)
        assert rt.loader.workers == workers
        rt.close()
        if workers > 1:  # the decodes really ran on the pool
            assert len({t for t in threads if t.startswith("plait-preprocess")}) > 1
    assert len(set(digests.values())) == 1, digests


def test_pixels_are_decoded_into_the_delivered_buffer(sources, monkeypatch):
    """No copy of a decoded image between the decoder and the trainer's micro-batch: every image's patches
    are written once, into the buffer the micro-batches are views of."""
    decoded: list[np.ndarray] = []
    real = image.decode

    def watched(*args, **kw):
        got = real(*args, **kw)
        decoded.append(got.patches)
        return got

    monkeypatch.setattr(image, "decode", watched)
    _, rt = run(mm_spec(sources), 2, steps=1)
    plan = rt.plan()
    decoded.clear()
    batches = [mb for r in range(plan.ranks) for mb in rt.build(plan, r)]
    rt.close()
    delivered = [mb.pixel_values for mb in batches if mb.pixel_values is not None and len(mb.pixel_values)]
    assert decoded and delivered
    for patches in decoded:  # each decoded image lies inside one delivered micro-batch's pixels
        assert any(np.shares_memory(patches, pv) for pv in delivered)
    copied = sum(p.nbytes for p in decoded if not any(np.shares_memory(p, pv) for pv in delivered))
    assert copied == 0


def test_ranks_of_one_replica_share_the_batch(sources):
    """TP ranks (the same DP rank asked twice) get the same arrays; CP shards keep the replica's pixels."""
    spec = plait.load_spec({**mm_spec(sources), "topology": {"dp": 2, "cp": 2}, "loading": {"workers": 2}})
    job = JobService(LocalRoles(spec), build_ahead=0)
    try:
        gen, _ = job.base()
        _, tp0 = job.get(gen, 0, 0, cp=(2, 0))
        _, tp1 = job.get(gen, 0, 0, cp=(2, 0))
        _, cp1 = job.get(gen, 0, 0, cp=(2, 1))
    finally:
        job.close()
    for a, b, c in zip(tp0, tp1, cp1):
        assert a.input_ids is b.input_ids or np.shares_memory(a.input_ids, b.input_ids)
        if a.pixel_values is not None and len(a.pixel_values):
            assert np.shares_memory(a.pixel_values, b.pixel_values)
            assert np.shares_memory(a.pixel_values, c.pixel_values)


@pytest.mark.parametrize("value", [0, -2, "many", 1.5])
def test_invalid_workers_fail_at_load_naming_the_field(value):
    with pytest.raises(SpecError, match="workers"):
        plait.load_spec({"sources": [{"name": "a", "path": "x.parquet"}], "loading": {"workers": value}})


def test_auto_is_the_cpus_left_after_the_trainers(monkeypatch):
    monkeypatch.setattr("plait.sources.workers.available_cpus", lambda: 16)
    assert resolve_workers("auto", env={}) == 15
    assert resolve_workers("auto", env={"LOCAL_WORLD_SIZE": "8"}) == 8
    assert resolve_workers("auto", env={"LOCAL_WORLD_SIZE": "32"}) == 1
    assert resolve_workers("auto", cpus=3, env={"LOCAL_WORLD_SIZE": "8"}) == 3  # a Ray actor's CPUs
    assert resolve_workers(6) == 6


def test_pool_keeps_item_order_and_raises_the_first_failure():
    pool = WorkerPool(3)
    assert pool.map(lambda x: x * x, range(20)) == [x * x for x in range(20)]

    def fail(x):
        if x in (5, 9):
            raise ValueError(f"item {x}")
        return x

    with pytest.raises(ValueError, match="item 5"):
        pool.map(fail, range(12))
    pool.close()
