"""`plait bench video`: video throughput of the loader against a plain PyAV loop, and decodes per video.

It writes N short videos (H.264/MP4, MPEG-4/MOV, VP9/WebM; 96..320 px, 10..30 fps, 1..--max-seconds s;
`plait demo --video`'s generator) as a LLaVA-Video JSON source, then in one run:

  loader   plans --steps global steps of that source on the local runtime (DP --dp) and builds every
           rank's micro-batches: probe headers (planning), then per delivered video open, seek, decode
           the sampled frames, resize, patchify and assemble `pixel_values_videos`. Wall time of the
           planning and the building together.
  pyav     a plain PyAV loop over the same delivered videos, in the same order: open, seek to the
           first sampled frame, decode forward taking the same frames, the same resize (swscale
           BICUBIC to RGB24) and patchify (numpy reshape). Wall time, one thread.

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

HELP = "videos/s and frames/s of the loader vs a plain PyAV loop over the same files; decodes per video"
DESCRIPTION = __doc__


def add_arguments(p) -> None:
    p.add_argument("--videos", type=int, default=24, help="distinct video files")
    p.add_argument("--max-seconds", type=float, default=6.0, help="longest video, seconds")
    p.add_argument("--steps", type=int, default=4, help="global steps the loader plans and builds")
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks (all built in this process)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--quiet", action="store_true", help="no table")


def video_spec(path: Path, args):
    from plait.cli.video_data import video_source_spec
    from plait.spec import load_spec

    return load_spec({
        "seed": 7,
        "sources": [video_source_spec(path)],
        "images": {"patch": 14, "merge": 2, "image_token_id": 300},
        "videos": {"video_token_id": 301, "fps": 2.0, "min_frames": 4, "max_frames": 32,
                   "min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 64, "total_pixels": 28 * 28 * 1024},
        "packing": {"seq_len": args.seq_len, "microbatches": 1, "max_patches": 4 * args.seq_len},
        "topology": {"dp": args.dp},
        "cost": {"linear": 1.0, "quadratic": 0.0001, "encoder": {"linear": 2.0, "quadratic": 0.001}},
    })


def measure_loader(spec, steps: int, root: Path) -> dict:
    """Plan and build `steps` steps; the delivered videos (path, frame indices, size) in delivery order."""
    from plait.kernels import warm_up
    from plait.runtime import make_runtime
    from plait.transforms.video import FRAME_DECODES, VIDEO_DECODES

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
    finally:
        rt.close()
    return {"videos": len(delivered), "frames": frames, "wall_s": wall, "plan_s": plan_s, "planning_frame_decodes": planning_frames,
            "decode_passes": passes, "delivered": delivered}


def plain_pyav(paths: list[Path], policy) -> tuple[float, int]:
    """The baseline loop (module docstring): (wall seconds, frames) over `paths` in order."""
    import av

    from plait.transforms.video import probe

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
                    out.append(frame.to_ndarray(width=plan.width, height=plan.height, format="rgb24",
                                                interpolation="BICUBIC"))
                    k += 1
                if k == len(times):
                    break
        x = np.stack(out)
        t, gh, gw = len(out) // 2, plan.height // 14, plan.width // 14
        x.reshape(t, 2, gh, 14, gw, 14, 3).transpose(0, 2, 4, 1, 3, 5, 6).reshape(-1, 2 * 14 * 14 * 3).copy()
        frames += len(out)
    return time.perf_counter() - t0, frames


def run(args) -> int:
    from plait.cli.video_data import write_video_source
    from plait.sources.video import video_policy

    with tempfile.TemporaryDirectory(prefix="plait-bench-video-") as tmp:
        path = write_video_source(Path(tmp), args.videos, max_seconds=args.max_seconds)
        spec = video_spec(path, args)
        load = os.getloadavg()
        loader = measure_loader(spec, args.steps, path.parent)
        pyav_s, pyav_frames = plain_pyav(loader["delivered"], video_policy(spec))
    n = loader["videos"]
    loader_vps = n / max(loader["wall_s"], 1e-9)
    pyav_vps = n / max(pyav_s, 1e-9)
    result = {
        "video_files": args.videos, "steps": args.steps, "dp": args.dp, "delivered_videos": n,
        "loader_videos_per_s": loader_vps, "loader_frames_per_s": loader["frames"] / max(loader["wall_s"], 1e-9),
        "pyav_videos_per_s": pyav_vps, "pyav_frames_per_s": pyav_frames / max(pyav_s, 1e-9),
        "ratio_wall": loader_vps / max(pyav_vps, 1e-9), "target_ratio": 0.8,
        "loader_plan_s": loader["plan_s"], "loader_wall_s": loader["wall_s"], "pyav_wall_s": pyav_s,
        "ratio_wall_build_only": n / max(loader["wall_s"] - loader["plan_s"], 1e-9) / max(pyav_vps, 1e-9),
        "decodes_per_video": loader["decode_passes"] / max(n, 1),
        "planning_frame_decodes": loader["planning_frame_decodes"],
        "frames_per_video": loader["frames"] / max(n, 1), "loadavg": list(load) + list(os.getloadavg()),
    }
    if not args.quiet:
        _table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def _table(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"video: loader (local, DP {r['dp']}) vs a plain PyAV loop, {r['video_files']} files")
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
    Console().print(t)
