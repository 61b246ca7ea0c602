"""Whisper log-mel features in numpy, as transformers' WhisperFeatureExtractor computes them.

The published algorithm (transformers' WhisperFeatureExtractor with audio_utils' mel_filter_bank), at 16 kHz:

    window   = one 30 s window: the clip's samples, zeros after them, WINDOW_SAMPLES (480,000) in all
    frames   = STFT with n_fft 400, hop 160, a periodic Hann window, centred (the window reflect-padded by
               200 samples at each end): 3,001 frames, the last dropped -> 3,000
    power    = |rfft|^2 over 201 bins;  mel = power @ filters  (Slaney mel scale from 0 to 8 kHz, Slaney area
               normalisation: each triangle scaled by 2 / its width in Hz)
    log      = log10(max(mel, 1e-10));  log = max(log, max(log over the window) - 8);  features = (log + 4) / 4

Frames past a clip's end see only zeros, so their log-mel is log10(1e-10) = -10 before the clamp, the least
value there is: it never sets the window's maximum. Only the frames that touch the clip are transformed here
(all windows of a clip in one batched rfft); the rest are filled with that silence value after the clamp.
That is what makes a 3 s clip cost a tenth of a 30 s one, with features equal to the extractor's padded ones.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

__all__ = ["HOP", "MEL_BINS", "N_FFT", "SAMPLE_RATE", "WINDOW_FRAMES", "WINDOW_SAMPLES", "log_mel", "mel_filters"]

SAMPLE_RATE = 16_000
N_FFT = 400
HOP = 160
WINDOW_SAMPLES = 30 * SAMPLE_RATE
WINDOW_FRAMES = WINDOW_SAMPLES // HOP  # 3,000
MEL_BINS = (80, 128)  # Whisper v1/v2 and Qwen2-Audio's encoder (128), the ones the reference publishes
LOG_FLOOR = 1e-10
DYNAMIC_RANGE = 8.0  # decades kept below the window's loudest bin


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's scale: linear (3 mel per 200 Hz) below 1 kHz, logarithmic (27 mel per factor 6.4) above."""
    hz = np.asarray(hz, dtype=np.float64)
    return np.where(hz < 1000.0, 3.0 * hz / 200.0, 15.0 + np.log(np.maximum(hz, 1e-12) / 1000.0) * 27.0 / np.log(6.4))


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    return np.where(mel < 15.0, 200.0 * mel / 3.0, 1000.0 * np.exp((mel - 15.0) * np.log(6.4) / 27.0))


@lru_cache(maxsize=None)
def mel_filters(bins: int, dtype=np.float32) -> np.ndarray:
    """The [201, bins] filter bank: Slaney-scale triangles over 0..8 kHz, area-normalised."""
    if bins < 1:
        raise ValueError(f"mel bins must be positive, got {bins}")
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(SAMPLE_RATE / 2), bins + 2))
    fft_hz = np.linspace(0.0, SAMPLE_RATE // 2, N_FFT // 2 + 1)
    to_centre = edges[None, :] - fft_hz[:, None]  # [201, bins + 2]
    rising = -to_centre[:, :-2] / np.diff(edges)[:-1]
    falling = to_centre[:, 2:] / np.diff(edges)[1:]
    triangles = np.maximum(0.0, np.minimum(rising, falling))
    filters = (triangles * (2.0 / (edges[2:] - edges[:-2]))[None, :]).astype(dtype)
    filters.setflags(write=False)  # cached and shared: nobody may change it
    return filters


@lru_cache(maxsize=None)
def filter_taps(bins: int, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """The filter bank as taps: rows [taps, bins] (bin b's k-th frequency row, from its triangle's first) and
    weights [taps, bins] (0 past the triangle). A triangle spans a few of the 201 rows."""
    filters = mel_filters(bins, dtype)
    nonzero = filters != 0
    first = np.where(nonzero.any(axis=0), nonzero.argmax(axis=0), 0)
    last = np.where(nonzero.any(axis=0), filters.shape[0] - 1 - nonzero[::-1].argmax(axis=0), -1)
    taps = max(int((last - first).max()) + 1, 1)
    rows = np.minimum(first[None, :] + np.arange(taps)[:, None], filters.shape[0] - 1)
    weights = np.where(rows <= last[None, :], filters[rows, np.arange(bins)[None, :]], 0).astype(dtype)
    rows.setflags(write=False), weights.setflags(write=False)
    return rows, weights


def mel_product(power: np.ndarray, bins: int) -> np.ndarray:
    """The filter bank applied to power [n, 201], as [bins, n]: summed tap by tap in a fixed order. A BLAS
    product rounds differently with its thread count (float32 bits differed between a Ray worker's one
    thread and a trainer's two, so the same clip had two digests); a triangle spans a few rows, so the taps
    are also fewer multiply-adds than the dense product (frequency-major, each tap reads whole rows)."""
    rows, weights = filter_taps(bins, power.dtype)
    by_frequency = np.ascontiguousarray(power.T)
    out = by_frequency[rows[0]] * weights[0][:, None]
    for k in range(1, len(rows)):
        out += by_frequency[rows[k]] * weights[k][:, None]
    return out


@lru_cache(maxsize=None)
def _hann(dtype) -> np.ndarray:
    return (0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(N_FFT) / N_FFT)).astype(dtype)


def frames_touching(samples: int) -> int:
    """Frames of a window whose 400-sample span holds any of its first `samples` samples."""
    return min(WINDOW_FRAMES, -(-(samples + N_FFT // 2) // HOP))


def log_mel(windows: np.ndarray, lengths: np.ndarray, bins: int, dtype=np.float32) -> np.ndarray:
    """Features [W, bins, 3000] of W windows ([W, WINDOW_SAMPLES] samples, zeros after each
    window's `lengths[w]` samples), each clamped against its own maximum as the extractor does. Frames
    past the longest clip are not transformed: all zeros, their log-mel is the floor. `dtype` float64
    gives the exact values the float32 paths (this one and the extractor's torch.stft) both round."""
    windows = np.asarray(windows, dtype=dtype)
    count = windows.shape[0]
    needed = max((frames_touching(int(n)) for n in lengths), default=0)
    half = N_FFT // 2
    padded = np.empty((count, WINDOW_SAMPLES + N_FFT), dtype=dtype)
    padded[:, half:-half] = windows
    padded[:, :half] = windows[:, half:0:-1]  # reflect, the edge sample not repeated (torch.stft's "reflect")
    padded[:, -half:] = windows[:, -2:-half - 2:-1]
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT, axis=1)[:, : needed * HOP : HOP]
    spectrum = np.fft.rfft(frames * _hann(dtype), axis=-1)
    power = (spectrum.real**2 + spectrum.imag**2).reshape(-1, N_FFT // 2 + 1)
    mel = np.log10(np.maximum(mel_product(power, bins), LOG_FLOOR))  # [bins, W * needed]
    out = np.full((count, bins, WINDOW_FRAMES), np.log10(LOG_FLOOR), dtype=dtype)
    out[:, :, :needed] = mel.reshape(bins, count, needed).transpose(1, 0, 2)
    floor = out.max(axis=(1, 2), keepdims=True) - DYNAMIC_RANGE
    np.maximum(out, floor, out=out)
    out += 4.0
    out /= 4.0
    return out
