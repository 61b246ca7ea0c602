"""`plait bench audio`: plait's audio gather against a plain PyAV + WhisperFeatureExtractor loop.

It writes --clips speech-like clips (WAV, FLAC, MP3, Ogg/Opus, M4A/AAC in turn; 8-48 kHz; 1, 2 or 6
channels; --min-seconds..--max-seconds), or, with --path (a folder, searched recursively, or a glob), takes
the first --clips of your audio files, then in one process on the same cores:

  planning  plait's header probe of every clip (duration, rate, channels; no decode): the windows and
            placeholder tokens planning counts. Files it cannot read are named and left out.
  plait     the gather of every clip: one PyAV decode (resampled to 16 kHz, channels averaged) and
            plait's numpy log-mel of the frames that hold audio, with the attention mask, per 30 s window.
  plain     what a training script does without plait: PyAV decode with PyAV's resampler to 16 kHz mono,
            then transformers' WhisperFeatureExtractor (padding="max_length", return_attention_mask, one
            row per 30 s window, as the Qwen2-Audio processor calls it). torch's threads as they are.

Each side runs --repeats times, alternating; the best pass counts. Reported: ratio_wall (plain wall /
plait wall: above 1 plait is faster), seconds of audio per wall second of both, decodes_per_clip (decode
passes per clip in plait's passes: 1), planning_decodes (decode passes and decoded frames while probing: 0),
max_feature_diff (plait's features against the extractor's on the same waveform, all clips and windows:
<= 1e-4), and each float32 path against the same formulas in float64. Without transformers the plain loop
and the comparison are left out and plait's own rate is reported.
"""

from __future__ import annotations

import contextlib
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
TARGET_DIFF = 1e-4


def add_arguments(p) -> None:
    p.add_argument("--path", help="a folder (searched recursively) or a glob of your audio files (wav, flac, mp3, "
                   "ogg, opus, oga, m4a) to measure instead of generated ones")
    p.add_argument("--clips", type=positive_int, default=24, help="generated clips (with --path: the first N found; "
                   "default 24)")
    p.add_argument("--min-seconds", type=float, default=2.0, help="shortest generated clip (default 2)")
    p.add_argument("--max-seconds", type=float, default=20.0, help="longest generated clip (default 20)")
    p.add_argument("--policy", choices=("qwen2audio", "chunked"), default="qwen2audio", help="window policy")
    p.add_argument("--mel-bins", type=int, choices=(80, 128), default=128)
    p.add_argument("--repeats", type=positive_int, default=2, help="passes of each side; the best counts (default 2)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar or table")


def whisper_extractor(bins: int):
    """transformers' WhisperFeatureExtractor, or None where transformers is not installed."""
    try:
        from transformers import WhisperFeatureExtractor
    except ImportError:
        return None
    return WhisperFeatureExtractor(feature_size=bins)


def windows_of(wave: np.ndarray) -> list[np.ndarray]:
    from plait.media.audio_features import WINDOW_SAMPLES

    return [wave[i:i + WINDOW_SAMPLES] for i in range(0, max(len(wave), 1), WINDOW_SAMPLES)]


def plain_loop(paths: list[Path], extractor, advance) -> float:
    """PyAV decode with PyAV's own down-mix and resampling, then the extractor: wall seconds."""
    import av

    start = time.perf_counter()
    for path in paths:
        with av.open(str(path)) as container:
            resampler = av.AudioResampler(format="flt", layout="mono", rate=16000)
            pieces = [out.to_ndarray()[0] for frame in container.decode(audio=0) for out in resampler.resample(frame)]
            pieces += [out.to_ndarray()[0] for out in resampler.resample(None)]
        extractor(windows_of(np.concatenate(pieces)), sampling_rate=16000, padding="max_length",
                  return_attention_mask=True, return_tensors="np")
        advance()
    return time.perf_counter() - start


def plait_gather(paths: list[Path], infos, policy, advance) -> float:
    start = time.perf_counter()
    for path, info in zip(paths, infos):
        policy.load(str(path), info)
        advance()
    return time.perf_counter() - start


def planning(paths: list[Path]) -> tuple[list[Path], list, dict]:
    """Every readable clip's AudioInfo from its headers, the probe's cost, and the files left out (named)."""
    from plait.media import audio

    before = audio.AUDIO_DECODES.count + audio.FRAME_DECODES.count
    kept, infos, errors = [], [], []
    start = time.perf_counter()
    for path in paths:
        try:
            infos.append(audio.probe(str(path)))
            kept.append(path)
        except PlaitError as e:
            errors.append(str(e))
    wall = time.perf_counter() - start
    decodes = audio.AUDIO_DECODES.count + audio.FRAME_DECODES.count - before
    return kept, infos, {"probe_ms_per_clip": 1000 * wall / max(1, len(paths)), "planning_decodes": decodes,
                         "errors": errors}


def feature_check(paths: list[Path], infos, policy, extractor) -> tuple[list[Path], list, dict]:
    """Each clip through plait's features and the extractor's on the same waveform (and both against
    float64); a clip that fails to decode is named and left out of the timed passes."""
    from plait.media import audio
    from plait.media.audio_features import WINDOW_SAMPLES, log_mel

    kept, kept_infos, errors = [], [], []
    diff = plait_error = extractor_error = 0.0
    for path, info in zip(paths, infos):
        try:
            wave = audio.decode(str(path), info)
        except PlaitError as e:
            errors.append(str(e))
            continue
        kept.append(path)
        kept_infos.append(info)
        if extractor is None:
            continue
        ours = policy.features(wave)
        ref = extractor(windows_of(wave), sampling_rate=16000, padding="max_length", return_tensors="np")
        windows = np.zeros((ours.plan.windows, WINDOW_SAMPLES))
        windows.reshape(-1)[: len(wave)] = wave
        exact = log_mel(windows, np.array(ours.plan.window_samples), policy.mel_bins, dtype=np.float64)
        diff = max(diff, float(np.abs(ours.input_features - ref["input_features"]).max()))
        plait_error = max(plait_error, float(np.abs(ours.input_features - exact).max()))
        extractor_error = max(extractor_error, float(np.abs(ref["input_features"] - exact).max()))
    found = {"max_feature_diff": diff, "plait_vs_float64": plait_error, "extractor_vs_float64": extractor_error}
    return kept, kept_infos, {"errors": errors, **(found if extractor is not None else dict.fromkeys(found))}


def clips_of(args, folder: Path) -> list[Path]:
    from plait.cli.audio_data import write_clips
    from plait.cli.bench.user_files import find_files
    from plait.media.audio import AUDIO_EXTENSIONS

    if args.path:
        return find_files(args.path, AUDIO_EXTENSIONS, args.clips, "audio")
    if not 0 < args.min_seconds <= args.max_seconds:
        raise PlaitError(f"--min-seconds {args.min_seconds} and --max-seconds {args.max_seconds}: need 0 < min <= max")
    return write_clips(folder, args.clips, shortest=args.min_seconds, longest=args.max_seconds)


def measure(args, paths: list[Path], bar) -> dict:
    from plait.media import audio

    policy = audio.AudioPolicy(args.policy, mel_bins=args.mel_bins)
    extractor = whisper_extractor(args.mel_bins)
    task = bar.add_task("probe", total=len(paths) * (2 + args.repeats * (1 + (extractor is not None))))
    advance = lambda: bar.advance(task)  # noqa: E731
    paths, infos, planned = planning(paths)
    bar.advance(task, len(paths))
    paths, infos, checked = feature_check(paths, infos, policy, extractor)  # also warms both sides up
    bar.advance(task, len(paths))
    if not paths:
        raise PlaitError("no clip could be read: " + "; ".join(planned["errors"] + checked["errors"])[:2000])
    plait_walls, plain_walls, decodes = [], [], []
    for _ in range(args.repeats):
        passes = audio.AUDIO_DECODES.count
        plait_walls.append(plait_gather(paths, infos, policy, advance))
        decodes.append(audio.AUDIO_DECODES.count - passes)
        if extractor is not None:
            plain_walls.append(plain_loop(paths, extractor, advance))
    seconds = sum(info.duration for info in infos)
    plait_wall, plain_wall = min(plait_walls), min(plain_walls, default=None)
    return {"clips": len(paths), "audio_seconds": seconds, "tokens": sum(policy.plan(i).tokens for i in infos),
            "windows": sum(policy.plan(i).windows for i in infos), "plait_wall_s": plait_wall,
            "plain_wall_s": plain_wall, "ratio_wall": plain_wall / plait_wall if plain_wall else None,
            "plait_audio_s_per_s": seconds / plait_wall, "plain_audio_s_per_s": seconds / plain_wall if plain_wall else None,
            "decodes_per_clip": max(decodes) / len(paths), "probe_ms_per_clip": planned["probe_ms_per_clip"],
            "planning_decodes": planned["planning_decodes"], **{k: v for k, v in checked.items() if k != "errors"},
            "skipped": len(planned["errors"]) + len(checked["errors"]), "errors": planned["errors"] + checked["errors"]}


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="plait-bench-audio-") as tmp:
        err = Console(stderr=True)
        writing = not args.path and not args.quiet
        with err.status("writing the clips…", spinner="dots") if writing else contextlib.nullcontext():
            paths = clips_of(args, Path(tmp))
        with Progress(TextColumn("[bold]audio[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("clip passes"),
                      TimeElapsedColumn(), console=err, disable=args.quiet) as bar:
            result = measure(args, paths, bar)
    result = {"source": args.path or "generated", "policy": args.policy, "mel_bins": args.mel_bins, **result,
              "torch_threads": _torch_threads(), "cpus": os.cpu_count(),
              "loadavg": [round(x, 2) for x in (*load, *os.getloadavg())],
              "baseline": "PyAV + transformers.WhisperFeatureExtractor" if result["plain_wall_s"] else
              "none: transformers is not installed (pip install transformers); plait's own rate only"}
    if not args.quiet:
        _table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _torch_threads() -> int | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.get_num_threads()


def _table(r: dict) -> None:
    from rich.table import Table

    from plait.cli.common import table_console

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    t = Table(title=f"audio: plait's gather vs {r['baseline']}, {r['clips']} clips ({r['source']}), "
                    f"{r['audio_seconds']:,.1f} s of audio, policy {r['policy']}, {r['mel_bins']} mel bins")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_row("windows / placeholder tokens", f"{r['windows']:,} / {r['tokens']:,}")
    t.add_row("plait: seconds of audio per wall second", num(r["plait_audio_s_per_s"], ",.1f"))
    t.add_row("plain PyAV + extractor: seconds of audio per wall second", num(r["plain_audio_s_per_s"], ",.1f"))
    t.add_row("ratio_wall (plain wall / plait wall; target >= 1.0)", num(r["ratio_wall"], ".2f"))
    t.add_row("decode passes per clip (target 1)", f"{r['decodes_per_clip']:.3f}")
    t.add_row("decodes while planning (target 0)", str(r["planning_decodes"]))
    t.add_row("header probe, ms per clip", f"{r['probe_ms_per_clip']:.2f}")
    t.add_row(f"max |features - extractor's| (target <= {TARGET_DIFF:g})", num(r["max_feature_diff"], ".2e"))
    t.add_row("plait / extractor vs float64", f"{num(r['plait_vs_float64'], '.2e')} / "
                                              f"{num(r['extractor_vs_float64'], '.2e')}")
    t.add_row("files left out (unreadable)", str(r["skipped"]))
    t.add_row("torch threads / cpus / load average (start, end)",
              f"{r['torch_threads']} / {r['cpus']} / {r['loadavg'][0]:.1f}, {r['loadavg'][3]:.1f}")
    out = table_console()
    out.print(t)
    for line in r["errors"][:10]:
        out.print(f"  left out: {line}", highlight=False, soft_wrap=True, markup=False)
