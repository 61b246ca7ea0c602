"""Generated speech-like clips, encoded by PyAV in every container the audio module reads.

For tests, benchmarks and demos that need audio with speech's traits but no recordings: a voiced source
(a fundamental gliding 90-240 Hz, with harmonics falling off as 1/k), syllable-rate loudness (3-5 Hz),
a chirp sweeping the band and broadband noise, per channel with its own gain and noise. Deterministic
in its seed.
"""

from __future__ import annotations

import io

import numpy as np

__all__ = ["CONTAINERS", "LAYOUTS", "OPUS_RATES", "STEREO_ONLY", "encode", "speech_like"]

# extension -> (PyAV muxer, encoder, sample format); each the usual choice for that extension
CONTAINERS = {"wav": ("wav", "pcm_s16le", "s16"), "flac": ("flac", "flac", "s16"),
              "mp3": ("mp3", "libmp3lame", "fltp"), "ogg": ("ogg", "libopus", "flt"),
              "m4a": ("ipod", "aac", "fltp")}
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)  # the only input rates libopus takes
LAYOUTS = {1: "mono", 2: "stereo", 6: "5.1"}  # channel counts the generated clips use
STEREO_ONLY = ("mp3",)  # LAME encodes at most two channels


def speech_like(rate: int, seconds: float, channels: int = 1, seed: int = 0) -> np.ndarray:
    """[channels, rate * seconds] float32 in about [-0.6, 0.6]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(rate * seconds))) / rate
    f0 = 165 + 75 * np.sin(2 * np.pi * (0.4 + 0.1 * rng.random()) * t + rng.random() * 6)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 9))
    syllables = (0.55 + 0.45 * np.sin(2 * np.pi * (3 + 2 * rng.random()) * t)) ** 2
    top = min(7000.0, rate / 2 - 200)
    chirp = np.sin(2 * np.pi * (200 * t + (top - 200) * t**2 / (2 * max(seconds, 1e-3))))
    mono = 0.25 * voiced * syllables + 0.05 * chirp
    gains = 1.0 - 0.35 * np.arange(channels)
    noise = rng.standard_normal((channels, len(t))) * 0.01
    return (gains[:, None] * mono[None, :] + noise).astype(np.float32)


def encode(wave: np.ndarray, rate: int, ext: str) -> bytes:
    """`wave` ([channels, samples] float32; 1, 2 or 6 channels, at most 2 in MP3) encoded as a `ext` file
    (a key of CONTAINERS)."""
    import av

    muxer, codec, sample_format = CONTAINERS[ext]
    channels, total = wave.shape
    if channels not in LAYOUTS or (channels > 2 and ext in STEREO_ONLY):
        raise ValueError(f"cannot encode {channels} channels as .{ext}")
    out = io.BytesIO()
    with av.open(out, "w", format=muxer) as container:
        stream = container.add_stream(codec, rate=rate, layout=LAYOUTS[channels])
        step = stream.codec_context.frame_size or 4096
        fmt = av.AudioFormat(sample_format)
        for start in range(0, total, step):
            piece = wave[:, start:start + step]
            if not fmt.is_planar:
                piece = piece.T.reshape(1, -1)  # interleaved: one plane, channels alternating
            if sample_format == "s16":
                piece = np.round(np.clip(piece, -1, 1) * 32767).astype(np.int16)
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(piece), format=sample_format, layout=stream.layout)
            frame.sample_rate, frame.pts = rate, start
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()
