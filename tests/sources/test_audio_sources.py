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


def test_features_and_placeholders_equal_the_qwen2_audio_processor_on_the_same_waveform(run):
    from transformers import WhisperFeatureExtractor

    from media.test_audio_reference import AUDIO, qwen2_audio_processor

    extractor = WhisperFeatureExtractor(feature_size=80)
    processor = qwen2_audio_processor(80)
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
        expanded = processor(text=[f"hello {AUDIO}"] * len(windows), audio=windows, sampling_rate=16000,
                             return_tensors="np", padding=True)
        assert int((expanded["input_ids"] == processor.tokenizer.convert_tokens_to_ids(AUDIO)).sum()) == \
            mb.stats["audio_clip_tokens"][k]
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


def corrupt_flac() -> bytes:
    """A FLAC clip whose headers plan it but whose frames do not decode (bytes garbled a third of the way in)."""
    ext, data = clip(1)
    assert ext == "flac"
    body = bytearray(data)
    for i in range(len(body) // 3, len(body) // 3 + 400):
        body[i] = (body[i] * 7 + 13) & 0xFF
    return bytes(body)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_clip_that_fails_at_gather_is_named_or_its_sample_dropped(tmp_path, on_error):
    # token id 0 in the dropped text (NUL bytes): a real token, whose labels the dropped sample takes out too
    extra = {0: [("bad00001.flac", corrupt_flac()), ("bad00001.txt", b"a bad clip\x00\x00\x00")]}
    src = {**webdataset_audio(tmp_path, shards=1, per_shard=2, extra=extra), "on_error": on_error}
    if on_error == "raise":
        with pytest.raises(SourceError) as e:
            stream(audio_spec([src], dp=1, microbatches=1), 1)
        assert "speech-000000.tar" in str(e.value) and "bad00001.flac" in str(e.value) and "corrupt" in str(e.value)
        return
    steps, _, rt = stream(audio_spec([src], dp=1, microbatches=1), 1)
    (mb,) = steps[0]
    assert mb.stats["dropped_samples"] >= 1  # planned (its headers are fine), not delivered
    assert b"a bad clip" not in mb.input_ids.astype(np.uint8).tobytes()
    assert int((mb.labels != -100).sum()) + mb.stats["dropped_label_tokens"] == mb.stats["global_label_tokens"]
    assert int((mb.input_ids == AUDIO_TOKEN_ID).sum()) == sum(mb.stats["audio_clip_tokens"])
    assert rt.error_report()["wds_audio"]["bad_records"] >= 1


def test_the_audio_encoder_cost_follows_the_window_policy(sources):
    """qwen2audio charges every window as a padded 30 s one (1,500 encoder positions), chunked grows with
    the clip's duration: the step's encoder cost under chunked is smaller, both positive."""
    figures = {}
    for policy in ("qwen2audio", "chunked"):
        spec = audio_spec(sources, audio={"audio_token_id": AUDIO_TOKEN_ID, "policy": policy, "mel_bins": 80,
                                          "encoder": {"linear": 1.0, "quadratic": 0.01}})
        rt = LocalRuntime(plait.load_spec(spec))
        plan = rt.plan()
        figures[policy] = (plan.images["encoder_cost"], plan.items.audio_spans.copy(), plan.items.audio_tokens.copy())
        rt.close()
    (padded, padded_spans, padded_tokens), (chunked, chunked_spans, _) = figures["qwen2audio"], figures["chunked"]
    assert 0 < chunked < padded
    with_audio = padded_tokens > 0
    assert with_audio.any() and (padded_spans[with_audio] % 1500 == 0).all()
    assert (padded_spans[~with_audio] == 0).all()
    assert 0 < chunked_spans.sum() < padded_spans.sum()


def test_a_clip_longer_than_seq_len_allows_is_a_named_bad_record(tmp_path):
    """A document with audio is never cut: one whose placeholders exceed seq_len is refused, named."""
    src = webdataset_audio(tmp_path, shards=1, per_shard=6)  # sample 5: a 31.5 s clip, 787 tokens
    with pytest.raises(SourceError) as e:
        stream(audio_spec([src], dp=1, microbatches=1, seq_len=512), 1)
    assert "000000005" in str(e.value) or "00000005" in str(e.value)
    assert "more than seq_len 512" in str(e.value)


def test_audio_fields_cross_the_flight_wire_unchanged(run):
    """A thin trainer's micro-batch (Arrow Flight's one-row record batch) keeps the 3-D features, the mask,
    the per-clip arrays and the audio stats."""
    from plait.runtime.flight import decode_batch, encode_batch, step_schema

    mbs = run[0][0]
    schema = step_schema(None, mbs)
    for mb in mbs:
        back = decode_batch(*encode_batch(schema, mb))
        for name in ("input_ids", "labels", "input_features", "feature_attention_mask", "audio_windows", "audio_document"):
            np.testing.assert_array_equal(getattr(back, name), getattr(mb, name))
            assert getattr(back, name).dtype == getattr(mb, name).dtype
        assert back.stats["audio_clip_tokens"] == mb.stats["audio_clip_tokens"]


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_same_stream_on_ray(sources, ray_session):
    """Local and Ray give the same digest with audio (features included), decoded in the loader actors: a
    Ray worker computes features on one BLAS thread, a trainer on several, and the bits must not depend on it."""
    from plait.cli.stream import stream as run_stream
    from plait.metrics import combined_digest

    spec = plait.load_spec(audio_spec(sources[:2])).with_overrides(steps=2)
    local = run_stream(spec, steps=2, runtime="local", progress=False)
    remote = run_stream(spec, steps=2, runtime="ray", progress=False, runtime_options={"loaders": 2})
    assert combined_digest(remote["digests"]) == combined_digest(local["digests"])
    assert remote["audio_clips"] == local["audio_clips"] > 0
