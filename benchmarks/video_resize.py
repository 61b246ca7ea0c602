"""`python -m benchmarks.video_resize`: the reference resize against the one-pass `fast_resize`.

On up to --videos videos (generated as `plait bench video` generates them, or the first of yours with
--path), under `plait bench video`'s frame rule, each video's sampled frames are decoded both ways
(videos.fast_resize off and on, each twice, interleaved, the faster kept): frames/s of each and how far
the one-pass pixels are from the reference's (largest and mean absolute difference, share of values
that differ).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import main, write_result
from plait.cli.bench import video as product
from plait.cli.bench.media_bench import find_files

HELP = "frames/s of the reference video resize vs fast_resize (one swscale pass), and how far their pixels differ"
DESCRIPTION = __doc__


def add_arguments(p) -> None:
    p.add_argument("--path", help="a folder or a glob of your video files (default: generated ones)")
    p.add_argument("--videos", type=int, default=8, help="videos compared (default 8)")
    p.add_argument("--max-seconds", type=float, default=6.0, help="longest generated video, seconds")
    p.add_argument("--qwen-defaults", action="store_true", help="the videos section's defaults as the frame rule")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")


def compare_resize(paths: list[Path], policy) -> dict:
    from plait.media.video import probe, read_frames

    seconds = {False: 0.0, True: 0.0}
    frames = differ = values = largest = 0
    total = 0.0
    for path in paths:
        plan = policy.plan(probe(str(path)))
        best, pixels = {False: float("inf"), True: float("inf")}, {}
        for fast in (False, True, False, True):
            t0 = time.perf_counter()
            pixels[fast] = read_frames(str(path), plan, fast_resize=fast)
            best[fast] = min(best[fast], time.perf_counter() - t0)
        diff = np.abs(pixels[False].astype(np.int16) - pixels[True].astype(np.int16))
        largest, total = max(largest, int(diff.max())), total + float(diff.sum())
        differ, values, frames = differ + int(np.count_nonzero(diff)), values + diff.size, frames + len(plan.indices)
        for fast in best:
            seconds[fast] += best[fast]
    return {"videos": len(paths), "frames": frames, "reference_frames_per_s": frames / max(seconds[False], 1e-9),
            "fast_frames_per_s": frames / max(seconds[True], 1e-9), "fast_speedup": seconds[False] / max(seconds[True], 1e-9),
            "max_abs_diff": largest, "mean_abs_diff": total / max(values, 1), "share_differing": differ / max(values, 1)}


def run(args) -> int:
    from rich.console import Console

    from plait.sources.video import video_policy

    args.seq_len, args.dp, args.fast_resize = None, 1, False
    with tempfile.TemporaryDirectory(prefix="plait-video-resize-") as tmp:
        files = (find_files(args.path, product.VIDEO_EXTENSIONS, args.videos, "video") if args.path
                 else product.generate(args, Path(tmp)))
        policy = video_policy(product.video_spec(product.source_of(files, Path(tmp)), args))
        z = compare_resize(files, policy)
    Console().print(f"resize, {z['videos']} videos, {z['frames']} frames: reference {z['reference_frames_per_s']:,.1f} "
                    f"/ fast_resize {z['fast_frames_per_s']:,.1f} frames/s ({z['fast_speedup']:.2f}x); pixels: largest "
                    f"|difference| {z['max_abs_diff']}, mean {z['mean_abs_diff']:.2f}, {z['share_differing']:.1%} differ")
    write_result(args.json, {"path": args.path, **z})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
