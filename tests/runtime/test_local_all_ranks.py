"""The local runtime read for every rank by one process (LocalRuntime all_ranks=True, as `plait bench e2e`'s
data-bound row runs it): the same stream as the plan/build driver, each block read and each image decoded
once, several ranks' builds on several threads."""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from mm_data import llava, mm_spec, parquet

import plait
from plait.metrics import batch_digest_update
from plait.runtime import local, make_runtime
from plait.runtime.local import LocalRuntime

DP, STEPS = 4, 4


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    base = tmp_path_factory.mktemp("allranks")
    sources = [llava(base / "l", n=40), parquet(base / "p", n=24)]
    return plait.load_spec({**mm_spec(sources, dp=DP), "loading": {"workers": 2}})


def reference(spec) -> tuple[list[str], int, int]:
    """Per-rank digests, blocks read and images decoded of the driver: plan, build every rank, release."""
    rt = LocalRuntime(spec)
    digests = [hashlib.sha256() for _ in range(DP)]
    try:
        for _ in range(STEPS):
            plan = rt.plan()
            for r in range(DP):
                for mb in rt.build(plan, r):
                    batch_digest_update(digests[r], mb)
            rt.release()
        return [h.hexdigest() for h in digests], rt.loader.blocks_read, rt.loader.images_decoded
    finally:
        rt.close()


def read_every_rank(rt) -> tuple[list[str], int]:
    """Each rank's stream read on a thread of its own: (digests, images delivered)."""
    start = rt.state_dict()

    def rank(r: int) -> tuple[str, int]:
        digest, images = hashlib.sha256(), 0
        for _, mb in rt.iter_rank(r, start, 0, STEPS):
            batch_digest_update(digest, mb)
            images += int(mb.num_images)
        return digest.hexdigest(), images

    with ThreadPoolExecutor(max_workers=DP) as pool:  # every rank at once; map re-raises a rank's error
        done = list(pool.map(rank, range(DP)))
    return [d for d, _ in done], sum(n for _, n in done)


def test_every_rank_read_in_one_process_is_the_drivers_stream_read_once(spec, monkeypatch):
    want, blocks, decoded = reference(spec)
    assert decoded > 0  # the spec has images

    builders: set[str] = set()
    real_build = local.LocalRoles.build

    def watched(self, plan, dp_rank, only=None):
        builders.add(threading.current_thread().name)
        return real_build(self, plan, dp_rank, only)

    monkeypatch.setattr(local.LocalRoles, "build", watched)
    rt = make_runtime(spec, "local", all_ranks=True, build_threads=2)
    try:
        got, delivered = read_every_rank(rt)
        assert got == want  # every rank: the same micro-batches as the driver's
        assert rt.loader.blocks_read == blocks  # no block read again (a step's blocks stay until all built it)
        assert rt.loader.images_decoded == decoded == delivered  # each image decoded once per delivery
    finally:
        rt.close()
    assert len({b for b in builders if b.startswith("plait-build")}) == 2  # several ranks built at once


def test_a_rank_far_ahead_of_the_others_leaves_them_its_steps_blocks(spec):
    """Rank 0 reads all its steps before any other rank asks: the blocks of those steps stay until every
    rank has built them (were they released once the ranks that had asked had built, the later ranks would
    read them again)."""
    _, blocks, decoded = reference(spec)
    rt = LocalRuntime(spec, all_ranks=True)
    try:
        start = rt.state_dict()
        delivered = 0
        for r in range(DP):  # one after the other, each to the end
            delivered += sum(int(mb.num_images) for _, mb in rt.iter_rank(r, start, 0, STEPS))
        assert rt.loader.blocks_read == blocks
        assert rt.loader.images_decoded == decoded == delivered
    finally:
        rt.close()


def test_a_trainers_own_process_builds_its_rank_alone_by_default(spec):
    rt = LocalRuntime(spec)
    try:
        assert rt.service.cache.ahead == 0 and len(rt.service.cache.workers.threads) == 1
        assert not rt.service.every_rank_reads
    finally:
        rt.close()
    rt = LocalRuntime(spec, all_ranks=True)
    try:
        assert rt.service.cache.ahead == 2 and rt.service.every_rank_reads
    finally:
        rt.close()
