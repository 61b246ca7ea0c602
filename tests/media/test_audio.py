"""The audio medium: header probes that decode nothing, one decode per clip fitted to the planned length,
window policies and their token counts and encoder cost, and named errors for bad files."""

from __future__ import annotations

import io

import numpy as np
import pytest

av = pytest.importorskip("av")

from plait.errors import PlaitError  # noqa: E402
from plait.media import audio  # noqa: E402
from plait.media.audio import AudioPolicy, decode, encoder_cost, probe, tokens_for_frames  # noqa: E402
from plait.media.audio_features import WINDOW_SAMPLES  # noqa: E402
from plait.media.audio_synth import CONTAINERS, encode, speech_like  # noqa: E402
from plait.media.base import MediaError  # noqa: E402

SECONDS = 1.3


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    """One short stereo clip per container (Opus only takes 48 kHz among the common rates)."""
    return {ext: encode(speech_like(48000 if ext == "ogg" else 22050, SECONDS, 2, seed=i),
                        48000 if ext == "ogg" else 22050, ext) for i, ext in enumerate(CONTAINERS)}


def counters() -> tuple[int, int]:
    return audio.AUDIO_DECODES.count, audio.FRAME_DECODES.count


@pytest.mark.parametrize("ext", list(CONTAINERS))
def test_probe_reads_headers_only_and_decode_runs_once(clips, ext):
    before = counters()
    info = probe(clips[ext], name=f"clip.{ext}")
    plan = AudioPolicy().plan(info)
    assert counters() == before  # planning decoded nothing
    assert info.channels == 2 and info.sample_rate == (48000 if ext == "ogg" else 22050)
    assert abs(info.duration - SECONDS) < 0.01
    wave = decode(clips[ext], info, name=f"clip.{ext}")
    passes, frames = counters()
    assert passes == before[0] + 1 and frames > before[1]
    assert wave.dtype == np.float32 and wave.shape == (info.samples,) == (plan.samples,)
    assert 0.1 < np.abs(wave).max() < 1.0


def test_inputs_by_path_file_like_and_fsspec(clips, tmp_path):
    fsspec = pytest.importorskip("fsspec")
    path = tmp_path / "a.flac"
    path.write_bytes(clips["flac"])
    expected = decode(clips["flac"])
    assert probe(str(path)) == probe(path) == probe(clips["flac"])
    handle = io.BytesIO(clips["flac"])
    assert probe(handle) == probe(clips["flac"]) and handle.tell() == 0  # a probe leaves it where it was
    np.testing.assert_array_equal(decode(handle), expected)
    with fsspec.open(f"file://{path}", "rb") as f:
        np.testing.assert_array_equal(decode(f, probe(f)), expected)
    cut = io.BytesIO(b"prefix" + clips["wav"][: len(clips["wav"]) // 4 * 2])
    cut.seek(6)  # a file-like is read from where it stands: the framing checks too
    with pytest.raises(MediaError, match="truncated: the WAV header"):
        probe(cut, "cut.wav")
    ogg = io.BytesIO(clips["ogg"][:-100])
    with pytest.raises(MediaError, match="truncated: the Ogg stream"):
        decode(ogg, name="cut.ogg")


def test_down_mix_is_the_mean_of_the_channels():
    left = speech_like(16000, 0.5, 1, seed=3)[0]
    stereo = np.stack([left, np.zeros_like(left)])  # 16 kHz: no resampling, only the down-mix
    wave = decode(encode(stereo, 16000, "wav"))
    np.testing.assert_allclose(wave, np.round(left * 32767) / 32768 / 2, atol=1e-7)  # s16 reads as n / 32768
    six = np.zeros((6, len(left)), dtype=np.float32)
    six[3] = left  # 5.1's LFE alone: a mean of six channels, never libswresample's own down-mix weights
    wave = decode(encode(six, 16000, "flac"))
    assert probe(encode(six, 16000, "flac")).channels == 6
    np.testing.assert_allclose(wave, np.round(left * 32767) / 32768 / 6, atol=1e-7)
    with pytest.raises(ValueError, match="6 channels as .mp3"):
        encode(six, 16000, "mp3")


def test_decoded_length_is_fitted_to_the_planned_one(clips):
    # AAC pads its last frame and this Opus stream's last granule runs past its audio: the decoders
    # return a few ms more or less than the headers give; the clip delivered has the planned length
    for ext in ("m4a", "ogg"):
        info = probe(clips[ext])
        assert decode(clips[ext], info).shape == (info.samples,)


def test_qwen2audio_windows_tokens_and_padded_encoder_cost():
    policy = AudioPolicy("qwen2audio")
    long = policy.plan(65 * 16000 + 123)  # 65 s: two full windows and a 5 s rest
    assert long.window_samples == (WINDOW_SAMPLES, WINDOW_SAMPLES, 5 * 16000 + 123)
    assert long.frames == (3000, 3000, 501)
    assert long.window_tokens == (750, 750, 125) and long.tokens == 1625  # 501 frames -> 251 -> 125
    assert long.spans == (1500, 1500, 1500)  # every window is padded to 30 s for the encoder
    short, full = policy.plan(3 * 16000), policy.plan(30 * 16000)
    assert short.tokens == 75 and full.tokens == 750
    assert encoder_cost(short, 2.0, 0.5) == encoder_cost(full, 2.0, 0.5) == 2.0 * 1500 + 0.5 * 1500**2
    assert encoder_cost(long, 2.0, 0.5) == 3 * encoder_cost(full, 2.0, 0.5)


def test_chunked_encoder_cost_grows_with_duration():
    policy = AudioPolicy("chunked", chunk_seconds=2.0)
    plan = policy.plan(5 * 16000)  # 500 frames: chunks of 200, 200, 100 frames
    assert plan.frames == (500,) and plan.spans == (100, 100, 50) and plan.tokens == 125
    costs = [encoder_cost(policy.plan(s * 16000), 1.0, 0.0) for s in (2, 4, 8, 16)]
    assert costs == [100, 200, 400, 800]
    two_windows = policy.plan(40 * 16000)  # windows of 30 s and 10 s: the last chunk of each may be short
    assert two_windows.frames == (3000, 1000) and len(two_windows.spans) == 15 + 5


def test_token_formula_matches_25_tokens_per_second():
    frames = np.arange(3, 3001)
    tokens = tokens_for_frames(frames)
    assert tokens[0] == 1 and tokens[-1] == 750 and np.all(np.diff(tokens) >= 0)
    assert np.all(np.abs(tokens - frames / 4) <= 1)


def test_features_layout_per_window():
    policy = AudioPolicy("qwen2audio", mel_bins=80)
    wave = np.tile(speech_like(16000, 1.0, 1, seed=5)[0], 31)
    out = policy.features(wave)
    assert out.input_features.shape == (2, 80, 3000) and out.input_features.dtype == np.float32
    assert out.feature_attention_mask.dtype == np.int32
    assert out.feature_attention_mask.sum(axis=1).tolist() == [3000, 100] == list(out.plan.frames)


def test_policy_and_clip_mistakes_are_plait_errors():
    with pytest.raises(PlaitError, match="not one of qwen2audio, chunked"):
        AudioPolicy("whisper")
    with pytest.raises(PlaitError, match="chunk_seconds"):
        AudioPolicy("chunked", chunk_seconds=0.001)
    with pytest.raises(PlaitError, match="too short to give one token"):
        AudioPolicy().plan(320)  # 20 ms: 2 frames, no token
    assert AudioPolicy().plan(321).tokens == 1
    assert AudioPolicy("chunked", chunk_seconds=0.3).plan(16000).spans == (15, 15, 15, 5)


def test_a_last_window_too_short_for_a_token_is_left_out():
    policy = AudioPolicy("qwen2audio", mel_bins=80)
    plan = policy.plan(WINDOW_SAMPLES + 300)
    assert plan.windows == 1 and plan.samples == WINDOW_SAMPLES and plan.tokens == 750
    out = policy.features(np.ones(WINDOW_SAMPLES + 300, dtype=np.float32) * 0.1)
    assert out.input_features.shape == (1, 80, 3000) and out.plan == plan


def video_only() -> bytes:
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=10)
        s.width, s.height, s.pix_fmt = 32, 32, "yuv420p"
        for _ in range(3):
            for p in s.encode(av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return out.getvalue()


def raw_aac() -> bytes:
    """One second of AAC in a bare ADTS stream (no container: no duration anywhere but the bitrate)."""
    out = io.BytesIO()
    with av.open(out, "w", format="adts") as c:
        s = c.add_stream("aac", rate=16000, layout="mono")
        wave = speech_like(16000, 1.0, 1)[0]
        for start in range(0, len(wave), 1024):
            frame = av.AudioFrame.from_ndarray(wave[None, start:start + 1024], format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 16000, start
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return out.getvalue()


def damaged(data: bytes, seed: int) -> bytes:
    """`data` with 40 runs of random bytes written over its second half (its headers intact)."""
    rng = np.random.default_rng(seed)
    out = bytearray(data)
    for at in rng.integers(len(data) // 3, len(data) - 64, 40):
        out[at:at + 48] = rng.bytes(48)
    return bytes(out)


@pytest.mark.parametrize("case,pattern", [
    ("empty", r"^empty\.wav: empty file \(0 bytes\)$"),
    ("random bytes", r"^noise\.mp3: not a readable media file"),
    ("video only", r"^clip\.mp4: no audio stream"),
    ("raw aac", r"^clip\.aac: raw AAC \(ADTS\) has no duration in its headers"),
    ("wav cut", r"^cut\.wav: truncated: the WAV header declares"),
    ("ogg cut", r"^cut\.ogg: truncated: the Ogg stream does not end"),
    ("mp3 cut", r"^cut\.mp3: truncated or corrupt: decoded"),
    ("flac cut", r"^cut\.flac: corrupt audio near"),
    ("m4a cut", r"^cut\.m4a: not a readable media file"),
    ("flac damaged", r"^bad\.flac: corrupt audio near"),
    ("mp3 damaged", r"^bad\.mp3: corrupt audio near"),
])
def test_bad_files_are_named_never_silence(clips, case, pattern):
    half = {ext: clips[ext][: len(clips[ext]) // 2 // 2 * 2] for ext in clips}  # even: whole WAV samples
    data, name = {
        "empty": (b"", "empty.wav"), "random bytes": (np.random.default_rng(0).bytes(4000), "noise.mp3"),
        "video only": (video_only(), "clip.mp4"), "raw aac": (raw_aac(), "clip.aac"), "wav cut": (half["wav"], "cut.wav"),
        "ogg cut": (half["ogg"], "cut.ogg"), "mp3 cut": (half["mp3"], "cut.mp3"), "flac cut": (half["flac"], "cut.flac"),
        "m4a cut": (half["m4a"], "cut.m4a"), "flac damaged": (damaged(clips["flac"], 1), "bad.flac"),
        "mp3 damaged": (damaged(clips["mp3"], 2), "bad.mp3"),
    }[case]
    with pytest.raises(MediaError, match=pattern) as caught:
        probe(data, name)
        decode(data, name=name)
    assert isinstance(caught.value, PlaitError) and "\n" not in str(caught.value)


def test_an_empty_or_missing_path_is_named(tmp_path):
    empty = tmp_path / "silence.flac"
    empty.write_bytes(b"")
    with pytest.raises(MediaError, match=f"^{empty}: empty file \\(0 bytes\\)$"):
        probe(empty)
    with pytest.raises(MediaError, match="missing.wav: cannot read"):
        decode(str(tmp_path / "missing.wav"))


def test_float32_features_are_close_to_the_exact_ones():
    # the float32 path rounds less than 1e-5 away from the float64 one on a lossy clip (codec holes put
    # bins near the clamp, where rounding shows most): well inside the 1e-4 the extractor is held to
    from plait.media.audio_features import log_mel

    data = encode(speech_like(44100, 3.0, 2, seed=7), 44100, "mp3")
    wave = decode(data)
    ours = AudioPolicy(mel_bins=128).features(wave)
    windows = np.zeros((1, WINDOW_SAMPLES))
    windows[0, : len(wave)] = wave
    exact = log_mel(windows, np.array([len(wave)]), 128, dtype=np.float64)
    assert ours.input_features.dtype == np.float32
    assert np.abs(ours.input_features - exact).max() < 1e-5
