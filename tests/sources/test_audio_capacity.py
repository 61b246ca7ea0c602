"""`packing.max_audio_positions`: the audio encoder's capacity per micro-batch, beside the tokens (and the
vision encoder's patches). The balancer places an item only where its clips' encoder positions fit; a
sample whose clips alone hold more is a bad record (named under raise, skipped and counted under skip),
never carried from step to step; a spec without audio that sets it fails at load time."""

from __future__ import annotations

import numpy as np
import pytest
from audio_data import audio_spec, llava_audio, webdataset_audio
from helpers import make_spec, token_parquet

import plait
from plait.errors import SourceError, SpecError
from plait.runtime.local import LocalRuntime

pytest.importorskip("av")
WINDOW_POSITIONS = 1500  # qwen2audio: a padded 30 s window's encoder positions ((3000 - 1) // 2 + 1)


def delivered(spec_dict: dict, steps: int) -> tuple[list, LocalRuntime]:
    rt = LocalRuntime(plait.load_spec(spec_dict))
    out = []
    for _ in range(steps):
        plan = rt.plan()
        out += [mb for r in range(plan.ranks) for mb in rt.build(plan, r)]
        rt.release()
    return out, rt


def positions(mb) -> int:
    """The micro-batch's audio encoder positions, from what it carries: its clips' windows."""
    windows = getattr(mb, "audio_windows", None)
    return 0 if windows is None else WINDOW_POSITIONS * int(np.sum(windows))


def capped(spec: dict, cap: int | None) -> dict:
    return {**spec, "packing": {**spec["packing"], "max_audio_positions": cap}}


def test_no_micro_batch_holds_more_audio_positions_than_the_cap(tmp_path):
    src = webdataset_audio(tmp_path, shards=2, per_shard=6)  # one short clip (one window) per sample
    spec = audio_spec([src], seq_len=2048, microbatches=2, dp=1)
    free, _ = delivered(spec, 2)
    cap = 2 * WINDOW_POSITIONS
    assert max(map(positions, free)) > cap  # without the cap, micro-batches hold more clips: it binds
    held, _ = delivered(capped(spec, cap), 6)
    assert max(map(positions, held)) <= cap
    assert sum(map(positions, held)) > 0
    ids = [tuple(row) for mb in held for row in mb.sample_ids.tolist()]
    assert len(ids) == len(set(ids))  # carried items come later, once


def test_a_sample_whose_clips_exceed_the_cap_is_a_bad_record(tmp_path):
    """llava_audio's odd rows hold two clips (two windows): over a one-window cap."""
    src = llava_audio(tmp_path)
    spec = capped(audio_spec([src], dp=1, microbatches=1), WINDOW_POSITIONS)
    with pytest.raises(SourceError) as e:
        delivered(spec, 1)
    message = str(e.value)
    assert "llava_audio" in message and "speech.jsonl" in message and "packing.max_audio_positions" in message
    skipping = capped(audio_spec([{**src, "on_error": "skip"}], dp=1, microbatches=1), WINDOW_POSITIONS)
    out, rt = delivered(skipping, 3)
    rows = {int(r) for mb in out for r in mb.sample_ids[:, 3]}
    assert rows and rows <= {0, 2, 4}  # the one-clip samples only
    assert rt.error_report()["llava_audio"]["bad_records"] >= 2


def test_the_cap_needs_audio(tmp_path):
    spec = make_spec([token_parquet(tmp_path, files=1, docs_per_file=8)], seq_len=64, microbatches=1, dp=1)
    spec["packing"]["max_audio_positions"] = 1500
    with pytest.raises(SpecError, match="max_audio_positions"):
        plait.load_spec(spec)
