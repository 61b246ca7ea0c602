"""`plait bench video`: video throughput of the loader against a plain PyAV loop, and decodes per video.

On N generated videos (H.264/MP4, MPEG-4/MOV, VP9/WebM; 96..320 px, 10..30 fps) or the first N of yours
(--path), as a LLaVA-Video source: the loader plans --steps global steps on the local runtime (DP --dp),
probing headers, and builds every rank's micro-batches (open, seek, decode the sampled frames, resize,
patchify); a plain PyAV loop takes the same frames of the same delivered videos in the same order (seek,
decode forward, the same resize and patchify; one thread). Frame rule: small by default (<= 64 tokens a
frame, 32 frames), or --qwen-defaults (qwen-vl-utils 0.0.14; --seq-len 131072 unless given).
ratio_wall = loader videos/s / PyAV videos/s (target >= 0.8); decode passes per delivered video (target 1);
frames decoded while planning (target 0). The reference resize against fast_resize: benchmarks.video_resize.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from plait.cli.bench.media_bench import Media, build_steps, loader_spec
from plait.media.video import VIDEO_EXTENSIONS

HELP = "videos/s and frames/s of the loader vs a plain PyAV loop over the same files; decodes per video"
DESCRIPTION = __doc__
SMALL_RULE = {"fps": 2.0, "min_frames": 4, "max_frames": 32, "min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 64,
              "total_pixels": 28 * 28 * 1024}


def add_arguments(p) -> None:
    MEDIA.add_arguments(p, steps=4, dp=2)
    p.add_argument("--max-seconds", type=float, default=6.0, help="longest generated video, seconds")
    p.add_argument("--seq-len", type=int, default=None, help="packing.seq_len (default 4096; 131072 with "
                   "--qwen-defaults)")
    p.add_argument("--qwen-defaults", action="store_true", help="the videos section's defaults (qwen-vl-utils "
                   "0.0.14's rule) instead of the bench's small frames")
    p.add_argument("--fast-resize", action="store_true", help="the loader (and the PyAV loop) resize in one "
                   "swscale pass (videos.fast_resize)")


def video_spec(path: Path, args):
    from plait.cli.video_data import video_source_spec

    if args.seq_len is None:
        args.seq_len = 131072 if args.qwen_defaults else 4096
    rule = {} if args.qwen_defaults else SMALL_RULE
    return loader_spec(args, {**video_source_spec(path), "on_error": "skip"},
                       videos={"video_token_id": 301, **rule, "fast_resize": args.fast_resize})


def generate(args, folder: Path) -> list[Path]:
    from plait.cli.video_data import write_video_source

    write_video_source(folder / "generated", args.videos, max_seconds=args.max_seconds)
    return sorted((folder / "generated" / "video").iterdir())


def source_of(files: list[Path], folder: Path) -> Path:
    """The LLaVA-Video JSON of `files` (absolute paths)."""
    path = folder / "videos.json"
    path.write_text(json.dumps([{"id": f"video-{i}", "video": str(f), "conversations": [
        {"from": "human", "value": f"<video>\nWhat happens in {f.name}?"}, {"from": "gpt", "value": "Things move."}]}
        for i, f in enumerate(files)]))
    return path


def plain_pyav(paths: list[Path], policy) -> tuple[float, int]:
    """The baseline loop (module docstring): (wall seconds, frames) over `paths` in order."""
    import av

    from plait.media.video import probe, resized_frame

    plans = [policy.plan(probe(str(p))) for p in paths]  # the same frames as the loader (not timed)
    frames, t0 = 0, time.perf_counter()
    for path, plan in zip(paths, plans):
        with av.open(str(path)) as c:
            s = c.streams.video[0]
            s.thread_type = "AUTO"
            times = np.asarray(plan.indices, float) / plan.fps_video
            c.seek(int(times[0] / s.time_base), stream=s, backward=True)
            out, k = [], 0
            for frame in c.decode(s):
                while k < len(times) and frame.time >= times[k] - 0.5 / plan.fps_video:
                    out.append(resized_frame(frame, plan, policy.fast_resize))
                    k += 1
                if k == len(times):
                    break
        x = np.stack(out)
        t, gh, gw = len(out) // 2, plan.height // 14, plan.width // 14
        x.reshape(t, 2, gh, 14, gw, 14, 3).transpose(0, 2, 4, 1, 3, 5, 6).reshape(-1, 2 * 14 * 14 * 3).copy()
        frames += len(out)
    return time.perf_counter() - t0, frames


def measure(args, files: list[Path], folder: Path) -> dict:
    from plait.media.video import FRAME_DECODES, VIDEO_DECODES
    from plait.sources.video import video_policy

    spec = video_spec(source_of(files, folder), args)
    delivered, frames = [], [0]

    def collect(mb):
        if mb.video_grid is not None:
            for d, g in zip(mb.video_document, mb.video_grid):
                delivered.append(files[int(mb.sample_ids[d, 3])])
                frames[0] += int(g[0]) * 2

    loader = build_steps(spec, args.steps, (VIDEO_DECODES, FRAME_DECODES), collect)
    pyav_s, pyav_frames = plain_pyav(delivered, video_policy(spec))
    n, wall = len(delivered), loader["plan_s"] + loader["build_wall_s"]
    loader_vps, pyav_vps = n / max(wall, 1e-9), n / max(pyav_s, 1e-9)
    return {"video_files": len(files), "rule": "qwen-vl-utils 0.0.14" if args.qwen_defaults else "small",
            "fast_resize": args.fast_resize, "steps": args.steps, "dp": args.dp, "delivered_videos": n,
            "loader_videos_per_s": loader_vps, "loader_frames_per_s": frames[0] / max(wall, 1e-9),
            "pyav_videos_per_s": pyav_vps, "pyav_frames_per_s": pyav_frames / max(pyav_s, 1e-9),
            "ratio_wall": loader_vps / max(pyav_vps, 1e-9), "target_ratio": 0.8,
            "loader_plan_s": loader["plan_s"], "loader_wall_s": wall, "pyav_wall_s": pyav_s,
            "ratio_wall_build_only": n / max(loader["build_wall_s"], 1e-9) / max(pyav_vps, 1e-9),
            "decodes_per_video": loader["decodes"] / max(n, 1), "planning_frame_decodes": loader["planning_decodes"],
            "frames_per_video": frames[0] / max(n, 1), "skipped": loader["skipped"], "errors": loader["errors"]}


def rows(r: dict) -> list[tuple[str, str]]:
    return [(f"videos delivered (all ranks, {r['steps']} steps)", f"{r['delivered_videos']:,}"),
            ("loader videos / s (wall: plan + build)", f"{r['loader_videos_per_s']:,.1f}"),
            ("plain PyAV videos / s (wall, one thread)", f"{r['pyav_videos_per_s']:,.1f}"),
            ("loader / PyAV frames / s", f"{r['loader_frames_per_s']:,.0f} / {r['pyav_frames_per_s']:,.0f}"),
            ("ratio_wall (target >= 0.8)", f"{r['ratio_wall']:.2f}"),
            ("ratio_wall without planning (header probes)", f"{r['ratio_wall_build_only']:.2f}"),
            ("decode passes per delivered video (target 1)", f"{r['decodes_per_video']:.3f}"),
            ("frames decoded while planning (target 0)", f"{r['planning_frame_decodes']}")]


MEDIA = Media("video", "video", VIDEO_EXTENSIONS, "videos", 24, generate, measure, rows,
              lambda r: f"video: loader (local, DP {r['dp']}) vs a plain PyAV loop, {r['video_files']} files ({r['source']})")

run = MEDIA.run
