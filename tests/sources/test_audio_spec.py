"""The spec's `audio` section and a source's `audio_field`: invalid specs fail at load naming the field."""

import pytest

from plait.errors import SpecError
from plait.spec import load_spec

SOURCE = {"name": "speech", "path": "x/*.tar", "format": "webdataset", "text_field": "txt", "audio_field": "wav;flac"}
AUDIO = {"audio_token_id": 151646}


def spec(source=None, audio=AUDIO, **top):
    return {"sources": [{**SOURCE, **(source or {})}], **({"audio": audio} if audio is not None else {}), **top}


def test_an_audio_section_loads_with_its_defaults():
    s = load_spec(spec())
    assert (s.audio.policy, s.audio.mel_bins, s.audio.chunk_seconds) == ("qwen2audio", 128, 2.0)
    assert s.audio.encoder.hidden == 1280 and s.sources[0].audio_extensions == ["wav", "flac"]
    assert s.sources[0].multimodal


@pytest.mark.parametrize("bad, where", [
    (spec(audio=None), "audio: sources ['speech'] read audio"),
    (spec(audio={**AUDIO, "mel_bins": 64}), "audio.mel_bins"),
    (spec(audio={**AUDIO, "policy": "whisper"}), "audio.policy"),
    (spec(audio={**AUDIO, "chunk_seconds": 0.005}), "audio.chunk_seconds"),
    (spec(audio={"policy": "chunked"}), "audio.audio_token_id"),
    (spec(audio={**AUDIO, "audio_token_id": 70}, vocab_size=64), "outside the vocabulary"),
    (spec(audio=AUDIO, images={"image_token_id": 151646}), "each medium needs its own placeholder id"),
    (spec({"audio_field": "wav;aac"}), "sources[0](speech): audio_field: unknown audio extension"),
    (spec({"format": "arrow", "path": "x.arrow"}), "audio_field: format arrow holds no audio"),
    (spec({"text_field": None, "tokens_field": "ids"}), "audio_field: an audio source needs text_field"),
])
def test_an_invalid_audio_spec_names_the_field(bad, where):
    with pytest.raises(SpecError) as e:
        load_spec(bad)
    assert where in str(e.value)


def test_text_only_fingerprints_are_unchanged_by_the_audio_fields():
    text = {"sources": [{"name": "t", "path": "x.jsonl", "text_field": "text"}]}
    assert load_spec(text).data_fingerprint() == load_spec(dict(text)).data_fingerprint()
    assert "audio" not in load_spec(text).model_dump(mode="json")
    assert "audio_field" not in load_spec(text).sources[0].model_dump(mode="json")
    changed = load_spec(spec(audio={**AUDIO, "policy": "chunked"}))
    assert changed.data_fingerprint() != load_spec(spec()).data_fingerprint()  # fingerprinted as the images section is
