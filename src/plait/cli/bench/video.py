"""`plait bench video`: video throughput of the loader against a plain PyAV loop, and decodes per video.

It writes N short videos (H.264/MP4, MPEG-4/MOV, VP9/WebM; 96..320 px, 10..30 fps, 1..--max-seconds s;
`plait demo --video`'s generator) as a LLaVA-Video JSON source, or, with `--path` (a folder or a glob),
lists the first N of your own video files in one, then in one run:

  loader   plans --steps global steps of that source on the local runtime (DP --dp) and builds every
           rank's micro-batches: probe headers (planning), then per delivered video open, seek, decode
           the sampled frames, resize, patchify and assemble `pixel_values_videos`. Wall time of the
           planning and the building together.
  pyav     a plain PyAV loop over the same delivered videos, in the same order: open, seek to the
           first sampled frame, decode forward taking the same frames, the same resize (full-size RGB +
           Pillow BICUBIC, or one swscale pass with --fast-resize) and patchify (numpy reshape). Wall
           time, one thread.
  resize   up to 8 of the delivered videos decoded both ways (videos.fast_resize off and on, each
           twice, interleaved, the faster kept): frames/s of each and how far the one-pass pixels are
           from the reference's (largest and mean absolute difference, share of values that differ).

The frame rule is small by default (at most 64 tokens a frame, 32 frames); `--qwen-defaults` uses the
`videos` section's defaults (qwen-vl-utils 0.0.14: up to 768 tokens a frame and 768 frames), with
--seq-len 131072 unless given, which holds any video under that rule.

ratio_wall = (loader videos / s) / (pyav videos / s), wall against wall (target >= 0.8); frames / s of
both; decodes_per_video (the loader's decode passes over the videos delivered: target 1) and
planning_frame_decodes (frames decoded while planning: target 0). The machine's load average is
recorded with the figures.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from plait.cli.bench.user_files import find_files

HELP = "videos/s and frames/s of the loader vs a plain PyAV loop over the same files; decodes per video"
DESCRIPTION = __doc__


def add_arguments(p) -> None:
    p.add_argument("--videos", type=int, default=24, help="distinct video files (with --path: the first N found)")
    p.add_argument("--path", help="a folder (searched recursively) or a glob of your video files (mp4, webm, mkv, "
                   "mov, avi) to measure instead of generated ones")
    p.add_argument("--max-seconds", type=float, default=6.0, help="longest generated video, seconds")
    p.add_argument("--steps", type=int, default=4, help="global steps the loader plans and builds")
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks (all built in this process)")
    p.add_argument("--seq-len", type=int, default=None, help="packing.seq_len (default 4096; 131072 with "
                   "--qwen-defaults)")
    p.add_argument("--qwen-defaults", action="store_true", help="the videos section's defaults (qwen-vl-utils "
                   "0.0.14's rule) instead of the bench's small frames")
    p.add_argument("--fast-resize", action="store_true", help="the loader (and the PyAV loop) resize in one "
                   "swscale pass (videos.fast_resize)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--quiet", action="store_true", help="no table")


SMALL_RULE = {"fps": 2.0, "min_frames": 4, "max_frames": 32, "min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 64,
              "total_pixels": 28 * 28 * 1024}


def video_spec(path: Path, args):
    from plait.cli.video_data import video_source_spec
    from plait.spec import load_spec

    rule = {} if args.qwen_defaults else SMALL_RULE
    source = video_source_spec(path)
    if args.path:  # a user's file that fails is counted and named, not the end of the measurement
        source["on_error"] = "skip"
    return load_spec({
        "seed": 7,
        "sources": [source],
        "images": {"patch": 14, "merge": 2, "image_token_id": 300},
        "videos": {"video_token_id": 301, **rule, "fast_resize": args.fast_resize},
        "packing": {"seq_len": args.seq_len, "microbatches": 1, "max_patches": 4 * args.seq_len},
        "topology": {"dp": args.dp},
        "cost": {"linear": 1.0, "quadratic": 0.0001, "encoder": {"linear": 2.0, "quadratic": 0.001}},
    })


def measure_loader(spec, steps: int, root: Path) -> dict:
    """Plan and build `steps` steps; the delivered videos (path, frame indices, size) in delivery order."""
    from plait.kernels import warm_up
    from plait.runtime import make_runtime
    from plait.media.video import FRAME_DECODES, VIDEO_DECODES

    warm_up()  # the planner's compiled kernels: once per process, not per video
    rt = make_runtime(spec, "local")
    delivered, frames, planning_frames = [], 0, 0
    passes = VIDEO_DECODES.count
    records = json.loads(Path(spec.sources[0].path).read_text())
    wall = plan_s = 0.0
    try:
        for _ in range(steps):
            t0, f0 = time.perf_counter(), FRAME_DECODES.count
            plan = rt.plan()
            plan_s += time.perf_counter() - t0
            planning_frames += FRAME_DECODES.count - f0
            for rank in range(plan.ranks):
                for mb in rt.build(plan, rank):
                    if mb.video_grid is None:
                        continue
                    for d, g in zip(mb.video_document, mb.video_grid):
                        delivered.append(root / records[int(mb.sample_ids[d, 3])]["video"])
                        frames += int(g[0]) * 2
            wall += time.perf_counter() - t0
            rt.release()
        passes = VIDEO_DECODES.count - passes
        errors = rt.error_report()
    finally:
        rt.close()
    return {"videos": len(delivered), "frames": frames, "wall_s": wall, "plan_s": plan_s, "planning_frame_decodes": planning_frames,
            "decode_passes": passes, "delivered": delivered,
            "skipped": sum(e["skipped"] for e in errors.values()),
            "errors": [m for e in errors.values() for m in e["messages"][:5]]}


def plain_pyav(paths: list[Path], policy) -> tuple[float, int]:
    """The baseline loop (module docstring): (wall seconds, frames) over `paths` in order."""
    import av

    from plait.media.video import probe, resized_frame

    plans = [policy.plan(probe(str(p))) for p in paths]  # the same frames as the loader (not timed)
    frames = 0
    t0 = time.perf_counter()
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


def compare_resize(paths: list[Path], policy, limit: int = 8) -> dict:
    """The resize both ways on up to `limit` distinct videos of `paths` (module docstring)."""
    from plait.media.video import probe, read_frames

    seconds = {False: 0.0, True: 0.0}
    frames = differ = values = 0
    largest, total = 0, 0.0
    videos = list(dict.fromkeys(paths))[:limit]
    for path in videos:
        plan = policy.plan(probe(str(path)))
        best, pixels = {False: float("inf"), True: float("inf")}, {}
        for fast in (False, True, False, True):
            t0 = time.perf_counter()
            pixels[fast] = read_frames(str(path), plan, fast_resize=fast)
            best[fast] = min(best[fast], time.perf_counter() - t0)
        diff = np.abs(pixels[False].astype(np.int16) - pixels[True].astype(np.int16))
        largest, total = max(largest, int(diff.max())), total + float(diff.sum())
        differ, values, frames = differ + int(np.count_nonzero(diff)), values + diff.size, frames + len(plan.indices)
        seconds[False] += best[False]
        seconds[True] += best[True]
    return {"videos": len(videos), "frames": frames,
            "reference_frames_per_s": frames / max(seconds[False], 1e-9),
            "fast_frames_per_s": frames / max(seconds[True], 1e-9),
            "fast_speedup": seconds[False] / max(seconds[True], 1e-9),
            "max_abs_diff": largest, "mean_abs_diff": total / max(values, 1), "share_differing": differ / max(values, 1)}


def source_of(args, folder: Path) -> Path:
    """The LLaVA-Video JSON the loader reads: generated videos, or the user's files (absolute paths)."""
    from plait.cli.video_data import write_video_source
    from plait.media.video import VIDEO_EXTENSIONS

    if not args.path:
        return write_video_source(folder, args.videos, max_seconds=args.max_seconds)
    files = find_files(args.path, VIDEO_EXTENSIONS, args.videos, "video")
    recs = [{"id": f"video-{i}", "video": str(f), "conversations": [
        {"from": "human", "value": f"<video>\nWhat happens in {f.name}?"}, {"from": "gpt", "value": "Things move."}]}
        for i, f in enumerate(files)]
    path = folder / "videos.json"
    path.write_text(json.dumps(recs))
    return path


def run(args) -> int:
    from plait.sources.video import video_policy

    if args.seq_len is None:
        args.seq_len = 131072 if args.qwen_defaults else 4096
    with tempfile.TemporaryDirectory(prefix="plait-bench-video-") as tmp:
        path = source_of(args, Path(tmp))
        files = len(json.loads(path.read_text()))
        spec = video_spec(path, args)
        load = os.getloadavg()
        loader = measure_loader(spec, args.steps, path.parent)
        pyav_s, pyav_frames = plain_pyav(loader["delivered"], video_policy(spec))
        resize = compare_resize(loader["delivered"], video_policy(spec))
    n = loader["videos"]
    loader_vps = n / max(loader["wall_s"], 1e-9)
    pyav_vps = n / max(pyav_s, 1e-9)
    result = {
        "video_files": files, "path": args.path, "rule": "qwen-vl-utils 0.0.14" if args.qwen_defaults else "small",
        "fast_resize": args.fast_resize, "steps": args.steps, "dp": args.dp, "delivered_videos": n,
        "loader_videos_per_s": loader_vps, "loader_frames_per_s": loader["frames"] / max(loader["wall_s"], 1e-9),
        "pyav_videos_per_s": pyav_vps, "pyav_frames_per_s": pyav_frames / max(pyav_s, 1e-9),
        "ratio_wall": loader_vps / max(pyav_vps, 1e-9), "target_ratio": 0.8,
        "loader_plan_s": loader["plan_s"], "loader_wall_s": loader["wall_s"], "pyav_wall_s": pyav_s,
        "ratio_wall_build_only": n / max(loader["wall_s"] - loader["plan_s"], 1e-9) / max(pyav_vps, 1e-9),
        "decodes_per_video": loader["decode_passes"] / max(n, 1),
        "planning_frame_decodes": loader["planning_frame_decodes"],
        "frames_per_video": loader["frames"] / max(n, 1), "loadavg": list(load) + list(os.getloadavg()),
        "skipped": loader["skipped"], "errors": loader["errors"], "resize": resize,
    }
    if not args.quiet:
        _table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def _table(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    where = r["path"] or "generated"
    t = Table(title=f"video: loader (local, DP {r['dp']}) vs a plain PyAV loop, {r['video_files']} files ({where})")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_row(f"videos delivered (all ranks, {r['steps']} steps)", f"{r['delivered_videos']:,}")
    t.add_row("loader videos / s (wall: plan + build)", f"{r['loader_videos_per_s']:,.1f}")
    t.add_row("plain PyAV videos / s (wall, one thread)", f"{r['pyav_videos_per_s']:,.1f}")
    t.add_row("loader / PyAV frames / s", f"{r['loader_frames_per_s']:,.0f} / {r['pyav_frames_per_s']:,.0f}")
    t.add_row("ratio_wall (target >= 0.8)", f"{r['ratio_wall']:.2f}")
    t.add_row("ratio_wall without planning (header probes)", f"{r['ratio_wall_build_only']:.2f}")
    t.add_row("decode passes per delivered video (target 1)", f"{r['decodes_per_video']:.3f}")
    t.add_row("frames decoded while planning (target 0)", f"{r['planning_frame_decodes']}")
    t.add_row("bad videos skipped", f"{r['skipped']}")
    z = r["resize"]
    t.add_row(f"resize, {z['videos']} videos: reference / fast_resize frames / s",
              f"{z['reference_frames_per_s']:,.1f} / {z['fast_frames_per_s']:,.1f} ({z['fast_speedup']:.2f}x)")
    t.add_row("fast_resize pixels vs the reference's: largest / mean |difference|, values differing",
              f"{z['max_abs_diff']} / {z['mean_abs_diff']:.2f}, {z['share_differing']:.1%}")
    Console().print(t)
    for line in r["errors"]:
        Console(stderr=True).print(f"  {line}", highlight=False, soft_wrap=True, markup=False)
