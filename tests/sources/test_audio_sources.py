"""Audio sources end to end: WebDataset members, a LLaVA-style JSONL manifest with `<audio>` markers and a
Parquet column of Hugging Face audio structs, in several containers, rates and channel counts. Planning
reads headers only (0 decodes), each delivered clip is decoded once, placeholder runs and
`global_label_tokens` are exact, the batch's features and masks equal transformers' Qwen2-Audio processor
on the same waveform, bad clips are named under raise and their samples skipped and counted under skip,
and a resumed run continues the stream exactly."""

from __future__ import annotations

import hashlib
import io
import tarfile

import numpy as np
import pytest
from audio_data import AUDIO_TOKEN_ID, audio_spec, clip, llava_audio, parquet_audio, webdataset_audio

import plait
from plait.errors import SourceError
from plait.media.audio import AUDIO_DECODES, FRAME_DECODES, decode
from plait.media.audio_features import WINDOW_SAMPLES
from plait.metrics import batch_digest_update
from plait.runtime.local import LocalRuntime

pytest.importorskip("av")
TOLERANCE = 1e-4
PER_SHARD = 4


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    base = tmp_path_factory.mktemp("audio")
    return [webdataset_audio(base / "w", per_shard=PER_SHARD), llava_audio(base / "l"), parquet_audio(base / "p")]


def clip_bytes(source: int, shard: int, row: int) -> list[bytes]:
    """The clips of a sample, in order, as audio_data wrote them (source 0: webdataset, 1: jsonl, 2: parquet)."""
    if source == 0:
        return [clip(shard * PER_SHARD + row)[1]]
    if source == 1:
        return [clip(10 + 2 * row + j)[1] for j in range(1 + row % 2)]
    return [clip(20 + row)[1]]


def stream(spec_dict, steps: int, state: dict | None = None, *, count_planning: list | None = None):
    rt = LocalRuntime(plait.load_spec(spec_dict))
    if state is not None:
        rt.load_state_dict(state)
    out, states = [], []
    for _ in range(steps):
        before = (AUDIO_DECODES.count, FRAME_DECODES.count)
        plan = rt.plan()
        if count_planning is not None:
            count_planning.append((AUDIO_DECODES.count - before[0], FRAME_DECODES.count - before[1]))
        out.append([mb for r in range(plan.ranks) for mb in rt.build(plan, r)])
        states.append(rt.state_dict())
        rt.release()
    return out, states, rt


def digest(steps) -> str:
    h = hashlib.sha256()
    for mbs in steps:
        for mb in mbs:
            batch_digest_update(h, mb)
    return h.hexdigest()


@pytest.fixture(scope="module")
def run(sources):
    planning = []
    before = AUDIO_DECODES.count
    steps, states, _ = stream(audio_spec(sources), 2, count_planning=planning)
    return steps, states, planning, AUDIO_DECODES.count - before


def test_planning_decodes_nothing_and_each_delivered_clip_decodes_once(run):
    steps, _, planning, decodes = run
    assert planning == [(0, 0)] * len(steps)
    delivered = sum(mb.stats["audio_clips"] for mbs in steps for mb in mbs)
    assert delivered > 0 and decodes == delivered


def test_placeholder_runs_labels_and_global_label_tokens_are_exact(run):
    for mbs in run[0]:
        for mb in mbs:
            assert int((mb.input_ids == AUDIO_TOKEN_ID).sum()) == sum(mb.stats["audio_clip_tokens"])
            assert not np.isin(mb.labels, [AUDIO_TOKEN_ID]).any()
            assert int(mb.audio_windows.sum()) == len(mb.input_features) == len(mb.feature_attention_mask)
            assert mb.stats["audio_clip_windows"] == mb.audio_windows.tolist()
        labels = sum(int((mb.labels != -100).sum()) + mb.stats["dropped_label_tokens"] for mb in mbs)
        assert labels == mbs[0].stats["global_label_tokens"]


def test_features_equal_the_qwen2_audio_processor_on_the_same_waveform(run):
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=80)
    mb = next(mb for mbs in run[0] for mb in mbs if mb.stats["audio_clips"] >= 2)
    rows = np.concatenate([[0], np.cumsum(mb.audio_windows)])
    checked = set()
    for k, doc in enumerate(mb.audio_document):
        source, _, shard, row, _ = mb.sample_ids[doc]
        clips = clip_bytes(int(source), int(shard), int(row))
        nth = int(np.sum(mb.audio_document[:k] == doc))  # the document's nth clip
        wave = decode(clips[nth])
        windows = [wave[i:i + WINDOW_SAMPLES] for i in range(0, len(wave), WINDOW_SAMPLES)]
        ref = extractor(windows, sampling_rate=16000, padding="max_length", return_attention_mask=True,
                        return_tensors="np")
        ours = slice(rows[k], rows[k + 1])
        assert np.abs(mb.input_features[ours] - ref["input_features"]).max() <= TOLERANCE
        np.testing.assert_array_equal(mb.feature_attention_mask[ours], ref["attention_mask"])
        checked.add(int(source))
    assert len(checked) >= 2
    torch_batch = mb.to_torch(layout="qwen2audio")
    assert str(torch_batch["input_features"].dtype) == "torch.float32"
    np.testing.assert_array_equal(torch_batch["feature_attention_mask"].numpy(), mb.feature_attention_mask)


def test_several_containers_rates_and_channels_reach_the_batch(run):
    seconds = {round(s, 1) for mbs in run[0] for mb in mbs for s in mb.stats["audio_clip_seconds"]}
    assert {1.3, 2.1, 1.7, 0.9, 1.1, 31.5} <= seconds  # wav 16k mono, flac 22k stereo, mp3, ogg, m4a, 2 windows
    windows = {w for mbs in run[0] for mb in mbs for w in mb.audio_windows.tolist()}
    assert windows == {1, 2}


def test_a_resumed_run_continues_the_stream_exactly(sources, run):
    steps, states, _, _ = run
    resumed, _, _ = stream(audio_spec(sources), 1, states[0])
    assert digest(resumed) == digest(steps[1:])


def truncated_wav() -> bytes:
    data = clip(0)[1]
    assert data[:4] == b"RIFF"
    return data[: len(data) // 2]


BAD = {"truncated": truncated_wav, "empty": lambda: b"", "unsupported": lambda: b"not audio at all " * 40}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_clip_is_named_under_raise(tmp_path, case):
    src = webdataset_audio(tmp_path, shards=1, per_shard=2, extra={0: [("bad00001.wav", BAD[case]()),
                                                                        ("bad00001.txt", b"a bad clip")]})
    with pytest.raises(SourceError) as e:
        stream(audio_spec([src], dp=1), 1)
    message = str(e.value)
    assert "wds_audio" in message and "speech-000000.tar" in message and "bad00001" in message
    assert "bad00001.wav" in message


def test_a_bad_clip_skips_its_whole_sample_and_is_counted(tmp_path):
    extra = {0: [("bad00001.wav", truncated_wav()), ("bad00001.txt", b"a bad clip")]}
    src = {**webdataset_audio(tmp_path, shards=1, per_shard=2, extra=extra), "on_error": "skip"}
    steps, _, rt = stream(audio_spec([src], dp=1), 1)
    rows = {int(r) for mbs in steps for mb in mbs for r in mb.sample_ids[:, 3]}
    assert rows <= {0, 1} and rt.error_report()["wds_audio"]["bad_records"] >= 1
    for mb in steps[0]:
        assert b"a bad clip" not in mb.input_ids.astype(np.uint8).tobytes()
        assert (mb.input_features.max(axis=(1, 2)) > -0.5).all()  # no window of silence (silence: -0.5)
