"""The loaders' cost probe (plait.runtime.scaling.probe_costs) decodes audio clips as a loader's gather does:
an audio source's measured cost per token holds its decode and log-mel, not only the header read that
planning does."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("av")

import plait  # noqa: E402
from plait.cli.audio_data import audio_source_spec, write_audio_source  # noqa: E402
from plait.media import audio  # noqa: E402
from plait.runtime import scaling  # noqa: E402
from plait.media.audio import AudioRef  # noqa: E402


def test_probe_decodes_every_clip_of_the_blocks_it_reads(tmp_path, monkeypatch):
    speech = audio_source_spec(write_audio_source(tmp_path / "speech", 6, longest=4.0))
    text = {"name": "text", "path": str(tmp_path / "t.jsonl"), "format": "jsonl", "text_field": "text"}
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps({"text": "words " * 40}) for _ in range(200)))
    spec = plait.load_spec({"sources": [speech, text], "audio": {"audio_token_id": 300},
                            "packing": {"seq_len": 2048}})
    clips, measured = [], scaling.media_seconds

    def counting(src, block):
        refs = [] if block.images is None else block.images.refs
        clips.append(sum(isinstance(r, AudioRef) for r in refs))
        return measured(src, block)

    monkeypatch.setattr(scaling, "media_seconds", counting)
    before = audio.AUDIO_DECODES.count
    costs, files = scaling.probe_costs(spec, budget_s=1.0)
    assert files == [1, 1] and min(costs) > 0
    assert sum(clips) >= 6 and audio.AUDIO_DECODES.count - before == sum(clips)  # each clip once per block read
