"""`plait bench audio`: plait's audio gather against a plain PyAV + WhisperFeatureExtractor loop.

It measures --clips generated speech-like clips (WAV, FLAC, MP3, Ogg/Opus, M4A in turn; 8-48 kHz; 1, 2 or 6
channels) or the first --clips of your own files (--path: a folder or a glob), in one process on the same
cores. Planning: plait's header probe of every clip, which decodes nothing; a file it cannot read is named and
left out. plait: the gather, one PyAV decode (16 kHz, channels averaged) and a numpy log-mel of the frames
that hold audio. Plain: PyAV decode with its resampler to 16 kHz mono, then transformers'
WhisperFeatureExtractor (padding="max_length", one row per 30 s window, as the Qwen2-Audio processor calls
it). Each side runs --repeats times, alternating; the best pass counts.

Reported: ratio_wall = plain wall / plait wall (target >= 1); decodes_per_clip (target 1); planning_decodes,
decode passes and frames while probing (target 0); max_feature_diff, plait's features against the
extractor's on the same waveform (target <= 1e-4), and each float32 path against float64. Without
transformers, plait's own rate only.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from plait.cli.common import positive_int
from plait.errors import PlaitError

HELP = "audio decode + log-mel: plait's gather vs PyAV + WhisperFeatureExtractor; decodes per clip, feature diff"
DESCRIPTION = __doc__


def add_arguments(p) -> None:
    p.add_argument("--path", help="a folder (searched recursively) or a glob of your audio files to measure instead")
    p.add_argument("--clips", type=positive_int, default=24, help="clips (with --path: the first N found; default 24)")
    p.add_argument("--min-seconds", type=float, default=2.0, help="shortest generated clip (default 2)")
    p.add_argument("--max-seconds", type=float, default=20.0, help="longest generated clip (default 20)")
    p.add_argument("--policy", choices=("qwen2audio", "chunked"), default="qwen2audio", help="window policy")
    p.add_argument("--mel-bins", type=int, choices=(80, 128), default=128)
    p.add_argument("--repeats", type=positive_int, default=2, help="passes of each side; the best counts (default 2)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar or table")


def windows_of(wave: np.ndarray) -> list[np.ndarray]:
    return [wave[i:i + 480_000] for i in range(0, max(len(wave), 1), 480_000)]  # 30 s at 16 kHz


def plain_loop(paths: list[Path], extractor, advance, samples: list[int]) -> float:
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
        advance()
    return time.perf_counter() - start


def plait_gather(paths: list[Path], infos, policy, advance) -> float:
    start = time.perf_counter()
    for path, info in zip(paths, infos):
        policy.load(str(path), info)
        advance()
    return time.perf_counter() - start


def check_clips(paths: list[Path], policy, extractor, errors: list[str], advance) -> tuple[list, list, dict]:
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
        advance()
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


def measure(args, paths: list[Path], bar) -> dict:
    from plait.media import audio

    policy = audio.AudioPolicy(args.policy, mel_bins=args.mel_bins)
    try:
        from transformers import WhisperFeatureExtractor
        extractor = WhisperFeatureExtractor(feature_size=args.mel_bins)
    except ImportError:
        extractor = None
    errors: list[str] = []
    per_clip = 1 + args.repeats * (1 + (extractor is not None))  # the checking pass, then the timed ones
    task = bar.add_task("clips", total=len(paths) * per_clip)
    paths, infos, found = check_clips(paths, policy, extractor, errors, lambda: bar.advance(task))
    if not paths:
        raise PlaitError("no clip could be read: " + "; ".join(errors)[:2000])
    bar.update(task, total=len(paths) * per_clip)
    plait_walls, plain_walls, decodes = [], [], []
    for _ in range(args.repeats):
        passes = audio.AUDIO_DECODES.count
        plait_walls.append(plait_gather(paths, infos, policy, lambda: bar.advance(task)))
        decodes.append(audio.AUDIO_DECODES.count - passes)
        if extractor is not None:
            plain_walls.append(plain_loop(paths, extractor, lambda: bar.advance(task),
                                          [policy.plan(info).samples for info in infos]))
    seconds = sum(info.duration for info in infos)
    plans = [policy.plan(info) for info in infos]
    plait_wall, plain_wall = min(plait_walls), min(plain_walls, default=None)
    return {"clips": len(paths), "audio_seconds": seconds, "windows": sum(p.windows for p in plans),
            "tokens": sum(p.tokens for p in plans), "plait_wall_s": plait_wall, "plain_wall_s": plain_wall,
            "ratio_wall": plain_wall / plait_wall if plain_wall else None, "plait_audio_s_per_s": seconds / plait_wall,
            "plain_audio_s_per_s": seconds / plain_wall if plain_wall else None,
            "decodes_per_clip": max(decodes) / len(paths), **found, "skipped": len(errors), "errors": errors}


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from plait.cli.audio_data import write_clips
    from plait.cli.bench.user_files import find_files
    from plait.media.audio import AUDIO_EXTENSIONS

    if not 0 < args.min_seconds <= args.max_seconds:
        raise PlaitError(f"--min-seconds {args.min_seconds} and --max-seconds {args.max_seconds}: need 0 < min <= max")
    load, err = os.getloadavg(), Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="plait-bench-audio-") as tmp:
        if args.path:
            paths = find_files(args.path, AUDIO_EXTENSIONS, args.clips, "audio")
        else:
            with err.status("writing the clips…", spinner="dots"):
                paths = write_clips(Path(tmp), args.clips, shortest=args.min_seconds, longest=args.max_seconds)
        with Progress(TextColumn("[bold]audio[/] clip passes (a checking one, then the timed ones)"), BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(), console=err, disable=args.quiet) as bar:
            result = measure(args, paths, bar)
    threads = None
    if result["plain_wall_s"]:
        import torch  # transformers' extractor computes with it

        threads = torch.get_num_threads()
    result = {"source": args.path or "generated", "policy": args.policy, "mel_bins": args.mel_bins, **result,
              "torch_threads": threads, "cpus": os.cpu_count(), "loadavg": [round(x, 2) for x in (*load, *os.getloadavg())],
              "baseline": "PyAV + transformers.WhisperFeatureExtractor" if threads else
              "none: transformers is not installed (pip install transformers); plait's own rate only"}
    if not args.quiet:
        _table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _table(r: dict) -> None:
    from rich.table import Table

    from plait.cli.common import table_console

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    t = Table(title=f"audio: plait's gather vs {r['baseline']}; {r['clips']} clips ({r['source']}), "
                    f"{r['audio_seconds']:,.1f} s, policy {r['policy']}, {r['mel_bins']} mel bins")
    for col in ("measure", "value"):
        t.add_column(col, justify="right" if col == "value" else "left")
    for row in (("windows / placeholder tokens", f"{r['windows']:,} / {r['tokens']:,}"),
                ("plait / plain: seconds of audio per wall second",
                 f"{r['plait_audio_s_per_s']:,.1f} / {num(r['plain_audio_s_per_s'], ',.1f')}"),
                ("ratio_wall (plain wall / plait wall; target >= 1.0)", num(r["ratio_wall"], ".2f")),
                ("decode passes per clip (target 1)", f"{r['decodes_per_clip']:.3f}"),
                ("decodes while planning (target 0)", str(r["planning_decodes"])),
                ("max |features - extractor's| (target <= 1e-4)", num(r["max_feature_diff"], ".2e")),
                ("plait / extractor vs float64", f"{num(r['plait_vs_float64'], '.2e')} / "
                                                 f"{num(r['extractor_vs_float64'], '.2e')}"),
                ("files left out (unreadable)", str(r["skipped"])),
                ("torch threads / cpus / load average (start, end)",
                 f"{r['torch_threads']} / {r['cpus']} / {r['loadavg'][0]:.1f}, {r['loadavg'][3]:.1f}")):
        t.add_row(*row)
    out = table_console()
    out.print(t)
    for line in r["errors"][:10]:
        out.print(f"  left out: {line}", highlight=False, soft_wrap=True, markup=False)
