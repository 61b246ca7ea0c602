"""The docs' loss recipe (docs/multimodal-correctness.md, `label_normaliser`), run as written in two gloo
processes: with an image that fails after planning, the normaliser is the labels that are not -100 over
both ranks' micro-batches of each step, where `global_label_tokens` alone over-counts by the dropped
samples' labels."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import run_spawned_ranks
from mm_data import image_bytes, llava, mm_spec

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8


def recipe_function() -> str:
    """The code block of the docs that defines label_normaliser, without the training loop after it."""
    page = (ROOT / "docs" / "multimodal-correctness.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "def label_normaliser" in b)
    return block.split("\nstep_batches = []")[0]


def rank_main(rank: int, spec_dict: dict, init: str, out: str) -> None:
    """One DP rank: plan every step (as each process does on the local runtime), build its own share,
    normalise with the docs' function, record (normaliser, own direct count, global_label_tokens)."""
    import torch.distributed as dist

    import plait
    from plait.packing import IGNORE_INDEX
    from plait.runtime import make_runtime

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    scope: dict = {}
    exec(recipe_function(), scope)  # noqa: S102 - the documented recipe, verbatim
    rt = make_runtime(plait.load_spec(spec_dict), "local")
    rows = []
    try:
        for _ in range(STEPS):
            plan = rt.plan()
            batches = rt.build(plan, rank)
            rt.release()
            direct = sum(int(np.count_nonzero(mb.labels != IGNORE_INDEX)) for mb in batches)
            rows.append([scope["label_normaliser"](batches), direct, batches[0].stats["global_label_tokens"],
                         sum(mb.stats["dropped_samples"] for mb in batches)])
    finally:
        rt.close()
        dist.destroy_process_group()
    Path(out).write_text(json.dumps(rows))


@pytest.mark.subprocess
def test_docs_loss_recipe_gives_the_delivered_label_count(tmp_path):
    pytest.importorskip("torch.multiprocessing")
    src = llava(tmp_path / "l", n=12, max_images=1, jsonl=True)
    rec = [json.loads(line) for line in (tmp_path / "l" / "data.jsonl").read_text().splitlines()][5]
    body = image_bytes(90, 70, "JPEG", seed=11)
    (tmp_path / "l" / rec["image"]).write_bytes(body[: len(body) // 2])  # header intact, body cut: fails at gather
    spec = mm_spec([{**src, "on_error": "skip"}], dp=2)
    ranks = run_spawned_ranks(rank_main, spec, tmp_path)
    dropped_steps = 0
    for step, (a, b) in enumerate(zip(*ranks)):
        assert a[0] == b[0], f"step {step}: the ranks disagree on the normaliser"
        assert a[0] == a[1] + b[1], f"step {step}: normaliser {a[0]}, labels delivered {a[1] + b[1]}"
        if a[3] + b[3]:
            dropped_steps += 1
            assert a[2] > a[0]  # what global_label_tokens alone gets wrong
    assert dropped_steps >= 2  # the cut image is planned, and dropped, in every epoch
