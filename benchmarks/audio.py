"""`python -m benchmarks.audio`: plait's audio gather (one PyAV decode + numpy log-mel) against the plain loop.

The plain loop is what a training script does without plait: PyAV decode of each clip with PyAV's resampler
to 16 kHz mono, then transformers' WhisperFeatureExtractor (padding="max_length", return_attention_mask,
one row per 30 s window, as the Qwen2-Audio processor calls it). plait's gather is `AudioPolicy.load` on the
clip and the AudioInfo its planning probe read. Same clips, same process, same cores (torch's intra-op
threads as they are); each side best of --repeats passes, alternating.

Reported: `ratio_wall` (plain loop wall / plait wall: above 1 plait is faster), `decodes_per_clip` (decode
passes per clip during plait's gather), `planning_decodes` (decode passes and decoded frames while probing
every clip: 0), `max_feature_diff` (plait's features against the extractor's on the same waveform, over all
clips and windows) and seconds of audio per wall second for both. `plait_vs_float64` and
`extractor_vs_float64` put each float32 path beside the same formulas in float64: the feature difference
is mostly the extractor's own rounding (its float32 torch.stft), near the clamp 8 decades below the peak. Clips are generated (speech-like, mixed
containers, rates, channels and durations) unless --path names a folder of the user's files.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import main, write_result
from plait.errors import PlaitError
from plait.media import audio
from plait.media.audio import AUDIO_EXTENSIONS, AudioPolicy, probe
from plait.media.audio_features import SAMPLE_RATE, WINDOW_SAMPLES, log_mel
from plait.media.audio_synth import CONTAINERS, OPUS_RATES, encode, speech_like

HELP = "audio gather (decode + log-mel) against PyAV + WhisperFeatureExtractor: ratio_wall, decodes, feature diff"
DESCRIPTION = __doc__
RATES = (8000, 16000, 22050, 44100, 48000)


def add_arguments(p) -> None:
    p.add_argument("--path", metavar="DIR", help="measure the audio files in DIR (by extension) instead")
    p.add_argument("--clips", type=int, default=24, help="generated clips (default 24)")
    p.add_argument("--min-seconds", type=float, default=2.0, help="shortest generated clip (default 2)")
    p.add_argument("--max-seconds", type=float, default=20.0, help="longest generated clip (default 20)")
    p.add_argument("--policy", choices=audio.POLICIES, default="qwen2audio")
    p.add_argument("--mel-bins", type=int, choices=(80, 128), default=128)
    p.add_argument("--repeats", type=int, default=2, help="passes of each side; the best counts (default 2)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")


def generate(folder: Path, clips: int, shortest: float, longest: float, seed: int = 0) -> list[Path]:
    """Speech-like clips in every container, at mixed rates, channel counts and durations."""
    rng = np.random.default_rng(seed)
    exts = list(CONTAINERS)
    paths = []
    for i in range(clips):
        ext = exts[i % len(exts)]
        rate = int(rng.choice(OPUS_RATES[2:] if ext == "ogg" else RATES))
        seconds = float(rng.uniform(shortest, longest))
        path = folder / f"clip{i:03d}.{ext}"
        path.write_bytes(encode(speech_like(rate, seconds, 1 + i % 2, seed=i), rate, ext))
        paths.append(path)
    return paths


def windows_of(wave: np.ndarray) -> list[np.ndarray]:
    return [wave[i:i + WINDOW_SAMPLES] for i in range(0, max(len(wave), 1), WINDOW_SAMPLES)]


def plain_loop(paths: list[Path], extractor) -> float:
    """PyAV decode with PyAV's own down-mix and resampling, then the extractor: wall seconds."""
    import av

    start = time.perf_counter()
    for path in paths:
        with av.open(str(path)) as container:
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            pieces = [out.to_ndarray()[0] for frame in container.decode(audio=0) for out in resampler.resample(frame)]
            pieces += [out.to_ndarray()[0] for out in resampler.resample(None)]
        extractor(windows_of(np.concatenate(pieces)), sampling_rate=SAMPLE_RATE, padding="max_length",
                  return_attention_mask=True, return_tensors="np")
    return time.perf_counter() - start


def plait_gather(paths: list[Path], infos, policy: AudioPolicy) -> float:
    start = time.perf_counter()
    for path, info in zip(paths, infos):
        policy.load(str(path), info)
    return time.perf_counter() - start


def run(args) -> int:
    import torch
    from transformers import WhisperFeatureExtractor

    tmp = None
    if args.path:
        paths = sorted(p for p in Path(args.path).rglob("*") if p.suffix.lstrip(".").lower() in AUDIO_EXTENSIONS)
        if not paths:
            raise PlaitError(f"no audio files ({', '.join(AUDIO_EXTENSIONS)}) under {args.path}")
    else:
        tmp = tempfile.TemporaryDirectory(prefix="plait-bench-audio-")
        paths = generate(Path(tmp.name), args.clips, args.min_seconds, args.max_seconds)
    policy = AudioPolicy(args.policy, mel_bins=args.mel_bins)
    extractor = WhisperFeatureExtractor(feature_size=args.mel_bins)

    before = (audio.AUDIO_DECODES.count, audio.FRAME_DECODES.count)
    start = time.perf_counter()
    infos = [probe(str(p)) for p in paths]
    probe_wall = time.perf_counter() - start
    planning_decodes = audio.AUDIO_DECODES.count + audio.FRAME_DECODES.count - sum(before)
    tokens = sum(policy.plan(info).tokens for info in infos)
    seconds = sum(info.duration for info in infos)

    plait_gather(paths[:2], infos[:2], policy)  # warm both sides (FFT plans, the extractor's torch kernels)
    plain_loop(paths[:2], extractor)
    plait_walls, plain_walls, decodes = [], [], []
    for _ in range(args.repeats):
        passes = audio.AUDIO_DECODES.count
        plait_walls.append(plait_gather(paths, infos, policy))
        decodes.append(audio.AUDIO_DECODES.count - passes)
        plain_walls.append(plain_loop(paths, extractor))

    diff = plait_error = extractor_error = 0.0
    for path, info in zip(paths, infos):  # the same waveform through both feature paths, and in float64
        wave = audio.decode(str(path), info)
        ours = policy.features(wave)
        ref = extractor(windows_of(wave), sampling_rate=SAMPLE_RATE, padding="max_length", return_tensors="np")
        windows = np.zeros((ours.plan.windows, WINDOW_SAMPLES))
        windows.reshape(-1)[: len(wave)] = wave
        exact = log_mel(windows, np.array(ours.plan.window_samples), args.mel_bins, dtype=np.float64)
        diff = max(diff, float(np.abs(ours.input_features - ref["input_features"]).max()))
        plait_error = max(plait_error, float(np.abs(ours.input_features - exact).max()))
        extractor_error = max(extractor_error, float(np.abs(ref["input_features"] - exact).max()))

    plait_wall, plain_wall = min(plait_walls), min(plain_walls)
    result = {"clips": len(paths), "audio_seconds": round(seconds, 2), "tokens": tokens, "policy": args.policy,
              "mel_bins": args.mel_bins, "source": args.path or "generated", "torch_threads": torch.get_num_threads(),
              "plait_wall_s": round(plait_wall, 3), "plain_wall_s": round(plain_wall, 3),
              "ratio_wall": round(plain_wall / plait_wall, 3),
              "plait_audio_s_per_s": round(seconds / plait_wall, 1), "plain_audio_s_per_s": round(seconds / plain_wall, 1),
              "probe_ms_per_clip": round(1000 * probe_wall / len(paths), 2),
              "decodes_per_clip": round(max(decodes) / len(paths), 3), "planning_decodes": planning_decodes,
              "max_feature_diff": float(f"{diff:.3g}"), "plait_vs_float64": float(f"{plait_error:.3g}"),
              "extractor_vs_float64": float(f"{extractor_error:.3g}")}
    for key, value in result.items():
        print(f"{key:>22}: {value}")
    write_result(args.json, result)
    if tmp:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
