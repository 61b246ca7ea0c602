"""`plait bench audio`: plait's audio gather against a plain PyAV + WhisperFeatureExtractor loop.

On --clips generated speech-like clips (WAV, FLAC, MP3, Ogg/Opus, M4A; 8-48 kHz; 1, 2 or 6 channels) or the
first of yours (--path), in one process: plait probes every header (decoding nothing; an unreadable file is
named and left out), then gathers each clip (one PyAV decode to 16 kHz mono, numpy log-mel); the plain loop
decodes with PyAV's resampler, then runs transformers' WhisperFeatureExtractor (padding="max_length", one row
per 30 s window). Best of --repeats passes each. ratio_wall = plain wall / plait wall (target >= 1);
decodes_per_clip (target 1); planning_decodes (target 0); max_feature_diff against the extractor (target
<= 1e-4) and each float32 path against float64. Without transformers, plait's own rate only.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from plait.cli.bench.media_bench import Media
from plait.cli.common import fmt, positive_int
from plait.errors import PlaitError
from plait.media.audio import AUDIO_EXTENSIONS

HELP = "audio decode + log-mel: plait's gather vs PyAV + WhisperFeatureExtractor; decodes per clip, feature diff"
DESCRIPTION = __doc__


def add_arguments(p) -> None:
    MEDIA.add_arguments(p)
    p.add_argument("--min-seconds", type=float, default=2.0, help="shortest generated clip (default 2)")
    p.add_argument("--max-seconds", type=float, default=20.0, help="longest generated clip (default 20)")
    p.add_argument("--policy", choices=("qwen2audio", "chunked"), default="qwen2audio", help="window policy")
    p.add_argument("--mel-bins", type=int, choices=(80, 128), default=128)
    p.add_argument("--repeats", type=positive_int, default=2, help="passes of each side; the best counts (default 2)")


def windows_of(wave: np.ndarray) -> list[np.ndarray]:
    return [wave[i:i + 480_000] for i in range(0, max(len(wave), 1), 480_000)]  # 30 s at 16 kHz


def plain_loop(paths: list[Path], extractor, samples: list[int]) -> float:
    """Wall seconds of PyAV decode (its own down-mix and resampling), then the extractor, per clip (cut to the
    samples plait's plan keeps: a tail too short for one token is no window on either side)."""
    import av

    start = time.perf_counter()
    for path, keep in zip(paths, samples):
        with av.open(str(path)) as container:
            resampler = av.AudioResampler(format="flt", layout="mono", rate=16000)
            pieces = [out.to_ndarray()[0] for frame in container.decode(audio=0) for out in resampler.resample(frame)]
            pieces += [out.to_ndarray()[0] for out in resampler.resample(None)]
        extractor(windows_of(np.concatenate(pieces)[:keep]), sampling_rate=16000, padding="max_length",
                  return_attention_mask=True, return_tensors="np")
    return time.perf_counter() - start


def plait_gather(paths: list[Path], infos, policy) -> float:
    start = time.perf_counter()
    for path, info in zip(paths, infos):
        policy.load(str(path), info)
    return time.perf_counter() - start


def check_clips(paths: list[Path], policy, extractor, errors: list[str]) -> tuple[list, list, dict]:
    """Probe every clip (counting decodes), then decode it once and compare its features with the
    extractor's and with float64 (this pass also warms both sides up). Unreadable files go to `errors`."""
    from plait.media import audio
    from plait.media.audio_features import log_mel

    counted = audio.AUDIO_DECODES.count + audio.FRAME_DECODES.count
    infos = {}
    for path in paths:
        try:
            infos[path] = audio.probe(str(path))
        except PlaitError as e:
            errors.append(str(e))
    found = {"planning_decodes": audio.AUDIO_DECODES.count + audio.FRAME_DECODES.count - counted}
    diffs, kept = np.zeros(3), []
    for path, info in infos.items():
        try:
            wave = audio.decode(str(path), info)
            ours = policy.features(wave)  # a clip too short for one token is a PlaitError too
            wave = wave[: ours.plan.samples]  # the windows plait keeps (a tail shorter than a token is cut)
        except PlaitError as e:
            errors.append(str(e) if str(path) in str(e) else f"{path}: {e}")
            continue
        kept.append(path)
        if extractor is not None:
            ref = extractor(windows_of(wave), sampling_rate=16000, padding="max_length", return_tensors="np")
            windows = np.zeros((ours.plan.windows, 480_000))
            windows.reshape(-1)[: len(wave)] = wave
            exact = log_mel(windows, np.array(ours.plan.window_samples), policy.mel_bins, dtype=np.float64)
            pairs = ((ours.input_features, ref["input_features"]), (ours.input_features, exact),
                     (ref["input_features"], exact))
            diffs = np.maximum(diffs, [float(np.abs(a - b).max()) for a, b in pairs])
    names = ("max_feature_diff", "plait_vs_float64", "extractor_vs_float64")
    found.update(zip(names, diffs.tolist() if extractor is not None else [None] * 3))
    return kept, [infos[p] for p in kept], found


def generate(args, folder: Path) -> list[Path]:
    from plait.cli.audio_data import write_clips

    if not 0 < args.min_seconds <= args.max_seconds:
        raise PlaitError(f"--min-seconds {args.min_seconds} and --max-seconds {args.max_seconds}: need 0 < min <= max")
    return write_clips(folder, args.clips, shortest=args.min_seconds, longest=args.max_seconds)


def measure(args, paths: list[Path], folder: Path) -> dict:
    from plait.media import audio

    policy = audio.AudioPolicy(args.policy, mel_bins=args.mel_bins)
    try:
        from transformers import WhisperFeatureExtractor
        extractor = WhisperFeatureExtractor(feature_size=args.mel_bins)
    except ImportError:
        extractor = None
    errors: list[str] = []
    paths, infos, found = check_clips(paths, policy, extractor, errors)
    if not paths:
        raise PlaitError("no clip could be read: " + "; ".join(errors)[:2000])
    plans = [policy.plan(info) for info in infos]
    plait_walls, plain_walls, decodes = [], [], []
    for _ in range(args.repeats):
        passes = audio.AUDIO_DECODES.count
        plait_walls.append(plait_gather(paths, infos, policy))
        decodes.append(audio.AUDIO_DECODES.count - passes)
        if extractor is not None:
            plain_walls.append(plain_loop(paths, extractor, [p.samples for p in plans]))
    seconds = sum(info.duration for info in infos)
    plait_wall, plain_wall = min(plait_walls), min(plain_walls, default=None)
    threads = None
    if plain_wall:
        import torch  # transformers' extractor computes with it

        threads = torch.get_num_threads()
    return {"policy": args.policy, "mel_bins": args.mel_bins, "clips": len(paths), "audio_seconds": seconds,
            "windows": sum(p.windows for p in plans), "tokens": sum(p.tokens for p in plans),
            "plait_wall_s": plait_wall, "plain_wall_s": plain_wall,
            "ratio_wall": plain_wall / plait_wall if plain_wall else None, "plait_audio_s_per_s": seconds / plait_wall,
            "plain_audio_s_per_s": seconds / plain_wall if plain_wall else None,
            "decodes_per_clip": max(decodes) / len(paths), **found, "skipped": len(errors), "errors": errors,
            "torch_threads": threads, "baseline": "PyAV + transformers.WhisperFeatureExtractor" if threads else
            "none: transformers is not installed (pip install transformers); plait's own rate only"}


def rows(r: dict) -> list[tuple[str, str]]:
    return [("windows / placeholder tokens", f"{r['windows']:,} / {r['tokens']:,}"),
            ("plait / plain: seconds of audio per wall second",
             f"{r['plait_audio_s_per_s']:,.1f} / {fmt(r['plain_audio_s_per_s'], ',.1f')}"),
            ("ratio_wall (plain wall / plait wall; target >= 1.0)", fmt(r["ratio_wall"], ".2f")),
            ("decode passes per clip (target 1)", f"{r['decodes_per_clip']:.3f}"),
            ("decodes while planning (target 0)", str(r["planning_decodes"])),
            ("max |features - extractor's| (target <= 1e-4)", fmt(r["max_feature_diff"], ".2e")),
            ("plait / extractor vs float64", f"{fmt(r['plait_vs_float64'], '.2e')} / {fmt(r['extractor_vs_float64'], '.2e')}"),
            ("torch threads / cpus", f"{r['torch_threads']} / {r['cpus']}")]


MEDIA = Media("audio", "audio", AUDIO_EXTENSIONS, "clips", 24, generate, measure, rows,
              lambda r: f"audio: plait's gather vs {r['baseline']}; {r['clips']} clips ({r['source']}), "
                        f"{r['audio_seconds']:,.1f} s, policy {r['policy']}, {r['mel_bins']} mel bins")

run = MEDIA.run
