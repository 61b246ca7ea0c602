"""Audio: header-only probes for the Planner, one decode at gather, window policies, token counts, encoder cost.

Planning calls `probe`: PyAV opens the container and reads its headers (duration, sample rate, channels,
codec); no packet is decoded (`FRAME_DECODES` counts every frame a decoder here produced, `AUDIO_DECODES`
every decode pass, so a test can assert planning adds none). WAV, FLAC, MP3, Ogg (Opus, Vorbis) and
M4A/AAC, from a path, bytes or a seekable file-like (an fsspec file). Raw AAC (ADTS, .aac) is refused
with a clear error: its demuxer only guesses the duration from the bitrate (off by 2-3% in practice), and
planning needs it exact.

The clip's length at 16 kHz is taken from the headers, `round(duration * 16000)` samples, and that count
is the truth both sides use: planning derives windows and tokens from it, and `decode` fits the waveform
to it. The decoders disagree with the headers by a few milliseconds in ordinary files (AAC's last frame is
padded to 1,024 samples; an Opus stream may end a few ms before its last granule), so the waveform is cut
or zero-filled to the planned count when the difference is within SLACK; a larger one is a truncated or
mislabelled file and a MediaError, never silence passed off as audio.

Decode (`decode`): every frame of the first audio stream, resampled to 16 kHz float32 by PyAV's
AudioResampler (libswresample) in the source's channel layout, then down-mixed to mono as the mean of the
channels (librosa, torchcodec and Whisper's 16-bit ffmpeg path all average; libswresample's own float
down-mix would weight each side by 1/sqrt(2) and could leave [-1, 1]).

Window policies (`AudioPolicy`), both as the Hugging Face processors count:

- `qwen2audio` (Qwen2-Audio): the clip is cut into 30 s windows; each is padded to 480,000 samples, so
  its features are [bins, 3000] with `feature_attention_mask` marking the L = ceil(samples / 160) frames
  (at most 3,000) that hold audio, and its placeholder count is the processor's
  (((L - 1) // 2 + 1) - 2) // 2 + 1 (750 for a full window: 25 tokens/s). The encoder (Whisper's) runs on
  the padded window: 1,500 positions after its stride-2 convolution, however short the clip.
- `chunked` (Qwen2.5-Omni): the same features, windows, mask and token formula (its processor pads to
  30 s too and counts tokens from the mask), but the encoder splits each window's L frames into chunks of
  `chunk_seconds` (2 s = 200 frames, `n_window * 2`) and attends inside each chunk: spans of
  (c - 1) // 2 + 1 positions for a chunk of c frames, so its cost grows with the clip's duration.

Encoder cost (`encoder_cost`): the sum over the plan's attention spans S of linear * S + quadratic * S^2,
the same shape as the vision encoder's per-image cost (plait.cost.EncoderCost's coefficients fit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np

from plait.audio_batch import audio_fields
from plait.cost import EncoderCost
from plait.errors import PlaitError
from plait.media.audio_features import HOP, SAMPLE_RATE, WINDOW_FRAMES, WINDOW_SAMPLES, log_mel
from plait.media.base import DecodeCounter, MediaData, MediaError, describe, ffmpeg_reason, open_container, peek

__all__ = ["AUDIO_DECODES", "AUDIO_EXTENSIONS", "FRAME_DECODES", "MEDIUM", "POLICIES", "AudioFeatures", "AudioInfo", "AudioRef",
           "AudioPlan", "AudioPolicy", "PlannedClip", "decode", "encoder_cost", "probe", "tokens_for_frames"]

AUDIO_EXTENSIONS = ("wav", "flac", "mp3", "ogg", "opus", "oga", "m4a")
POLICIES = ("qwen2audio", "chunked")
AUDIO_DECODES = DecodeCounter()  # decode passes (one per delivered clip)
FRAME_DECODES = DecodeCounter()  # frames produced by a decoder (planning must add none)
SLACK_SECONDS = 0.05  # decoded vs header length: any codec's priming or end padding, or a short last page
SLACK_SOURCE_SAMPLES = 2048  # ...or two AAC frames at the source rate, larger at 8 kHz
FRAMES_PER_SECOND = SAMPLE_RATE // HOP  # feature frames: 100 per second
DURATION_BY_BITRATE = {"aac": "raw AAC (ADTS)"}  # demuxers whose duration is always an estimate
OGG_MAX_PAGE = 27 + 255 + 255 * 255  # header, lacing values, payload
OGG_END_OF_STREAM = 0x04  # header_type flag of a stream's last page


@dataclass(frozen=True)
class AudioInfo:
    """What the headers say of a clip: seconds, the source's rate and channels, codec and container."""

    duration: float
    sample_rate: int
    channels: int
    codec: str
    container: str

    @property
    def samples(self) -> int:
        """The clip's length at 16 kHz: what planning counts and `decode` delivers."""
        return round(self.duration * SAMPLE_RATE)


def probe(data: MediaData, name: str | None = None) -> AudioInfo:
    """The clip's AudioInfo from its container and stream headers; decodes nothing."""
    name = describe(data, name)
    _check_framing(data, name)  # first: PyAV leaves a file-like wherever it stopped reading
    with open_container(data, name) as container:
        return _header_info(container, name)


def _header_info(container, name: str) -> AudioInfo:
    if not container.streams.audio:
        kinds = sorted({s.type for s in container.streams}) or ["none"]
        raise MediaError(name, f"no audio stream (unsupported: {container.format.name} with {', '.join(kinds)})")
    if container.format.name in DURATION_BY_BITRATE:
        raise MediaError(name, f"{DURATION_BY_BITRATE[container.format.name]} has no duration in its headers, only a "
                               "guess from its bitrate, and planning needs the exact length: store it in .m4a")
    stream = container.streams.audio[0]
    ctx = stream.codec_context
    if ctx is None or ctx.codec is None:
        raise MediaError(name, f"unsupported audio codec in {container.format.name}")
    if stream.duration and stream.time_base:
        duration = float(stream.duration * stream.time_base)
    elif container.duration:
        duration = container.duration / 1_000_000  # AV_TIME_BASE: microseconds
    else:
        raise MediaError(name, f"no duration in the headers ({container.format.name}, {ctx.name})")
    if not ctx.sample_rate or not ctx.channels:
        raise MediaError(name, f"headers give no sample rate or channel count ({ctx.name})")
    if duration <= 0:
        raise MediaError(name, f"no audio: the headers give a duration of {duration:g} s")
    return AudioInfo(duration, int(ctx.sample_rate), int(ctx.channels), ctx.name, container.format.name)


def _check_framing(data: MediaData, name: str) -> None:
    """Truncation the headers hide. A WAV cut short declares more bytes (its RIFF size) than the file
    holds, yet the demuxer reports the shorter length; an Ogg stream cut short ends in a partial page or
    without the end-of-stream page its muxer writes last, yet its duration comes from the last granule
    found. Both would pass as shorter clips; other containers' truncation shows in `decode`'s length check
    (FLAC's STREAMINFO, MP3's Xing frame count, MP4's sample table hold the true length)."""
    found = peek(data, 0, 12)
    if found is None:
        return
    head, size = found
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        declared = int.from_bytes(head[4:8], "little") + 8
        if 8 < declared < 0xFFFFFFFF and declared > size + 1:  # 0 / 0xFFFFFFFF: written while streaming
            raise MediaError(name, f"truncated: the WAV header declares {declared} bytes, the file holds {size}")
    elif head[:4] == b"OggS":
        tail = peek(data, -OGG_MAX_PAGE, OGG_MAX_PAGE)[0]
        last = tail.rfind(b"OggS")
        segments = tail[last + 26] if 0 <= last and last + 27 <= len(tail) else None
        complete = segments is not None and last + 27 + segments <= len(tail) and (
            last + 27 + segments + sum(tail[last + 27: last + 27 + segments]) == len(tail))
        if not complete or not tail[last + 5] & OGG_END_OF_STREAM:
            raise MediaError(name, "truncated: the Ogg stream does not end with a complete end-of-stream page")


def decode(data: MediaData, info: AudioInfo | None = None, name: str | None = None) -> np.ndarray:
    """The clip as mono 16 kHz float32, `info.samples` long (the planned length; without `info`, the
    headers' own). One decode pass; a corrupt or truncated clip is a MediaError naming it."""
    import av

    name = describe(data, name)
    _check_framing(data, name)
    with open_container(data, name) as container:
        header = _header_info(container, name)
        stream = container.streams.audio[0]
        AUDIO_DECODES.add()
        resampler = av.AudioResampler(format="fltp", rate=SAMPLE_RATE)
        pieces: list[np.ndarray] = []
        seconds = 0.0
        try:
            for frame in container.decode(stream):
                FRAME_DECODES.add()
                seconds = float(frame.time or seconds)
                pieces.extend(out.to_ndarray() for out in resampler.resample(frame))
            pieces.extend(out.to_ndarray() for out in resampler.resample(None))
        except (av.error.FFmpegError, ValueError) as e:
            raise MediaError(name, f"corrupt audio near {seconds:.2f} s ({ffmpeg_reason(e)})") from None
    if not pieces:
        raise MediaError(name, "no audio could be decoded (corrupt or truncated)")
    mono = np.concatenate(pieces, axis=1).mean(axis=0, dtype=np.float32)
    return _fit(mono, (info or header).samples, header.sample_rate, name)


def _fit(waveform: np.ndarray, samples: int, source_rate: int, name: str) -> np.ndarray:
    """`waveform` cut or zero-filled to `samples`, when it differs from that by no more than the slack."""
    slack = max(SLACK_SECONDS * SAMPLE_RATE, SLACK_SOURCE_SAMPLES * SAMPLE_RATE / source_rate)
    got = len(waveform)
    if abs(got - samples) > slack:
        what = "truncated or corrupt" if got < samples else "longer than its headers say"
        raise MediaError(name, f"{what}: decoded {got / SAMPLE_RATE:.3f} s, headers give {samples / SAMPLE_RATE:.3f} s"
                               " (an MP3 without a Xing header has only an estimate there)")
    if got >= samples:
        return waveform[:samples]
    return np.concatenate([waveform, np.zeros(samples - got, dtype=np.float32)])


def tokens_for_frames(frames):
    """The Qwen2-Audio / Qwen2.5-Omni processors' placeholder count for L feature frames (the encoder's
    stride-2 convolution, then its stride-2 pooling). Works on ints and integer arrays."""
    after_conv = (frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


@dataclass(frozen=True)
class AudioPlan:
    """What one clip becomes: per 30 s window its samples, its feature frames (the attention mask's
    ones) and its placeholder tokens; `spans`: the encoder's attention spans (positions) for the clip."""

    samples: int
    window_samples: tuple[int, ...]
    frames: tuple[int, ...]
    window_tokens: tuple[int, ...]
    spans: tuple[int, ...]

    @property
    def windows(self) -> int:
        return len(self.window_samples)

    @property
    def tokens(self) -> int:
        return sum(self.window_tokens)

    @property
    def seconds(self) -> float:
        return self.samples / SAMPLE_RATE


class AudioFeatures(NamedTuple):
    """A clip's model inputs as the Hugging Face Qwen2-Audio processor returns them, one row per window:
    `input_features` [windows, bins, 3000] float32, `feature_attention_mask` [windows, 3000] int32."""

    input_features: np.ndarray
    feature_attention_mask: np.ndarray
    plan: AudioPlan


@dataclass(frozen=True)
class AudioRef:
    """One clip of a record: inline bytes, or what the reader resolves (a member name, a path); once
    planned, its header info and plan."""

    kind: ClassVar[str] = "audio"  # media.registry.kind_of
    ref: bytes | str
    info: AudioInfo | None = None
    plan: AudioPlan | None = None


@dataclass(frozen=True)
class AudioPolicy:
    """How clips become windows, tokens and encoder work: `kind` one of POLICIES, `mel_bins` 80 or 128
    (Qwen2-Audio and Qwen2.5-Omni use 128), `chunk_seconds` the encoder's chunk under `chunked`."""

    kind: str = "qwen2audio"
    mel_bins: int = 128
    chunk_seconds: float = 2.0

    def __post_init__(self):
        if self.kind not in POLICIES:
            raise PlaitError(f"audio policy {self.kind!r} is not one of {', '.join(POLICIES)}")
        if self.mel_bins < 1:
            raise PlaitError(f"audio mel_bins must be positive, got {self.mel_bins}")
        chunk = self.chunk_seconds * FRAMES_PER_SECOND
        if chunk < 0.5 or abs(chunk - round(chunk)) > 1e-6:
            raise PlaitError(f"audio chunk_seconds must be a positive multiple of 0.01 s, got {self.chunk_seconds}")

    def plan(self, clip: AudioInfo | int) -> AudioPlan:
        """The plan of a clip (its AudioInfo, or its length in 16 kHz samples). A clip of 20 ms or less
        gives no token and is a PlaitError (it would reach the model as nothing); a last window that short
        is left out, its samples with it (`samples` then counts what the windows hold)."""
        samples = clip.samples if isinstance(clip, AudioInfo) else int(clip)
        full, rest = divmod(samples, WINDOW_SAMPLES)
        window_samples = np.array([WINDOW_SAMPLES] * full + ([rest] if rest or not full else []), dtype=np.int64)
        frames = -(-window_samples // HOP)  # ceil: the mask marks every hop that starts inside the clip
        tokens = tokens_for_frames(frames)
        if tokens.sum() < 1:
            raise PlaitError(f"audio clip of {samples / SAMPLE_RATE:.3f} s is too short to give one token")
        if tokens[-1] < 1:
            window_samples, frames, tokens = window_samples[:-1], frames[:-1], tokens[:-1]
        return AudioPlan(int(window_samples.sum()), tuple(window_samples.tolist()), tuple(frames.tolist()),
                         tuple(tokens.tolist()), tuple(self._spans(frames).tolist()))

    def _spans(self, frames: np.ndarray) -> np.ndarray:
        if self.kind == "qwen2audio":  # the whole padded window, 3,000 frames after a stride-2 conv
            return np.full(len(frames), (WINDOW_FRAMES - 1) // 2 + 1, dtype=np.int64)
        chunk = int(round(self.chunk_seconds * FRAMES_PER_SECOND))
        counts = -(-frames // chunk)
        chunk_frames = np.full(int(counts.sum()), chunk, dtype=np.int64)
        last = np.cumsum(counts) - 1
        chunk_frames[last] = frames - (counts - 1) * chunk
        return (chunk_frames - 1) // 2 + 1

    def features(self, waveform: np.ndarray) -> AudioFeatures:
        """The clip's windows, zero-padded to 30 s, through the Whisper log-mel, with the attention mask."""
        plan = self.plan(len(waveform))
        waveform = np.asarray(waveform[: plan.samples], dtype=np.float32)
        windows = np.zeros((plan.windows, WINDOW_SAMPLES), dtype=np.float32)
        windows.reshape(-1)[: len(waveform)] = waveform
        mask = (np.arange(WINDOW_FRAMES)[None, :] < np.array(plan.frames)[:, None]).astype(np.int32)
        return AudioFeatures(log_mel(windows, np.array(plan.window_samples), self.mel_bins), mask, plan)

    def load(self, data: MediaData, info: AudioInfo | None = None, name: str | None = None) -> AudioFeatures:
        """Gather: decode once (fitted to the planned length) and compute the features."""
        return self.features(decode(data, info, name))


def encoder_cost(plan: AudioPlan, linear: float, quadratic: float) -> float:
    """The audio encoder's cost for one clip: linear * S + quadratic * S^2 summed over its attention spans
    S (plait.cost.EncoderCost.of_units). Under qwen2audio every window costs a full 30 s one; under chunked
    it grows with the duration."""
    spans = np.asarray(plan.spans, dtype=np.float64)
    return float(EncoderCost(linear, quadratic).of_units(spans.sum(), (spans * spans).sum()))


class PlannedClip(NamedTuple):
    """What planning keeps of a clip for its decode: the headers' info (the length it is fitted to) and
    its plan."""

    info: AudioInfo
    plan: AudioPlan


class AudioMedium:
    """The audio medium (plait.media.registry.Medium): headers -> PlannedClip, decode -> AudioFeatures."""

    def policy(self, spec) -> AudioPolicy | None:
        a = spec.audio
        return None if a is None else AudioPolicy(kind=a.policy, mel_bins=a.mel_bins, chunk_seconds=a.chunk_seconds)

    def probe(self, data: MediaData, name: str | None = None) -> AudioInfo:
        return probe(data, name)

    def plan(self, policy: AudioPolicy, info: AudioInfo, window: int = 0) -> PlannedClip:
        return PlannedClip(info, policy.plan(info))

    def decode(self, data: MediaData, planned: PlannedClip, policy: AudioPolicy, name: str | None = None,
               out=None) -> AudioFeatures:
        return policy.load(data, planned.info, name)

    def placeholder_tokens(self, planned: PlannedClip) -> int:
        return planned.plan.tokens

    def encoder_units(self, planned: PlannedClip) -> tuple[int, int]:
        spans = [int(s) for s in planned.plan.spans]
        return sum(spans), sum(s * s for s in spans)

    def batch_fields(self, payload, a: int, b: int) -> dict:
        return audio_fields(payload, a, b)

    reference = AudioRef  # a record's audio: plait.media.registry.Medium.reference


MEDIUM = AudioMedium()
